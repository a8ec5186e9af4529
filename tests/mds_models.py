"""A Megatron-DeepSpeed GPT trained and saved by the real DeepSpeed (0.19.8) pipeline engine, on
CPU under gloo, for tests/distributed/test_ckpt_deepspeed.py.

The model is written here in plain torch, each piece named and shaped as Megatron-DeepSpeed's
(deepspeedai/Megatron-DeepSpeed at 4efb479d; Megatron-DeepSpeed itself needs apex and CUDA):

    megatron/model/gpt_model.py      GPTModelPipe: the layer list below, partition_method
                                     'type:transformer', CrossEntropy (labels, loss_mask)
    megatron/model/language_model.py EmbeddingPipe (word_embeddings, position_embeddings,
                                     word_embeddings_weight for the tie; [b s] -> [s b h])
    megatron/model/transformer.py    ParallelTransformerLayerPipe with the legacy names
                                     input_layernorm, self_attention.query_key_value /.dense,
                                     post_attention_layernorm, mlp.dense_h_to_4h /.dense_4h_to_h
    megatron/optimizer/__init__.py   get_param_groups: weight decay off for biases and 1-d params
    megatron/checkpointing.py        save_checkpoint: DeepSpeed's engine.save_checkpoint(save,
                                     client_state={args, checkpoint_version 3.0, iteration,
                                     tokens, universal_checkpoint_info, rng_state}), then
                                     latest_checkpointed_iteration.txt

    0  _to_float16 (a function: fp32 here)      3  ParallelTransformerLayerPipe (layer 1)
    1  TiedLayerSpec('embed', EmbeddingPipe)    4  LayerSpec(LayerNorm)       final norm
    2  ParallelTransformerLayerPipe (layer 0)   5  TiedLayerSpec('embed', forward_fn=logits)

The fused QKV is laid out as Megatron-DeepSpeed's ParallelAttention splits it: per query group
[q_1 .. q_P, k, v] up to commit 676a482 (Dec 2024, "Adding the new feature of FPDT"), in equal
thirds [Q; K; V] from then on (`thirds`; that commit also added args.ds_sequence_parallel_fpdt,
which is how a reader tells them apart). Its lr scheduler is megatron-core's
OptimizerParamScheduler (Megatron-DeepSpeed's is Megatron-LM's with token counters added, as in
`Scheduler.state_dict`), stepped by DeepSpeed's pipeline engine with the samples of a batch
(engine.py: its "Hack to work with Megatron 2.0 and DeepSpeed pipelines").

Accelerator-only calls: DeepSpeed's CPU shared-memory all-reduce is a C++ build (minutes), so
`deepspeed.comm.torch.build_shm_op` is stubbed here, in the test (gloo carries the collectives).
"""
from __future__ import annotations

import argparse
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SEQ, VOCAB, HIDDEN, HEADS, LAYERS, BATCH, ITERATION = 16, 128, 32, 4, 2, 4, 3
# a constant lr without weight decay or clipping: the drop-in's config then steps as DeepSpeed
# with Megatron-DeepSpeed's optimizer and scheduler does, so both can continue DeepSpeed's run
LR, DECAY_ITERS = 1e-3, 40
OUR_FLAGS = (f"--mock-data --num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads "
             f"{HEADS} --seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size 1 "
             f"--global-batch-size {BATCH} --vocab-size {VOCAB} --hidden-dropout 0 "
             f"--attention-dropout 0 --lr {LR} --min-lr 0 --lr-decay-style constant "
             f"--lr-warmup-iters 0 --lr-decay-iters {DECAY_ITERS} --weight-decay 0 "
             "--clip-grad 0").split()


def our_flags(t: int, d: int, iters: int = ITERATION + 2) -> list[str]:
    return OUR_FLAGS + ["--tensor-model-parallel-size", str(t),
                        "--pipeline-model-parallel-size", str(d), "--train-iters", str(iters)]


class EmbeddingPipe(nn.Module):
    """language_model.py Embedding / EmbeddingPipe: word + position embeddings, [s b h] out."""

    def __init__(self, hidden, vocab, max_positions):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, inputs):
        tokens, positions = inputs[0], inputs[1]
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        return x.transpose(0, 1).contiguous()


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads, groups, thirds):
        super().__init__()
        self.heads, self.groups, self.d, self.thirds = heads, groups, hidden // heads, thirds
        self.query_key_value = nn.Linear(hidden, (heads + 2 * groups) * self.d)
        self.dense = nn.Linear(heads * self.d, hidden)

    def forward(self, x):
        s, b, _ = x.shape
        mixed = self.query_key_value(x)
        if self.thirds:  # from 676a482: [Q; K; V] in equal thirds
            q, k, v = (t.reshape(s, b, -1, self.d) for t in mixed.chunk(3, dim=-1))
        else:  # per query group [q_1 .. q_P, k, v]
            P = self.heads // self.groups
            mixed = mixed.view(s, b, self.groups, P + 2, self.d)
            q = mixed[..., :P, :].reshape(s, b, self.heads, self.d)
            k, v = mixed[..., P, :], mixed[..., P + 1, :]
            k, v = (t.repeat_interleave(P, dim=2) for t in (k, v))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b np s hn]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(a.permute(2, 0, 1, 3).reshape(s, b, -1))


class MLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.dense_h_to_4h, self.dense_4h_to_h = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class ParallelTransformerLayerPipe(nn.Module):
    """transformer.py ParallelTransformerLayer (pre-norm, biases, GeLU), [s b h] in and out."""

    def __init__(self, hidden, heads, groups, thirds, layer_number):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.self_attention = SelfAttention(hidden, heads, groups, thirds)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.mlp = MLP(hidden, 4 * hidden)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def _to_float16(inputs):  # GPTModelPipe's first "layer": a cast, nothing in fp32
    return inputs


def _logits_helper(embedding, lm_output):  # parallel_lm_logits against the tied embedding
    return F.linear(lm_output, embedding.word_embeddings_weight)


def cross_entropy(output, labels):
    """gpt_model.py CrossEntropy: [s b V] logits, (labels, loss_mask) [b s]."""
    labels, loss_mask = labels[0], labels[1]
    losses = F.cross_entropy(output.float().permute(1, 2, 0), labels, reduction="none")
    loss_mask = loss_mask.reshape(-1)
    return torch.sum(losses.reshape(-1) * loss_mask) / loss_mask.sum()


def layer_specs(ds, thirds: bool):
    LayerSpec, TiedLayerSpec = ds.pipe.LayerSpec, ds.pipe.TiedLayerSpec
    embed = ("embed", EmbeddingPipe, HIDDEN, VOCAB, SEQ)
    return [_to_float16,
            TiedLayerSpec(*embed, tied_weight_attr="word_embeddings_weight"),
            *[LayerSpec(ParallelTransformerLayerPipe, HIDDEN, HEADS, HEADS, thirds, i)
              for i in range(LAYERS)],
            LayerSpec(nn.LayerNorm, HIDDEN, eps=1e-5),
            TiedLayerSpec(*embed, forward_fn=_logits_helper,
                          tied_weight_attr="word_embeddings_weight")]


def build_model(ds, thirds: bool, num_stages: int = 2):
    """GPTModelPipe's PipelineModule: weights drawn as Megatron's init_method_normal(0.02) and
    norms and biases moved off their initialization, identically on every rank (by name)."""
    torch.manual_seed(0)
    net = ds.pipe.PipelineModule(layers=layer_specs(ds, thirds), num_stages=num_stages,
                                 loss_fn=cross_entropy, partition_method="type:transformer")
    with torch.no_grad():
        for name, p in net.named_parameters():
            g = torch.Generator().manual_seed(sum(map(ord, name.split(".", 1)[-1])) * 7 +
                                              _layer_of(name))
            noise = torch.randn(p.shape, generator=g)
            if p.dim() > 1:  # Megatron's init_method_normal(0.02)
                p.copy_(0.02 * noise)
            else:
                p.add_(0.1 * noise)
    return net


def _layer_of(name: str) -> int:
    head = name.split(".")[0]
    return int(head) if head.isdigit() else 0


def param_groups(module) -> list[dict]:
    """megatron/optimizer/__init__.py get_param_groups (no lr scaling)."""
    wd, no_wd = [], []
    for name, p in module.named_parameters():
        (no_wd if name.endswith(".bias") or len(p.shape) == 1 else wd).append(p)
    return [{"name": "wd_no_scale_lr", "params": wd, "wd_mult": 1.0, "lr_mult": 1.0},
            {"name": "no_wd_no_scale_lr", "params": no_wd, "wd_mult": 0.0, "lr_mult": 1.0}]


class Scheduler:
    """Megatron-DeepSpeed's OptimizerParamScheduler: megatron-core's (Megatron-LM's) with its
    token counters in the state dict; DeepSpeed steps it with the samples of a batch."""

    def __init__(self, optimizer):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        self.inner = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=LR, min_lr=0.0, lr_warmup_steps=0,
            lr_decay_steps=DECAY_ITERS * BATCH, lr_decay_style="constant", start_wd=0.0,
            end_wd=0.0, wd_incr_steps=DECAY_ITERS * BATCH, wd_incr_style="constant")
        self.inner.step(0)

    def step(self, increment):
        self.inner.step(increment)

    def get_lr(self):
        return [self.inner.get_lr()]

    def state_dict(self):
        return dict(self.inner.state_dict(), lr_warmup_tokens=None, num_tokens=0,
                    lr_decay_tokens=None)

    def load_state_dict(self, sd):
        self.inner.load_state_dict({k: v for k, v in sd.items() if "tokens" not in k})


def megatron_ds_args(world: int, zero: int, thirds: bool, iteration: int) -> argparse.Namespace:
    """Megatron-DeepSpeed's arguments of this run (megatron/arguments.py's names and defaults)."""
    args = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_channels=HIDDEN // HEADS,
        max_position_embeddings=SEQ, seq_length=SEQ, use_rotary_position_embeddings=False,
        add_position_embedding=True, rope_theta=10000, rotary_percent=1.0,
        normalization="layernorm", layernorm_epsilon=1e-5, apply_layernorm_1p=False,
        apply_residual_connection_post_layernorm=False, openai_gelu=False,
        bias_gelu_fusion=False, swiglu=False, squared_relu=False, add_bias_linear=True,
        untie_embeddings_and_output_weights=False, embedding_weights_in_fp32=False,
        num_experts=[1], expert_interval=2, padded_vocab_size=VOCAB,
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2, data_parallel_size=world // 2, world_size=world,
        micro_batch_size=1, global_batch_size=BATCH, consumed_train_samples=iteration * BATCH,
        consumed_train_tokens=iteration * BATCH * SEQ, train_iters=100, lr=LR, min_lr=0.0,
        lr_decay_style="constant", lr_warmup_iters=0, lr_decay_iters=DECAY_ITERS,
        weight_decay=0.0, clip_grad=0.0, optimizer="adam", adam_beta1=0.9, adam_beta2=0.999,
        adam_eps=1e-8, fp16=False, bf16=False, deepspeed=True, ds_pipeline_enabled=True,
        zero_stage=zero, no_pipeline_parallel=False, hidden_dropout=0.0, attention_dropout=0.0)
    if thirds:
        args.update(ds_sequence_parallel_fpdt=False, ds_sequence_parallel_fpdt_chunk_size=65536)
    return argparse.Namespace(**args)


def ds_config(zero: int, bf16: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": BATCH,
            "steps_per_print": 1000, "gradient_clipping": 0.0, "wall_clock_breakdown": False,
            "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16}}


def sample(i: int):
    from megatron_2bw.data.mock import MockGPTDataset
    s = MockGPTDataset(VOCAB, SEQ)[i]
    return ((s[None, :-1], torch.arange(SEQ)[None]), (s[None, 1:], torch.ones(1, SEQ)))


def samples(first: int, n: int):
    return iter([sample(i) for i in range(first, first + n)])


def rng_state() -> list[dict]:
    """megatron/checkpointing.py get_rng_state (one data-parallel rank's)."""
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {}}]


def client_state(args, iteration: int) -> dict:
    """What Megatron-DeepSpeed's save_checkpoint hands DeepSpeed as client_state."""
    return {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
            "tokens": args.consumed_train_tokens,
            "universal_checkpoint_info": {"universal_checkpoint_version": 0.2,
                                          "original_vocab_size": VOCAB,
                                          "padded_vocab_size": VOCAB},
            "rng_state": rng_state()}


def moments(engine, zero: int) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's own Adam state per parameter name of this stage, read from its running
    optimizer: ZeRO-0, torch's state per parameter; ZeRO-1, its flat fp32 partitions cut by its
    own map of names to fragments (`_param_slice_mappings`), the data-parallel ranks' fragments
    of a parameter joined in rank order."""
    out = {}
    if not zero:
        for name, p in engine.module.named_parameters():
            state = engine.optimizer.state.get(p, {})
            if "exp_avg" in state:
                out[name] = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"],
                             "fp32": p.detach(), "step": float(state["step"])}
    else:
        zero_opt = engine.optimizer
        for i, names in enumerate(zero_opt._param_slice_mappings):
            flat = zero_opt.single_partition_of_fp32_groups[i]
            state = zero_opt.optimizer.state[flat]
            for name, where in names.items():
                cut = {k: state[k].narrow(0, where.start, where.numel).clone()
                       for k in ("exp_avg", "exp_avg_sq")}
                out[name] = dict(cut, fp32=flat.narrow(0, where.start, where.numel).clone(),
                                 step=float(state["step"]))
        group = engine.grid.get_data_parallel_group()
        if engine.grid.get_data_parallel_world_size() > 1:
            every = [None] * engine.grid.get_data_parallel_world_size()
            torch.distributed.all_gather_object(every, out, group=group)
            out = {}
            for part in every:  # rank order
                for name, d in part.items():
                    if name in out:
                        out[name] = {k: torch.cat([out[name][k], v]) if torch.is_tensor(v) else v
                                     for k, v in d.items()}
                    else:
                        out[name] = d
    return {n: {k: v.detach().clone().float().reshape(-1) if torch.is_tensor(v) else v
                for k, v in d.items()} for n, d in out.items()}


def save_worker(rank, world, runs, out):
    """A rank of the real DeepSpeed runs ((zero, thirds, root[, bf16]) each): build, train
    ITERATION batches, save as Megatron-DeepSpeed does; writes every rank's results to `out`:
    the batch losses, the loss on the fixed batch (samples 0 .. BATCH-1) at the checkpoint
    ("fixed") and after one more batch ("after"), the Adam state saved (its stage's, by its
    names), the torch RNG state it saved, and what DeepSpeed's own load_checkpoint returns."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    import deepspeed
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for zero, thirds, root, *bf16 in runs:
        net = build_model(deepspeed, thirds)
        opt = torch.optim.AdamW(param_groups(net), lr=LR, weight_decay=0.0, betas=(0.9, 0.999),
                                eps=1e-8)
        sched = Scheduler(opt)
        engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=sched,
                                               config=ds_config(zero, bool(bf16)))
        losses = [float(engine.train_batch(samples(t * BATCH, BATCH))) for t in range(ITERATION)]
        args = megatron_ds_args(world, zero, thirds, ITERATION)
        torch.manual_seed(1000 + rank)  # each rank's RNG state is its own in the client state
        rng = torch.get_rng_state()
        engine.save_checkpoint(root, client_state=client_state(args, ITERATION))
        if rank == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))
        torch.distributed.barrier()
        fixed = float(engine.eval_batch(samples(0, BATCH), num_micro_batches=BATCH))
        saved = moments(engine, zero)
        losses.append(float(engine.train_batch(samples(ITERATION * BATCH, BATCH))))
        after = float(engine.eval_batch(samples(0, BATCH), num_micro_batches=BATCH))
        path, client = engine.load_checkpoint(root)  # what DeepSpeed itself returns
        results[root] = {"losses": losses, "fixed": fixed, "after": after, "moments": saved,
                         "stage": engine.stage_id, "rng": rng, "load_path": path,
                         "client_keys": sorted(client), "global_steps": engine.global_steps}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
