"""megatron-core's own models and checkpoints, on CPU under gloo, for the Megatron checkpoint
tests (tests/distributed/test_ckpt_megatron*.py).

Each function runs inside a rank of `megatron_2bw.training.spawn.spawn` (a gloo group is up)
and uses megatron-core 0.16 as Megatron-LM does: `parallel_state.initialize_model_parallel`, its
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
    # SwiGLU with biases (gate and up biases), --kv-channels != hidden / heads, untied, learned
    "gpt-swiglu-bias": ("gpt", ["--swiglu", "--ffn-hidden-size", "48", "--kv-channels", "16",
                                "--untie-embeddings-and-output-weights"],
                        dict(ffn_hidden_size=48, gated_linear_unit=True, kv_channels=16,
                             activation_func=torch.nn.functional.silu),
                        dict(position_embedding_type="learned_absolute",
                             share_embeddings_and_output_weights=False)),
    # --qk-layernorm (RMSNorm over each head), RoPE, multi-query attention, tied, no biases
    "gpt-qk": ("gpt", ["--position-embedding-type", "rope", "--normalization", "RMSNorm",
                       "--qk-layernorm", "--group-query-attention", "--num-query-groups", "2",
                       "--kv-channels", "16", "--disable-bias-linear", "--sequence-parallel"],
               dict(ffn_hidden_size=4 * HIDDEN, normalization="RMSNorm", qk_layernorm=True,
                    num_query_groups=2, kv_channels=16, add_bias_linear=False),
               dict(position_embedding_type="rope", share_embeddings_and_output_weights=True)),
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
            normalization=config_kw.get("normalization"),
            qk_layernorm=config_kw.get("qk_layernorm", False)), vocab_size=VOCAB,
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


def sample_loss(model, shape: str, i: int) -> torch.Tensor:
    """megatron-core's forward loss on sample i of our mock data, as our loss defines it: the
    mean token loss (GPT) or the masked LM loss plus sentence-order cross entropy (BERT)."""
    if SHAPES[shape][0] == "gpt":
        from megatron_2bw.data.mock import MockGPTDataset
        sample = MockGPTDataset(VOCAB, SEQ)[i]
        tokens, labels = sample[None, :-1], sample[None, 1:]
        mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]
        return model(tokens, torch.arange(SEQ)[None], mask, labels=labels).float().mean()
    from megatron_2bw.data.bert_mock import MockBertDataset
    s = MockBertDataset(VOCAB, SEQ)[i]
    per_token, binary = model(s["tokens"][None], s["padding_mask"][None],
                              tokentype_ids=s["types"][None],
                              lm_labels=s["labels"].clamp_min(0)[None])
    mask = s["loss_mask"].float()
    lm = (per_token[0].float() * mask).sum() / mask.sum().clamp_min(1.0)
    return lm + torch.nn.functional.cross_entropy(binary.float(), s["is_random"][None])


def batch_loss(model, shape: str, first: int = 0) -> float:
    """The mean of `sample_loss` over the samples [first, first + BATCH) (our batch loss)."""
    with torch.no_grad():
        return sum(float(sample_loss(model, shape, i)) for i in range(first, first + BATCH)) \
            / BATCH


def megatron_args(shape: str, tp: int, world: int, **extra) -> argparse.Namespace:
    """Megatron-LM's arguments of this run (megatron/training/arguments.py's names)."""
    family, _, c, m = SHAPES[shape]
    swiglu = c.get("gated_linear_unit", False)
    groups = c.get("num_query_groups")
    args = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=c["ffn_hidden_size"],
        num_attention_heads=HEADS, kv_channels=c.get("kv_channels", HIDDEN // HEADS),
        group_query_attention=groups is not None, num_query_groups=groups or 1,
        max_position_embeddings=SEQ, seq_length=SEQ,
        position_embedding_type=m.get("position_embedding_type", "learned_absolute"),
        add_position_embedding=m.get("position_embedding_type") != "rope", rotary_percent=1.0,
        rotary_base=10000, rotary_interleaved=False, normalization=c.get("normalization",
                                                                         "LayerNorm"),
        norm_epsilon=1e-5, apply_layernorm_1p=False, swiglu=swiglu,
        add_bias_linear=c.get("add_bias_linear", True), add_qkv_bias=False,
        untie_embeddings_and_output_weights=not m["share_embeddings_and_output_weights"],
        qk_layernorm=c.get("qk_layernorm", False), padded_vocab_size=VOCAB,
        make_vocab_size_divisible_by=128,
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


# -- optimizer state ----------------------------------------------------------------------------
BETAS, EPS, WEIGHT_DECAY, STEPS = (0.9, 0.999), 1e-8, 0.01, 3


def plain_optimizer(model):
    """megatron-core's FP32Optimizer over torch.optim.AdamW with Megatron's two parameter groups
    (weight decay on matrices, none on biases and norms; optimizer/__init__.py's keys). Its
    constructor makes a CUDA tensor (the loss scale 1.0): made on the CPU here (test stub)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    keys = dict(lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False,
                default_config=True, max_lr=LR, min_lr=MIN_LR)
    groups = [dict(params=decay, wd_mult=1.0, weight_decay=WEIGHT_DECAY, **keys),
              dict(params=no_decay, wd_mult=0.0, weight_decay=0.0, **keys)]
    inner = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    real = torch.tensor
    torch.tensor = lambda *a, device=None, **k: real(*a, **k)  # the CUDA loss scale -> CPU
    try:
        return FP32Optimizer(inner, OptimizerConfig(lr=LR, clip_grad=0.0), lambda opt, cfg: None)
    finally:
        torch.tensor = real


def train_steps(model, shape: str, optimizer, steps: int = STEPS) -> None:
    """`steps` real steps of megatron-core's optimizer on batches 0.. of our mock data."""
    model.train()
    for k in range(steps):
        optimizer.zero_grad()
        loss = sum(sample_loss(model, shape, k * BATCH + i) for i in range(BATCH)) / BATCH
        loss.backward()
        optimizer.step()
    model.eval()


def fully_reshardable(model_sd: dict, optimizer) -> dict:
    """The distributed optimizer's model-space layout (DistributedOptimizer.sharded_state_dict
    with distrib_optim_sharding_type "fully_reshardable", sharded_param_state_fully_reshardable):
    per model parameter its fp32 "param" and Adam's moments under optimizer.state.<key>.<model
    key>, the step in param_groups. Built from megatron-core's own ShardedTensor metadata and
    the plain optimizer's state (megatron-core's DistributedOptimizer needs CUDA buffers)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    sharded, _ = extract_sharded_tensors_and_factories(model_sd)
    state = optimizer.optimizer.state
    param_state = {}
    for i, sh in enumerate(sharded.values()):
        own = state[sh.data] if sh.data in state else None
        if own is None:
            continue
        tensors = {"param": sh.data.detach().clone(), "exp_avg": own["exp_avg"],
                   "exp_avg_sq": own["exp_avg_sq"]}
        param_state[i] = {}
        for key, t in tensors.items():
            kw = dict(key=f"optimizer.state.{key}.{sh.key}", data=t)
            if not isinstance(sh, ShardedTensorFactory):
                kw["dtype"] = t.dtype
            param_state[i][key] = replace(sh, **kw)
    groups = []
    for g in optimizer.optimizer.state_dict()["param_groups"]:
        g = {k: v for k, v in g.items() if k != "params"}
        groups.append(dict(g, step=STEPS))
    return {"optimizer": {"param_groups": groups}, "param_state": param_state,
            "param_state_sharding_type": "fully_reshardable"}


def bf16_model(model_sd: dict) -> dict:
    """The model's sharded state with its tensors in bf16 (a bf16 run's model weights; the
    exact fp32 ones are the optimizer's "param")."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    out = {}
    for k, v in model_sd.items():
        if isinstance(v, ShardedTensor):
            out[k] = replace(v, data=v.data.detach().bfloat16(), dtype=torch.bfloat16)
        elif isinstance(v, ShardedTensorFactory):
            out[k] = replace(v, data=v.data.detach().bfloat16())
        else:
            out[k] = v
    return out


def rng_state(rank: int, tp: int):
    """Megatron-LM's get_rng_state for torch_dist: one ShardedObject per (pipeline, tensor) rank
    (the CUDA entries, accelerator-only, hold the CPU state's bytes here)."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    torch.manual_seed(1000 + ps.get_tensor_model_parallel_rank())
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {}}
    return ShardedObject("rng_state", [state], (1, tp), (0, ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank())


def optimizer_save_worker(rank, world, runs, out):
    """megatron-core runs that train STEPS steps with its own FP32Optimizer and save with their
    optimizer state: (shape, tp, root, layout) with layout "plain" (the FP32Optimizer's
    sharded_state_dict), "distributed" (`fully_reshardable`, bf16 model weights) or
    "dp_reshardable" (a bucket layout: no per-parameter tensors). Writes each run's loss on the
    fixed batch and its tensors per key to `out`."""
    results = {}
    for shape, tp, root, layout in runs:
        model = build(shape, tp)
        opt = plain_optimizer(model)
        train_steps(model, shape, opt)
        model_sd = model.sharded_state_dict()
        if layout == "plain":
            extra = {"optimizer": opt.sharded_state_dict(model_sd)}
        elif layout == "distributed":
            extra = {"optimizer": fully_reshardable(model_sd, opt)}
            model_sd = bf16_model(model_sd)
        else:
            extra = {"optimizer": {"optimizer": {"param_groups": []},
                                   "param_state_sharding_type": "dp_reshardable"}}
        extra.update(model=model_sd, rng_state=rng_state(rank, tp))
        save(model, shape, root, rank, world, tp, extra_state=extra,
             use_distributed_optimizer=layout != "plain", bf16=layout == "distributed")
        results[shape, tp, layout] = batch_loss(model, shape)
    if rank == 0:
        torch.save(results, out)


# -- --ckpt-format torch ------------------------------------------------------------------------
# Megatron's legacy model (NVIDIA/Megatron-LM megatron/legacy/model/language_model.py,
# transformer.py and bert_model.py, removed in commits 39ec5ebeb4, 8de8238844 and 7f8f37e0c0; its
# converter tools/checkpoint/loader_legacy.py reads the same names) saves a nested state dict:
# model["language_model"]["embedding"]["word_embeddings"]["weight"], ...["position_embeddings"],
# model["language_model"]["encoder"]["layers.<i>.<attribute>.<param>"] and "final_norm.*",
# model["language_model"]["output_layer"]["weight"] (untied), and on a last pipeline stage of a
# tied model model["word_embeddings_for_head"]["weight"]. Its ParallelTransformerLayer's
# attributes for megatron-core's local-spec modules:
LEGACY_LAYER = {"input_layernorm": "input_norm", "self_attention.linear_qkv":
                "self_attention.query_key_value", "self_attention.linear_proj":
                "self_attention.dense", "pre_mlp_layernorm": "post_attention_norm",
                "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h"}


def legacy_model_state(state: dict, layers: range, first: bool, last: bool, tied: bool) -> dict:
    """megatron-core's (local spec) state dict of a whole model as the legacy model's state of
    the pipeline stage holding `layers` (numbered from 0 in the stage, as Megatron saves)."""
    lm = {"encoder": {}}
    out = {"language_model": lm}
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        if key.startswith("embedding.") and first:
            table, param = key[len("embedding."):].rsplit(".", 1)
            lm.setdefault("embedding", {}).setdefault(table, {})[param] = value
        elif key.startswith("decoder.layers."):
            i, rest = key[len("decoder.layers."):].split(".", 1)
            module, param = rest.rsplit(".", 1)
            if int(i) in layers:
                lm["encoder"][f"layers.{int(i) - layers.start}.{LEGACY_LAYER[module]}.{param}"] = \
                    value
        elif key.startswith("decoder.final_layernorm.") and last:
            lm["encoder"]["final_norm." + key.rsplit(".", 1)[1]] = value
        elif key == "output_layer.weight" and last:
            lm["output_layer"] = {"weight": value}
    if last and tied and not first:
        out["word_embeddings_for_head"] = {"weight": state["embedding.word_embeddings.weight"]}
    return out


def core_model_state(state: dict, layers: range, first: bool, last: bool) -> dict:
    """The same stage with megatron-core's names (its state_dict_for_save_checkpoint)."""
    out = {}
    for key, value in state.items():
        if key.startswith("decoder.layers."):
            i, rest = key[len("decoder.layers."):].split(".", 1)
            if int(i) in layers:
                out[f"decoder.layers.{int(i) - layers.start}.{rest}"] = value
        elif (key.startswith("embedding.") and first) or (not key.startswith("embedding.")
                                                          and last):
            out[key] = value
    return out


def save_torch_format(model, shape: str, root: str, tp: int, world: int, stages: int,
                      legacy: bool) -> None:
    """Megatron's --ckpt-format torch save (checkpointing.py: one model_optim_rng.pt per tensor
    rank and pipeline stage, mp_rank_TT[_PPP]) of this tensor rank's model, cut into `stages`
    pipeline stages by hand (the stage files a pipeline of that depth writes)."""
    from megatron.core import parallel_state as ps
    tp_rank = ps.get_tensor_model_parallel_rank()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)}
    tied = SHAPES[shape][3].get("share_embeddings_and_output_weights", False)
    per = LAYERS // stages
    for pp in range(stages):
        layers = range(pp * per, (pp + 1) * per)
        first, last = pp == 0, pp == stages - 1
        model_state = legacy_model_state(state, layers, first, last, tied) if legacy else \
            core_model_state(state, layers, first, last)
        name = f"mp_rank_{tp_rank:02d}" + (f"_{pp:03d}" if stages > 1 else "")
        path = os.path.join(root, f"iter_{ITERATION:07d}", name, "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        args = megatron_args(shape, tp, tp * stages, pipeline_model_parallel_size=stages,
                             data_parallel_size=1, ckpt_format="torch")
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                    "model": model_state, "opt_param_scheduler":
                    scheduler_state(list(model.parameters())),
                    "rng_state": [{"torch_rng_state": torch.get_rng_state()}],
                    "num_floating_point_operations_so_far": 0}, path)
    if tp_rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))


def torch_format_worker(rank, world, runs, out):
    """megatron-core models saved in Megatron's torch format: (shape, tp, stages, legacy, root)
    each; every batch loss to `out`."""
    losses = {}
    for shape, tp, stages, legacy, root in runs:
        model = build(shape, tp)
        save_torch_format(model, shape, root, tp, world, stages, legacy)
        losses[root] = batch_loss(model, shape)
    torch.distributed.barrier()
    if rank == 0:
        torch.save(losses, out)


def init_adam_state(opt, config=None):
    """megatron-core's init_state_fn for Adam (optimizer/__init__.py): zero moments, so that its
    sharded_state_dict(is_loading=True) has tensors to load into."""
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def load_export_worker(rank, world, shape, tp, directory, out):
    """megatron-core reads one of our exports the way Megatron-LM's load_checkpoint does:
    dist_checkpointing.load of its model's and its FP32Optimizer's sharded state dicts (the
    common state merged in), then model.load_state_dict / optimizer.load_state_dict. Writes its
    loss on the fixed batch, the common entries and, by sharded key, this rank's Adam moments."""
    from megatron.core import dist_checkpointing
    model = build(shape, tp)
    opt = plain_optimizer(model)
    opt.init_state_fn = init_adam_state
    model_sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": opt.sharded_state_dict(
        model_sd, is_loading=True)}, directory)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    moments = {}
    for name, p in model.named_parameters():
        state = opt.optimizer.state[p]
        moments[name] = {k: state[k].clone() for k in ("exp_avg", "exp_avg_sq")}
        moments[name]["step"] = float(state["step"])
    loss = batch_loss(model, shape)
    if rank == 0:
        torch.save({"loss": loss, "moments": moments, "common": {
            k: loaded.get(k) for k in ("iteration", "checkpoint_version", "opt_param_scheduler",
                                       "num_floating_point_operations_so_far")},
            "args": vars(loaded["args"])}, out)
