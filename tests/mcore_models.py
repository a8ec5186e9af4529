"""megatron-core's own models and checkpoints, on CPU under gloo, for the Megatron checkpoint
tests (tests/distributed/test_ckpt_megatron*.py).

Each function runs inside a rank of `megatron_2bw.testing.launch.spawn` (a gloo group is up) and
uses megatron-core 0.16 as Megatron-LM does: `parallel_state.initialize_model_parallel`, its
GPTModel (local layer spec) / BertModel with `use_cpu_initialization`, `sharded_state_dict` and
`dist_checkpointing.save`. The state saved is the one Megatron-LM's
megatron/training/checkpointing.py builds (`generate_state_dict`: args, checkpoint_version,
iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far); `args`
is an argparse.Namespace with Megatron-LM's argument names, as arguments.py names them.

Accelerator-only calls on megatron-core's CPU path are stubbed here, in the test, never in the
product (`cpu_stubs`): torch.cuda.synchronize and torch.cuda.current_device in
dist_checkpointing's save, and the CUDA RNG tracker's fork in its attention dropout (off: 0).
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch

SEQ, VOCAB, HIDDEN, HEADS, LAYERS, BATCH, ITERATION = 16, 128, 32, 4, 2, 4, 5
LR, MIN_LR, WARMUP_ITERS, DECAY_ITERS = 1e-3, 1e-4, 2, 40

# shape -> (our flags, megatron-core TransformerConfig kwargs, model kwargs)
SHAPES = {
    "gpt-learned": ("gpt", [], dict(ffn_hidden_size=4 * HIDDEN),
                    dict(position_embedding_type="learned_absolute",
                         share_embeddings_and_output_weights=True)),
    "gpt-llama": ("gpt", ["--position-embedding-type", "rope", "--normalization", "RMSNorm",
                          "--swiglu", "--group-query-attention", "--num-query-groups", "2",
                          "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                          "--ffn-hidden-size", "64"],
                  dict(ffn_hidden_size=64, normalization="RMSNorm", gated_linear_unit=True,
                       activation_func=torch.nn.functional.silu, add_bias_linear=False,
                       num_query_groups=2),
                  dict(position_embedding_type="rope", share_embeddings_and_output_weights=False)),
    "bert": ("bert", [], dict(ffn_hidden_size=4 * HIDDEN),
             dict(share_embeddings_and_output_weights=True)),
}
BASE = (f"--mock-data --num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads {HEADS} "
        f"--seq-length {SEQ} --micro-batch-size 1 --global-batch-size {BATCH} --vocab-size {VOCAB} "
        f"--hidden-dropout 0 --attention-dropout 0 --lr {LR} --min-lr {MIN_LR} --lr-decay-style "
        f"cosine --lr-warmup-iters {WARMUP_ITERS} --lr-decay-iters {DECAY_ITERS}").split()


def our_flags(shape: str, t: int, d: int, iters: int = ITERATION + 2) -> tuple[str, list[str]]:
    family, flags, _, _ = SHAPES[shape]
    return family, BASE + flags + ["--tensor-model-parallel-size", str(t),
                                   "--pipeline-model-parallel-size", str(d),
                                   "--train-iters", str(iters)]


def cpu_stubs() -> None:
    """The accelerator-only calls megatron-core's CPU path makes (module docstring)."""
    from megatron.core import tensor_parallel
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def build(shape: str, tp: int):
    """megatron-core's model of `shape` at tensor size `tp` (pipeline 1), with every parameter
    moved off its initialization (norms and biases too) identically on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig
    cpu_stubs()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, 1)
    family, _, config_kw, model_kw = SHAPES[shape]
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, **config_kw)
    torch.manual_seed(0)
    if family == "gpt":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        model = GPTModel(config, get_gpt_layer_local_spec(
            normalization=config_kw.get("normalization")), vocab_size=VOCAB,
            max_sequence_length=SEQ, **model_kw)
    else:
        from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
        from megatron.core.models.bert.bert_model import BertModel
        model = BertModel(config, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec,
                          vocab_size=VOCAB, max_sequence_length=SEQ, add_binary_head=True,
                          **model_kw)
    rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(sum(map(ord, name)) * 7 + (rank if sharded else 0))
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def batch_loss(model, shape: str, first: int = 0) -> float:
    """megatron-core's forward loss on the samples [first, first + BATCH) of our mock data, as
    our loss defines it: the mean over samples of each sample's mean token loss (GPT) or masked
    LM loss plus sentence-order cross entropy (BERT)."""
    family = SHAPES[shape][0]
    losses = []
    with torch.no_grad():
        for i in range(first, first + BATCH):
            if family == "gpt":
                from megatron_2bw.data.mock import MockGPTDataset
                sample = MockGPTDataset(VOCAB, SEQ)[i]
                tokens, labels = sample[None, :-1], sample[None, 1:]
                mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]
                per_token = model(tokens, torch.arange(SEQ)[None], mask, labels=labels)
                losses.append(float(per_token.float().mean()))
            else:
                from megatron_2bw.data.bert_mock import MockBertDataset
                s = MockBertDataset(VOCAB, SEQ)[i]
                per_token, binary = model(s["tokens"][None], s["padding_mask"][None],
                                          tokentype_ids=s["types"][None],
                                          lm_labels=s["labels"].clamp_min(0)[None])
                mask = s["loss_mask"].float()
                lm = float((per_token[0].float() * mask).sum() / mask.sum().clamp_min(1.0))
                lm += float(torch.nn.functional.cross_entropy(binary.float(),
                                                              s["is_random"][None]))
                losses.append(lm)
    return sum(losses) / len(losses)


def megatron_args(shape: str, tp: int, world: int, **extra) -> argparse.Namespace:
    """Megatron-LM's arguments of this run (megatron/training/arguments.py's names)."""
    family, _, c, m = SHAPES[shape]
    swiglu = c.get("gated_linear_unit", False)
    groups = c.get("num_query_groups")
    args = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=c["ffn_hidden_size"],
        num_attention_heads=HEADS, kv_channels=HIDDEN // HEADS,
        group_query_attention=groups is not None, num_query_groups=groups or 1,
        max_position_embeddings=SEQ, seq_length=SEQ,
        position_embedding_type=m.get("position_embedding_type", "learned_absolute"),
        add_position_embedding=m.get("position_embedding_type") != "rope", rotary_percent=1.0,
        rotary_base=10000, rotary_interleaved=False, normalization=c.get("normalization",
                                                                         "LayerNorm"),
        norm_epsilon=1e-5, apply_layernorm_1p=False, swiglu=swiglu,
        add_bias_linear=c.get("add_bias_linear", True), add_qkv_bias=False,
        untie_embeddings_and_output_weights=not m["share_embeddings_and_output_weights"],
        qk_layernorm=False, padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128,
        bias_gelu_fusion=False, openai_gelu=False, bert_binary_head=family == "bert",
        num_experts=None, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        data_parallel_size=world // tp, world_size=world, micro_batch_size=1,
        global_batch_size=BATCH, consumed_train_samples=ITERATION * BATCH, train_iters=100,
        lr=LR, min_lr=MIN_LR, lr_decay_style="cosine", lr_warmup_iters=WARMUP_ITERS,
        lr_decay_iters=DECAY_ITERS, weight_decay=0.01, optimizer="adam", adam_beta1=0.9,
        adam_beta2=0.999, adam_eps=1e-8, fp16=False, bf16=False, use_distributed_optimizer=False,
        ckpt_format="torch_dist", no_save_optim=None, no_save_rng=None)
    args.update(extra)
    return argparse.Namespace(**args)


def scheduler_state(params, iteration: int = ITERATION) -> dict:
    """megatron-core's OptimizerParamScheduler (as Megatron-LM builds it for iteration-based
    runs: steps in samples) stepped `iteration` times."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    opt = torch.optim.AdamW(params, lr=LR)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR,
                                    lr_warmup_steps=WARMUP_ITERS * BATCH,
                                    lr_decay_steps=DECAY_ITERS * BATCH, lr_decay_style="cosine",
                                    start_wd=0.01, end_wd=0.01, wd_incr_steps=DECAY_ITERS * BATCH,
                                    wd_incr_style="constant")
    for _ in range(iteration):
        sched.step(increment=BATCH)
    return sched.state_dict()


def save(model, shape: str, root: str, rank: int, world: int, tp: int, extra_state=None,
         **args) -> str:
    """dist_checkpointing.save of Megatron-LM's state into root/iter_XXXXXXX, then `latest`."""
    from megatron.core import dist_checkpointing
    directory = os.path.join(root, f"iter_{ITERATION:07d}")
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    state = {"args": megatron_args(shape, tp, world, **args), "checkpoint_version": 3.0,
             "iteration": ITERATION, "model": model.sharded_state_dict(),
             "opt_param_scheduler": scheduler_state(list(model.parameters())),
             "num_floating_point_operations_so_far": 0, **(extra_state or {})}
    dist_checkpointing.save(state, directory)
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    return directory


def save_worker(rank, world, runs, out):
    """A rank of megatron-core's runs, one after the other in this process group ((shape, tp,
    root) each, data parallel over the rest of the world): build, save, and write every batch
    loss to `out` (one process group for all: megatron-core's save starts a helper process
    once per process)."""
    losses = {}
    for shape, tp, root in runs:
        model = build(shape, tp)
        save(model, shape, root, rank, world, tp)
        losses[shape, tp] = batch_loss(model, shape)  # every tensor rank takes part
    if rank == 0:
        torch.save(losses, out)
