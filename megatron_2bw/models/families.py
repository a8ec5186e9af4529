"""The model families (`--model` flavours belong to one of them): what a family is made of, one
`ModelFamily` each, and `model_parts`, the one way to build a configured model's layer specs,
loss and stage boundaries (training, checkpoint conversion, the planner's profile all ask it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from megatron_2bw.config import Config
from megatron_2bw.data.bert_mock import BertBatches, MockBertDataset
from megatron_2bw.data.mock import GPTBatches, MockGPTDataset
from megatron_2bw.models.bert import bert_layer_specs, bert_partition, make_bert_loss
from megatron_2bw.models.gpt import gpt_layer_specs, gpt_partition, make_gpt_loss
from megatron_2bw.tensor_parallel import TPGroup


@dataclass(frozen=True)
class ModelFamily:
    """layer_specs(model_cfg, tp, seed) -> [LayerSpec]; make_loss(tp) -> loss(output, labels);
    partition(model_cfg, stages) -> spec-index boundaries; mock_dataset(vocab, seq, seed=) ->
    synthetic samples (--mock-data); batches(dataset, micro, m, w, dp_rank, start_batch=) ->
    this replica's microbatches."""
    name: str
    layer_specs: Callable
    make_loss: Callable
    partition: Callable
    mock_dataset: Callable
    batches: Callable


FAMILIES = {f.name: f for f in (
    ModelFamily("gpt", gpt_layer_specs, make_gpt_loss, gpt_partition, MockGPTDataset, GPTBatches),
    ModelFamily("bert", bert_layer_specs, make_bert_loss, bert_partition, MockBertDataset,
                BertBatches),
)}


def model_parts(cfg: Config, tp: TPGroup = TPGroup(), num_stages: int = 1):
    """(layer specs, loss function, stage boundaries) of the configured model family."""
    family = FAMILIES[cfg.model.family]
    if cfg.parallel.sequence_parallel != tp.sequence_parallel:
        tp = dataclasses.replace(tp, sequence_parallel=cfg.parallel.sequence_parallel)
    partition = cfg.parallel.partition if (cfg.parallel.partition and num_stages > 1) else \
        family.partition(cfg.model, num_stages)
    loss = make_gpt_loss(tp, masked=True) if cfg.model.eod_mask_loss else family.make_loss(tp)
    return family.layer_specs(cfg.model, tp, seed=cfg.train.seed), loss, partition
