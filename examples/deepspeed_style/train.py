#!/usr/bin/env python
"""A small GPT written the DeepSpeed way (PipelineModule, LayerSpec, TiedLayerSpec, a JSON config,
engine.train_batch), trained by megatron_2bw's PipeDream-2BW engine.

The one-line change from a DeepSpeed script is the import below:

    import deepspeed                    # DeepSpeed's 1F1B-with-flush pipeline engine
    import megatron_2bw as deepspeed    # the same script on the 2BW engine

Run (2 pipeline stages, gloo on CPU):

    torchrun --standalone --nproc_per_node 2 examples/deepspeed_style/train.py --steps 30

`--schedule flush` runs DeepSpeed's own schedule on our engine (same losses as DeepSpeed);
`--real-deepspeed` runs the identical code with the real `deepspeed` package, for comparison.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import megatron_2bw as deepspeed  # noqa: E402  (a DeepSpeed script says: import deepspeed)


class Embedding(nn.Module):
    def __init__(self, vocab, hidden, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def lm_head(embedding, x):
    """The output layer reuses the word embedding (tied across the first and last stage)."""
    return F.linear(x, embedding.tok.weight)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_model(ds, num_stages, num_layers=4, vocab=128, hidden=32, heads=4, seq=16,
                partition_method="parameters", seed_layers=False):
    LayerSpec, TiedLayerSpec = ds.pipe.LayerSpec, ds.pipe.TiedLayerSpec
    layers = [TiedLayerSpec("embed", Embedding, vocab, hidden, seq, tied_weight_attr="tok.weight"),
              *[LayerSpec(Block, hidden, heads) for _ in range(num_layers)],
              LayerSpec(nn.LayerNorm, hidden),
              TiedLayerSpec("embed", Embedding, vocab, hidden, seq, forward_fn=lm_head,
                            tied_weight_attr="tok.weight")]
    return ds.pipe.PipelineModule(layers=layers, num_stages=num_stages, loss_fn=loss_fn,
                                  partition_method=partition_method, seed_layers=seed_layers)


def token_dataset(num_samples=512, vocab=128, seq=16, seed=0):
    """Noisy arithmetic progressions modulo the vocabulary: learnable, deterministic."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (num_samples, 1), generator=g)
    stride = torch.randint(1, 5, (num_samples, 1), generator=g)
    ids = (start + stride * torch.arange(seq + 1)) % vocab
    return torch.utils.data.TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def ds_config(schedule="2bw", micro=4, accumulation=4, lr=3e-3, steps_per_print=10, clipping=1.0):
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                      "warmup_num_steps": 5,
                                                      "warmup_type": "linear"}},
        "gradient_clipping": clipping,
        "steps_per_print": steps_per_print,
        "pipeline": {"schedule": schedule},   # ignored by DeepSpeed (always 1F1B with flush)
    }


def run(ds, argv=None, log=print):
    """The whole training script, for a given `deepspeed` module. Returns the per-batch losses."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--pipeline-stages", type=int, default=2)
    p.add_argument("--schedule", default="2bw")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--gradient-clipping", type=float, default=1.0)
    p.add_argument("--real-deepspeed", action="store_true")
    args = p.parse_args(argv)
    ds.init_distributed(dist_backend="gloo")
    torch.manual_seed(args.seed)
    net = build_model(ds, args.pipeline_stages)
    engine, _, _, _ = ds.initialize(
        model=net, training_data=token_dataset(),
        config=ds_config(args.schedule, args.micro_batch, args.accumulation,
                         clipping=args.gradient_clipping))
    losses = []
    for _ in range(args.steps):
        losses.append(float(engine.train_batch()))
    if engine.global_rank == 0:
        log(f"first loss {losses[0]:.4f} last loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    if "--real-deepspeed" in sys.argv:
        import deepspeed  # noqa: F811
    run(deepspeed, sys.argv[1:])
