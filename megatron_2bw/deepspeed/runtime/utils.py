"""`deepspeed.runtime.utils`: the helpers DeepSpeed scripts import from it.

`set_random_seed` seeds Python's, numpy's and torch's generators as DeepSpeed's does (numpy takes
the seed mod 2**32, torch mod 2**63); the partitioners are the project's (models/partition.py,
DeepSpeed's results).
"""
from __future__ import annotations

import random

import torch

from megatron_2bw.models.partition import partition_balanced, partition_uniform


def set_random_seed(seed):
    """Seed `random`, `numpy.random` and torch (every device torch seeds) with `seed`."""
    import numpy
    random.seed(seed)
    numpy.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed % (2 ** 63))


def call_to_str(base, *args, **kwargs):
    """'base(arg, key=value)': the printed form of a call (DeepSpeed's instruction repr)."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def move_to_device(item, device, criterion_func=None):
    """Tensors in (nested) lists, tuples and dicts moved to `device`; where `criterion_func`
    accepts a tensor it is moved in place (its storage replaced), as DeepSpeed does."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def get_only_unique_item(items):
    """The one distinct element of `items`; a RuntimeError naming them if there are more."""
    distinct = set(items)
    if len(distinct) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return distinct.pop()


__all__ = ["call_to_str", "get_only_unique_item", "move_to_device", "partition_balanced",
           "partition_uniform", "set_random_seed"]
