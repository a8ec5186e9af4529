"""Deterministic synthetic GPT data (`--mock-data`): learnable sequences, same on every rank.

Sample i is an arithmetic progression modulo the vocabulary with a random start and stride,
with a few random tokens mixed in, so a model can learn it and the loss visibly goes down.
"""
from __future__ import annotations

import torch


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int = 1234, noise: float = 0.05):
        self.vocab_size, self.seq_length, self.seed, self.noise = vocab_size, seq_length, seed, noise

    def __len__(self) -> int:
        return 2 ** 62

    def __getitem__(self, idx: int) -> torch.Tensor:
        """seq_length + 1 tokens (int64)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(idx))
        n, v = self.seq_length + 1, self.vocab_size
        start = int(torch.randint(v, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        tokens = (start + stride * torch.arange(n)) % v
        noisy = torch.rand(n, generator=g) < self.noise
        return torch.where(noisy, torch.randint(v, (n,), generator=g), tokens)


def microbatch_sample_indices(batch: int, microbatch: int, dp_rank: int, micro_batch_size: int,
                              num_microbatches: int, data_parallel_size: int) -> range:
    """Global sample indices of one microbatch: batch t is samples [t*B, (t+1)*B), replica r takes
    the r-th contiguous share of it, split into m microbatches of b samples."""
    b, m, w = micro_batch_size, num_microbatches, data_parallel_size
    first = batch * b * m * w + dp_rank * b * m + microbatch * b
    return range(first, first + b)


class MicrobatchIterator:
    """Microbatches of a dataset for one data-parallel replica, in schedule order, from batch
    `start_batch` on (the layout of `microbatch_sample_indices`). `num_microbatches` is m, or
    a batch plan whose batch changes (config.ramps.BatchPlan: a batch-size ramp): batch t is
    then samples [consumed(t), consumed(t) + B_t), each replica's share of it split into m_t
    microbatches, as Megatron's sampler hands out consumed .. consumed + B."""

    def __init__(self, dataset, micro_batch_size: int, num_microbatches,
                 data_parallel_size: int = 1, dp_rank: int = 0, start_batch: int = 0):
        plan = num_microbatches if hasattr(num_microbatches, "locate") else None
        if plan is not None and plan.unit != micro_batch_size * data_parallel_size:
            raise ValueError(f"the batch plan is for micro batch x replicas = {plan.unit}, not "
                             f"{micro_batch_size} x {data_parallel_size}")
        self.plan = plan if plan is not None and plan.ramps else None
        m = plan.m(0) if plan is not None else num_microbatches
        self.dataset, self.b, self.m = dataset, micro_batch_size, m
        self.w, self.r = data_parallel_size, dp_rank
        # the next microbatch (this replica's count of microbatches before it)
        self.k = self.plan.microbatch(start_batch) if self.plan else start_batch * m

    def __iter__(self):
        return self

    @property
    def next_microbatch(self) -> tuple[int, int]:
        """(batch, microbatch) of the next item."""
        return self.locate(self.k)

    def locate(self, k: int) -> tuple[int, int]:
        """(batch, microbatch in it) of this replica's k-th microbatch."""
        return self.plan.locate(k) if self.plan else divmod(k, self.m)

    def microbatch(self, k: int):
        """Microbatch k (= batch * m + microbatch, or its place in a batch plan) of this
        replica, whatever was read before: a loader's workers (data/prefetch.py) read them by
        index, in any order."""
        batch, mb = self.locate(k)
        if self.plan:
            m = self.plan.m(batch)
            first = self.plan.consumed(batch) + (self.r * m + mb) * self.b
            idx = range(first, first + self.b)
        else:
            idx = microbatch_sample_indices(batch, mb, self.r, self.b, self.m, self.w)
        return self.collate([self.dataset[i] for i in idx])

    def __next__(self):
        k, self.k = self.k, self.k + 1
        return self.microbatch(k)

    def collate(self, samples: list):
        """The microbatch of these samples (each family's iterator says how it stacks them)."""
        raise NotImplementedError(f"{type(self).__name__} must define collate(samples)")


class GPTBatches(MicrobatchIterator):
    """(tokens, labels) microbatches for one data-parallel replica, in schedule order. With `eod`
    (--eod-mask-loss) a position whose input token is `eod` gets the label -1: the loss leaves
    negative labels out (Megatron's loss mask)."""

    def __init__(self, *args, eod: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.eod = eod

    def collate(self, samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        samples = torch.stack(samples)
        tokens, labels = samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
        if self.eod is not None:
            labels = labels.masked_fill(tokens == self.eod, -1)
        return tokens, labels
