"""Issue 32, point 2, on gloo processes (d=2, dropout on): bf16/fp16 training with backward
accumulating into fp32 directly (--grad-accumulation fp32, the default) is bitwise the run with
the low-precision gradient buffer (--grad-accumulation buffer), losses and final weights, for
2BW with one and with two gradient buffers and for flush; a checkpoint of either mode
continues bitwise in the other (the mode is no part of a checkpoint). fp16 rows run with
`-m slow`."""
import tempfile

import pytest
import torch

from test_resume import make_cfg, newest_weights, run as run_training

SLOW = pytest.mark.slow
FOLD = ["--grad-accumulation", "buffer"]


@pytest.mark.parametrize("precision,schedule", [
    pytest.param("--bf16", ["--pipeline-schedule", "2bw", "--2bw-grad-buffers", "1"], id="bf16-2bw-g1"),
    pytest.param("--bf16", ["--pipeline-schedule", "flush"], id="bf16-flush"),
    pytest.param("--bf16", ["--pipeline-schedule", "2bw"], id="bf16-2bw"),
    pytest.param("--fp16", ["--pipeline-schedule", "2bw", "--2bw-grad-buffers", "1"], id="fp16-2bw-g1",
                 marks=SLOW)])
def test_fp32_accumulation_trains_bitwise_like_the_low_precision_buffer(precision, schedule):
    with tempfile.TemporaryDirectory() as d:
        def go(name, *argv):
            return run_training(make_cfg(["--train-iters", "4", "--save", f"{d}/{name}",
                                          precision, *schedule, *argv]), f"{d}/{name}.losses")
        hooked, folded = go("fp32"), go("buffer", *FOLD)
        assert hooked == folded
        for a, b in zip(newest_weights(f"{d}/fp32"), newest_weights(f"{d}/buffer")):
            assert torch.equal(a["newest"], b["newest"])


def test_a_low_precision_buffer_checkpoint_continues_bitwise_in_fp32_accumulation():
    with tempfile.TemporaryDirectory() as d:
        def go(name, *argv):
            return run_training(make_cfg(["--train-iters", "4", "--save", f"{d}/{name}",
                                          "--bf16", "--pipeline-schedule", "2bw", *argv]),
                                f"{d}/{name}.losses")
        whole = go("whole")
        first = go("resumed", *FOLD, "--save-interval", "2", "--exit-interval", "2")
        rest = go("resumed", "--load", f"{d}/resumed")
        assert first + rest == whole
        for a, b in zip(newest_weights(f"{d}/whole"), newest_weights(f"{d}/resumed")):
            assert torch.equal(a["newest"], b["newest"])
