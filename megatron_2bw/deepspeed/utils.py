"""Small helpers DeepSpeed scripts import from `deepspeed.utils`: RepeatingLoader, the
"DeepSpeed" logger and log_dist."""
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


def _make_logger():
    import logging
    import sys
    log = logging.getLogger("DeepSpeed")
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _make_logger()


def log_dist(message, ranks=None, level=20):
    """Log `message` on the given ranks (`[-1]`: every rank; before the process group starts
    every process logs), prefixed '[Rank R]' as DeepSpeed's log_dist does; level 20 = INFO."""
    from megatron_2bw.parallel.devices import is_initialized
    from megatron_2bw.parallel.distributed import current_rank_world
    started = is_initialized()
    me = current_rank_world()[0] if started else -1
    ranks = list(ranks or [])
    if not started or (ranks and ranks[0] == -1) or me in ranks:
        logger.log(level, f"[Rank {me}] {message}")


__all__ = ["RepeatingLoader", "log_dist", "logger"]
