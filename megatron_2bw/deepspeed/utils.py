"""Small helpers DeepSpeed scripts import from `deepspeed.utils`."""
from __future__ import annotations


class RepeatingLoader:
    """Wrap a data loader (any iterable) so iteration restarts on exhaustion: an endless iterator.

    Same contract as `deepspeed.utils.RepeatingLoader`. The 2BW engine reads the first
    microbatches of batch t+1 while it finishes batch t, so hand `train_batch` one long iterator
    such as this one rather than a fresh, exactly-sized iterator per call."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
