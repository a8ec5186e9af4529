"""DeepSpeed's batch triple: train_batch_size = micro batch x accumulation steps x data-parallel
size; any two of the three keys imply the third."""
from __future__ import annotations

from megatron_2bw.config.ds_json.setting import fail


def batch_triple(ds: dict, dp: int, micro=None, train_batch=None) -> tuple[int, int, int]:
    """(micro, accumulation steps, train batch) from any two of DeepSpeed's three keys (DeepSpeed's
    rules: one of train_batch/micro alone means one accumulation step). `micro`/`train_batch`
    fill keys the JSON leaves out (Megatron flags)."""
    tb = ds.get("train_batch_size", train_batch)
    mb = ds.get("train_micro_batch_size_per_gpu", micro)
    gas = ds.get("gradient_accumulation_steps")
    for key, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                   ("gradient_accumulation_steps", gas)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            fail(f"DeepSpeed config: {key} must be a positive integer, got {v!r}")
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * dp:
            fail(f"DeepSpeed config: train_batch_size {tb} != train_micro_batch_size_per_gpu "
                 f"{mb} x gradient_accumulation_steps {gas} x data-parallel size {dp} = "
                 f"{mb * gas * dp}: fix one of them (any two imply the third)")
    elif tb is not None and mb is not None:
        if tb % (mb * dp):
            fail(f"DeepSpeed config: train_batch_size {tb} is not divisible by "
                 f"train_micro_batch_size_per_gpu {mb} x data-parallel size {dp}")
        gas = tb // (mb * dp)
    elif tb is not None and gas is not None:
        if tb % (gas * dp):
            fail(f"DeepSpeed config: train_batch_size {tb} is not divisible by "
                 f"gradient_accumulation_steps {gas} x data-parallel size {dp}")
        mb = tb // (gas * dp)
    elif mb is not None and gas is not None:
        tb = mb * gas * dp
    elif tb is not None:
        if tb % dp:
            fail(f"DeepSpeed config: train_batch_size {tb} is not divisible by the "
                 f"data-parallel size {dp}")
        gas, mb = 1, tb // dp
    elif mb is not None:
        gas, tb = 1, mb * dp
    else:
        fail("DeepSpeed config: set train_batch_size or train_micro_batch_size_per_gpu (any "
             "two of train_batch_size, train_micro_batch_size_per_gpu and "
             "gradient_accumulation_steps)")
    return mb, gas, tb
