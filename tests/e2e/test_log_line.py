"""Megatron's log line (issue 49, build point 5): a scraper written for Megatron-LM's SLURM logs
reads ours. The regular expressions below are written from Megatron-LM's format strings, not from
our code:

- the interval line: NVIDIA/Megatron-LM, megatron/training/training.py, `training_log`
  (`log_string = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"`, then
  `' iteration {:8d}/{:8d} |'`, `' consumed samples: {:12d} |'`, `' elapsed time per iteration
  (ms): {:.1f} |'`, with --log-throughput `' throughput per GPU (TFLOP/s/GPU): {throughput:.1f}
  |'`, `' learning rate: {learning_rate:.6E} |'`, `' decoupled learning rate:
  {decoupled_learning_rate:.6E} |'` (before commit 7d3f4a0122, 2025-11), `' global batch size:
  {batch_size:5d} |'`, per loss `' {}: {:.6E} |'`, `' loss scale: {loss_scale:.1f} |'`, `' grad
  norm: {grad_norm:.3f} |'`, `' num zeros: {num_zeros_in_grad} |'`, `' params norm:
  {params_norm:.3f} |'`, `' number of skipped iterations: {:3d} |'`, `' number of nan
  iterations: {:3d} |'`);
- the validation line: the same file, `evaluate_and_print_results` (`string =
  f' validation{suffix} loss at {prefix} | '`, per loss `'{} value: {:.6E} | '` and `'{} PPL: {:.6E} | '`,
  printed between two lines of `'-' * (len(string) + 1)`; the prefix is `f'iteration
  {iteration}'` during training, `f'iteration {iteration} on validation set'` after it).
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_2bw.training.observe.log_line import format_interval, parse_line

ROOT = Path(__file__).resolve().parents[2]
E6 = r"-?\d\.\d{6}E[-+]\d{2,3}"       # '{:.6E}'
F1 = r"-?\d+\.\d"                      # '{:.1f}'
F3 = r"-?\d+\.\d{3}"                   # '{:.3f}'
MEGATRON_INTERVAL = re.compile(
    r" \[(?P<timestamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})\]"
    r" iteration (?P<iteration> *\d+)/(?P<train_iters> *\d+) \|"
    r" consumed samples: (?P<consumed> *\d+) \|"
    rf" elapsed time per iteration \(ms\): (?P<ms>{F1}) \|"
    rf"(?: throughput per GPU \(TFLOP/s/GPU\): (?P<throughput>{F1}) \|)?"
    rf" learning rate: (?P<lr>{E6}) \|"
    rf"(?: decoupled learning rate: (?P<decoupled_lr>{E6}) \|)?"
    r" global batch size: (?P<batch> *\d+) \|"
    rf"(?: lm loss: (?P<loss>{E6}) \|)?"
    rf" loss scale: (?P<scale>{F1}) \|"
    rf"(?: grad norm: (?P<grad_norm>{F3}) \|)?"
    r"(?: num zeros: (?P<zeros>\d+) \|)?"
    rf"(?: params norm: (?P<params_norm>{F3}) \|)?"
    r" number of skipped iterations: (?P<skipped> *\d+) \|"
    r" number of nan iterations: (?P<nan> *\d+) \|")
MEGATRON_VALIDATION = re.compile(
    rf"^ validation loss at iteration (?P<iteration>\d+)(?P<after> on validation set)? \| "
    rf"lm loss value: (?P<loss>{E6}) \| lm loss PPL: (?P<ppl>{E6}) \| $")
OURS = ("ETA", "samples/s", "tokens/s", "memory GB per stage", "2bw compensation",
        "ms forward", "ms backward", "ms optimizer")
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4"]


def pretrain(*flags):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_megatron_regexes_read_every_field_of_our_interval_and_validation_lines(tmp_path):
    lines = pretrain("--train-iters", "5", "--log-interval", "2", "--eval-interval", "3",
                     "--eval-iters", "1", "--lr", "2e-3", "--decoupled-lr", "5e-4",
                     "--lr-warmup-iters", "2", "--log-throughput", "--log-params-norm",
                     "--pipeline-schedule", "2bw", "--2bw-compensation", "predict",
                     "--wall-clock-breakdown", "--save", str(tmp_path / "ckpt"))
    intervals = [(MEGATRON_INTERVAL.match(x), x) for x in lines if "| consumed samples" in x]
    assert [m is not None for m, _ in intervals] == [True] * 3, "\n".join(lines)
    for m, line in intervals:
        # every field Megatron prints, ours has (num zeros: --log-num-zeros-in-grad is refused)
        assert all(m[g] is not None for g in MEGATRON_INTERVAL.groupindex if g != "zeros"), line
        # Megatron's widths: {:8d}, {:12d}, {:5d}, {:3d}
        assert (len(m["iteration"]), len(m["train_iters"]), len(m["consumed"]), len(m["batch"]),
                len(m["skipped"]), len(m["nan"])) == (8, 8, 12, 5, 3, 3), line
        it, fields = parse_line(line)   # our extras follow Megatron's fields on the same line
        assert it == int(m["iteration"]) and line[m.end():].startswith(" ETA: ")
        keys = list(fields)
        extras = keys[keys.index("ETA"):]
        assert len(keys) - len(extras) == len(MEGATRON_INTERVAL.groupindex) - 4, line
        assert [k for k in extras if k in OURS] == list(OURS), line
        assert fields["2bw compensation"] == "predict"
        assert fields["consumed samples"] == int(m["consumed"]) == 4 * it
        assert fields["lm loss"] == float(m["loss"]) and math.isfinite(fields["lm loss"])
        assert (int(m["batch"]), float(m["scale"]), int(m["skipped"]), int(m["nan"])) == \
            (4, 1.0, 0, 0)
    assert [int(m["iteration"]) for m, _ in intervals] == [2, 4, 5]
    assert {int(m["train_iters"]) for m, _ in intervals} == {5}
    # --lr-warmup-iters 2: iteration 2 steps at the peak lr, and the decoupled lr its own
    first = intervals[0][0]
    assert float(first["lr"]) == pytest.approx(2e-3) and \
        float(first["decoupled_lr"]) == pytest.approx(5e-4)

    at = [i for i, x in enumerate(lines) if MEGATRON_VALIDATION.match(x)]
    assert len(at) == 1, "\n".join(lines)
    i = at[0]
    m = MEGATRON_VALIDATION.match(lines[i])
    assert m["iteration"] == "3" and m["after"] is None
    assert lines[i - 1] == lines[i + 1] == "-" * (len(lines[i]) + 1), "Megatron's frame"
    loss, ppl = float(m["loss"]), float(m["ppl"])
    assert ppl == pytest.approx(math.exp(loss), rel=1e-5)
    assert parse_line(lines[i]) == (3, {"lm loss value": loss, "lm loss PPL": ppl})
    # the checkpoint line and the run summary stay as they were
    saved = f"successfully saved checkpoint at iteration 5 to {tmp_path / 'ckpt'}"
    assert any(x.startswith(saved) for x in lines)
    assert any(x.startswith("run summary | iterations 5 (0->5) | samples 20 | tokens 320 | ")
               for x in lines)


def test_skip_train_prints_megatrons_line_of_the_evaluation_after_training(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pretrain("--train-iters", "2", "--save", ckpt)
    lines = pretrain("--train-iters", "2", "--skip-train", "--load", ckpt, "--eval-iters", "1")
    (m,) = filter(None, map(MEGATRON_VALIDATION.match, lines))
    assert m["iteration"] == "2" and m["after"] == " on validation set"
    assert parse_line(m.group(0))[0] == 2


def test_the_parser_reads_our_earlier_lines_under_the_new_names():
    old = ("iteration     10/30 | consumed samples 320 | ms/iteration 136.2 | ETA 3s | lr "
           "2.000e-03 | decoupled lr 1.000e-03 | lm loss 7.481 | grad norm 0.622 | loss scale 1 "
           "| skipped 0 | samples/s 235 | TFLOP/s/device 1.5 | memory GB per stage [0.52, 0.50]")
    assert parse_line(old) == (10, {
        "consumed samples": 320.0, "elapsed time per iteration (ms)": 136.2, "ETA": "3s",
        "learning rate": 2e-3, "decoupled learning rate": 1e-3, "lm loss": 7.481,
        "grad norm": 0.622, "loss scale": 1.0, "number of skipped iterations": 0.0,
        "samples/s": 235.0, "throughput per GPU (TFLOP/s/GPU)": 1.5,
        "memory GB per stage": [0.52, 0.50]})
    assert parse_line("iteration     15/30 | validation loss 7.12 | validation ppl 1239") == \
        (15, {"lm loss value": 7.12, "lm loss PPL": 1239.0})
    # Megatron-LM's own lines (no extras; an older one without microseconds in its stamp)
    megatron = (" [2024-03-01 10:00:00] iteration       10/      30 | consumed samples:       "
                "   320 | elapsed time per iteration (ms): 136.2 | learning rate: 2.000000E-03 "
                "| global batch size:    32 | lm loss: 7.481000E+00 | loss scale: 1.0 | grad "
                "norm: 0.622 | number of skipped iterations:   0 | number of nan iterations:   0 |")
    it, fields = parse_line(megatron)
    assert it == 10 and fields["lm loss"] == 7.481 and fields["global batch size"] == 32
    assert parse_line(" validation loss at iteration 20 on validation set | lm loss value: "
                      "6.500000E+00 | lm loss PPL: 6.651416E+02 | ")[0] == 20
    for other in ("-" * 40, "run summary | iterations 5 (0->5) | samples 20",
                  "straggler at iteration 6: rank 0", "successfully saved checkpoint at "
                  "iteration 2 to /x", "loading checkpoint from /x at iteration 3"):
        assert parse_line(other) is None, other


def test_an_interval_of_skipped_steps_prints_no_loss_and_keeps_megatrons_order():
    line = format_interval(3, 9, {"ETA": "1s", "number of nan iterations": 1,
                                  "consumed samples": 12, "loss scale": 2.0 ** 31,
                                  "learning rate": 0.0, "global batch size": 4,
                                  "elapsed time per iteration (ms)": 5.0,
                                  "number of skipped iterations": 3})
    m = MEGATRON_INTERVAL.match(line)
    assert m and m["loss"] is None and m["grad_norm"] is None and m["scale"] == "2147483648.0"
    assert line[m.end():] == " ETA: 1s |"


def test_compare_convergence_reads_new_old_and_megatrons_logs(tmp_path):
    """The tools read both formats: compare_convergence --from-logs draws the comparison from
    a log in our new line, one in our old line and one of Megatron-LM's own."""
    pytest.importorskip("matplotlib")
    import json
    from megatron_2bw.cli.compare_convergence import main
    from megatron_2bw.cli.convergence_report import curves_from_log
    from megatron_2bw.training.observe.log_line import validation_lines
    new = [format_interval(it, 4, {"consumed samples": 8 * it, "lm loss": loss,
                                   "elapsed time per iteration (ms)": 500.0, "ETA": "1s"})
           for it, loss in ((2, 7.0), (4, 6.0))]
    new[1:1] = validation_lines(3, 6.5, math.exp(6.5))
    old = ["iteration      2/4 | consumed samples 16 | ms/iteration 250 | lm loss 7.2 | ETA 1s",
           "iteration      3/4 | validation loss 6.9 | validation ppl 992.3",
           "iteration      4/4 | consumed samples 32 | ms/iteration 250 | lm loss 6.4 | ETA 0s"]
    megatron = [" [2024-03-01 10:00:00] iteration        4/       4 | consumed samples:       "
                "     32 | elapsed time per iteration (ms): 1000.0 | learning rate: 1.000000E-03 "
                "| global batch size:     8 | lm loss: 6.200000E+00 | loss scale: 1.0 | grad "
                "norm: 0.500 | number of skipped iterations:   0 | number of nan iterations:   0 |",
                "-" * 20, " validation loss at iteration 4 | lm loss value: 6.300000E+00 | lm "
                "loss PPL: 5.445719E+02 | ", "-" * 20]
    assert curves_from_log("\n".join(new)) == ([7.0, 7.0, 6.0, 6.0], [[3, 6.5, 1.5]])
    assert curves_from_log("\n".join(old)) == ([7.2, 7.2, 6.4, 6.4], [[3, 6.9, 0.75]])
    assert curves_from_log("\n".join(megatron)) == ([6.2] * 4, [[4, 6.3, 4.0]])
    logs = []
    for run, lines in (("gpipe", new), ("2bw", old), ("flush", megatron)):
        path = tmp_path / f"{run}.out"
        path.write_text("unrelated line\n" + "\n".join(lines) + "\n")
        logs.append(f"{run}={path}")
    assert main(["--from-logs", *logs, "--out-dir", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final_loss"] == {"gpipe": 6.0, "2bw": 6.4, "flush": 6.2}
    assert summary["final_validation_loss"] == {"gpipe": 6.5, "2bw": 6.9, "flush": 6.3}
    assert summary["to_target"]["flush"] == {"iterations": 4, "seconds": 4.0}
