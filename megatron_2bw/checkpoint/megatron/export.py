"""Writing our checkpoints in megatron-core's torch_dist format (`--save ... --ckpt-format
megatron`, `tools/checkpoint_convert.py to-megatron`): a directory megatron-core's own
`dist_checkpointing.load` reads into its GPTModel / BertModel and Megatron-LM's
`pretrain_gpt.py --load` continues from.

    metadata.json        dist_checkpointing's marker: {"sharded_backend": "torch_dist", ...}
    .metadata, *.distcp  DCP's files; tensors under megatron-core's sharded keys (mapping.py:
                         stacked layers, QKV with zero key biases, SwiGLU [gate; up]) in the
                         model's dtype; the optimizer in its plain layout:
                         optimizer.state.exp_avg / exp_avg_sq / momentum_buffer.<key>, and the
                         fp32 main weights as optimizer.state.fp32_param.<key> (bf16/fp16);
                         each linear's `_extra_state` object (None, as megatron-core's local
                         layers hold)
    common.pt            what Megatron-LM's checkpointing.py writes beside them: args (its
                         argument names), checkpoint_version 3.0, iteration, opt_param_scheduler
                         (steps in samples), optimizer (param groups, common_step),
                         num_floating_point_operations_so_far, content_metadata; and our own
                         record (OURS_KEY: the common state of checkpoint/api.common_state), so
                         that we resume it exactly
    checksums.sha256     ours: a reader here verifies the files; Megatron ignores it

What Megatron has no place for goes under our own keys (`megatron_2bw.`: 2BW's previous version,
Adam's kept gradient, each rank's RNG state), which megatron-core's loader leaves alone. Megatron's
RNG state is not written (args.no_save_rng: Megatron keeps its own on --load).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from megatron_2bw.checkpoint.dist.shards import MODEL, OPTIMIZER, PREVIOUS, Shard
from megatron_2bw.checkpoint.megatron import mapping
from megatron_2bw.checkpoint.megatron.detect import MCORE_METADATA, OURS_KEY

OURS_PREFIX = OURS_KEY + "."
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}
STATE_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum": "momentum_buffer"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
            "mlp.linear_fc2")


def _theirs(key: str, layer, link, offsets, tensor, layers: int) -> Shard:
    if layer is None:
        return Shard(key, tensor, link.shape, tuple(offsets))
    return Shard(key, tensor.unsqueeze(0), (layers, *link.shape), (layer, *offsets))


def foreign_shards(shards: list[Shard], m, dtype: str) -> list[Shard]:
    """Our boxes (checkpoint/dist/shards.py names) as megatron-core's (module docstring)."""
    by_name = {x.ours: x for x in mapping.links(m)}
    low = _DTYPES[dtype]
    out = []
    for s in shards:
        if s.name.startswith(PREVIOUS) or s.name.startswith(OPTIMIZER + "last_grad."):
            out.append(replace(s, name=OURS_PREFIX + s.name))
            continue
        if s.name.startswith(MODEL):
            ours, prefixes = s.name[len(MODEL):], [("", low)]
            if low != torch.float32:
                prefixes.append(("optimizer.state.fp32_param.", torch.float32))
        else:
            kind, ours = s.name[len(OPTIMIZER):].split(".", 1)
            prefixes = [(f"optimizer.state.{STATE_KEYS[kind]}.", torch.float32)]
        link = by_name[ours]
        key, layer = mapping.dist_key(link.theirs)
        shape = tuple(s.tensor.shape)
        for prefix, dt in prefixes:
            for p in mapping.pieces(link, s.offsets, shape):
                out.append(_theirs(prefix + key, layer, link, p.offsets,
                                   p.select(s.tensor).to(dt), m.num_layers))
            for o, n in mapping.key_pieces(link, s.offsets, shape):
                out.append(_theirs(prefix + key, layer, link, o, torch.zeros(n, dtype=dt),
                                   m.num_layers))
    return out


def extra_state_objects(m) -> dict:
    """The `_extra_state` objects megatron-core's model asks for (local layers: None), each
    stored as megatron-core stores a ShardedObject's data: inside a one-element list."""
    block, L = mapping.block_name(m.family), m.num_layers
    out = {f"{block}.layers.{name}._extra_state/shard_{i}_{L}": [None]
           for name in _LINEARS for i in range(L)}
    if m.family == "bert":
        out["output_layer._extra_state/shard_0_1"] = [None]
    return out


def megatron_args(cfg, parallel: dict, iteration: int) -> argparse.Namespace:
    """Megatron-LM's arguments for this run (its arguments.py names; what its
    check_checkpoint_args and load_checkpoint read)."""
    m, o, B = cfg.model, cfg.optimizer, cfg.global_batch_size
    rope = m.position_embedding_type == "rope"
    args = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_size,
        num_attention_heads=m.num_attention_heads, kv_channels=m.kv_channels,
        group_query_attention=m.group_query_attention, num_query_groups=m.query_groups,
        seq_length=m.seq_length, max_position_embeddings=m.max_positions,
        position_embedding_type=m.position_embedding_type, add_position_embedding=not rope,
        rotary_percent=m.rotary_percent, rotary_base=int(m.rotary_base),
        rotary_interleaved=False, normalization=m.normalization,
        norm_epsilon=m.layernorm_epsilon, apply_layernorm_1p=m.apply_layernorm_1p,
        swiglu=m.swiglu, add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_bias_linear,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        qk_layernorm=m.qk_layernorm, padded_vocab_size=m.vocab_size,
        make_vocab_size_divisible_by=128, tokenizer_type=None, vocab_file=None,
        openai_gelu=m.openai_gelu, bias_gelu_fusion=False, bias_swiglu_fusion=False,
        bert_binary_head=m.bert_binary_head, num_experts=None, init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=parallel.get("tensor"),
        pipeline_model_parallel_size=parallel.get("pipeline"),
        data_parallel_size=parallel.get("data"), world_size=parallel.get("world"),
        data_parallel_random_init=False, micro_batch_size=cfg.batch.micro_batch_size,
        global_batch_size=B, rampup_batch_size=None, consumed_train_samples=iteration * B,
        skipped_train_samples=0, consumed_valid_samples=0, train_iters=cfg.train.train_iters,
        iteration=iteration, lr=o.lr, min_lr=o.min_lr, lr_decay_style=o.lr_decay_style,
        lr_warmup_init=o.lr_warmup_init, weight_decay=o.weight_decay, optimizer=o.name,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        sgd_momentum=o.sgd_momentum, clip_grad=o.clip_grad, fp16=cfg.precision.dtype == "fp16",
        bf16=cfg.precision.dtype == "bf16", loss_scale=cfg.precision.loss_scale,
        use_distributed_optimizer=False, ckpt_format="torch_dist", no_save_optim=False,
        no_save_rng=True, seed=cfg.train.seed)
    return argparse.Namespace(**args)


def scheduler_state(cfg, iteration: int) -> dict:
    """Megatron's OptimizerParamScheduler.state_dict() of this run's schedule (samples)."""
    from megatron_2bw.optim.lr import LRSchedule
    o, B = cfg.optimizer, cfg.global_batch_size
    sched = LRSchedule(o, cfg.train.train_iters, B)
    return {"max_lr": o.lr, "lr_warmup_steps": sched.warmup_iters * B,
            "num_steps": iteration * B, "lr_decay_style": o.lr_decay_style,
            "lr_decay_steps": sched.decay_iters * B, "min_lr": o.min_lr,
            "start_wd": o.weight_decay, "end_wd": o.weight_decay, "wd_incr_style": "constant",
            "wd_incr_steps": sched.decay_iters * B}


def _optimizer(cfg, steps: int, iteration: int) -> dict:
    """The optimizer's non-tensor state as megatron-core's plain optimizers save it: Megatron's
    two parameter groups (weight decay on matrices, none on vectors), the step as common_step;
    wrapped in "optimizer" for the bf16/fp16 one (Float16OptimizerWithFloat16Params)."""
    from megatron_2bw.optim.lr import LRSchedule
    o = cfg.optimizer
    lr = LRSchedule(o, cfg.train.train_iters, cfg.global_batch_size)(iteration)
    groups = []
    for wd_mult in (1.0, 0.0):
        group = dict(wd_mult=wd_mult, lr_mult=1.0, is_expert_parallel=False,
                     is_decoupled_lr=False, default_config=True, max_lr=o.lr, min_lr=o.min_lr,
                     lr=lr, weight_decay=o.weight_decay * wd_mult)
        if o.name == "adam":
            group.update(betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, amsgrad=False,
                         maximize=False, foreach=None, capturable=False, differentiable=False,
                         fused=None, decoupled_weight_decay=True)
        else:
            group.update(momentum=o.sgd_momentum, dampening=0, nesterov=False, maximize=False,
                         foreach=None, differentiable=False, fused=None)
        groups.append(group)
    inner = {"state": {"common_step": torch.tensor(float(steps))}, "param_groups": groups}
    return inner if cfg.precision.dtype == "fp32" else {"optimizer": inner}


def megatron_common(cfg, ours: dict, optimizer_other: dict | None) -> dict:
    """common.pt of the export: Megatron-LM's entries and our record (`ours`: common_state)."""
    it = int(ours["iteration"])
    state = {"args": megatron_args(cfg, ours.get("parallel") or {}, it),
             "checkpoint_version": 3.0, "iteration": it,
             "opt_param_scheduler": scheduler_state(cfg, it),
             "num_floating_point_operations_so_far": 0,
             "content_metadata": {"singleton_local_shards": False,
                                  "chained_optim_avoid_prefix": True},
             OURS_KEY: dict(ours, optimizer=optimizer_other)}
    if optimizer_other is not None:
        state["optimizer"] = _optimizer(cfg, int(optimizer_other.get("steps", 0)), it)
    return state


class MegatronExport:
    """What checkpoint/dist/save.py's save does differently for --ckpt-format megatron: the
    boxes under megatron-core's keys, the extra-state objects (rank 0), Megatron's common.pt,
    and metadata.json."""

    def __init__(self, cfg, rank: int):
        m = cfg.model
        if m.family == "bert" and (m.normalization != "LayerNorm" or m.apply_layernorm_1p):
            from megatron_2bw.checkpoint.files import CheckpointError
            from megatron_2bw.checkpoint.megatron.common import BERT_HEAD_NORM
            raise CheckpointError(f"--ckpt-format megatron cannot hold this BERT exactly: "
                                  f"Megatron's has {BERT_HEAD_NORM}: save it with "
                                  "--ckpt-format torch_dist")
        self.cfg, self.rank = cfg, rank
        self.files = {MCORE_METADATA: json.dumps(METADATA_JSON).encode()}

    def apply(self, shards: list[Shard], objects: dict, common: dict) -> tuple[list, dict, dict]:
        out = foreign_shards(shards, self.cfg.model, self.cfg.precision.dtype)
        objects = {OURS_PREFIX + k: v for k, v in objects.items()}
        if self.rank == 0:
            objects.update(extra_state_objects(self.cfg.model))
        return out, objects, megatron_common(self.cfg, common, common.get("optimizer"))
