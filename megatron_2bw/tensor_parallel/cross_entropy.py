"""Cross entropy over vocab-parallel logits without gathering them (Megatron's algorithm):
global max and sum-of-exp by all-reduce, the target logit from the rank that owns it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_2bw.tensor_parallel.mappings import TPGroup


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp):
        ctx.dtype = logits.dtype
        logits = logits.float()
        logits_max = logits.max(dim=-1)[0]
        tp.comm.all_reduce(logits_max, tp.group, op="max")
        logits = logits - logits_max.unsqueeze(-1)
        per = logits.shape[-1]
        start = tp.rank * per
        outside = (target < start) | (target >= start + per)
        local = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        tp.comm.all_reduce(predicted, tp.group)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        tp.comm.all_reduce(sum_exp, tp.group)
        loss = sum_exp.log() - predicted
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax
        hit = (~outside).float()
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return (grad * g.unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 tp: TPGroup = TPGroup()) -> torch.Tensor:
    """Per-token loss [...] from local logits [..., vocab/t] (fp32 math)."""
    if tp.size == 1:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                               reduction="none").view(target.shape)
    return _VocabParallelCE.apply(logits, target, tp)
