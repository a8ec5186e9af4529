"""Issue 34 point 3: with one pipeline stage the default schedule is the synchronous flush (one
log line says so); an explicit delaying schedule at one stage warns that it delays the gradient
for nothing. With more stages the default stays PipeDream-2BW, silently."""
import pytest

from megatron_2bw.config.build import build_config
from megatron_2bw.pretrain import build_parser
from megatron_2bw.schedule.kinds import DEFAULT_SCHEDULE, schedule_kind

BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16"]


def built(argv, world=1):
    return build_config(build_parser("gpt").parse_args(BASE + argv), "gpt", world)


def lines_with(notes, word):
    return [line for line in notes if word in line]


def test_one_stage_defaults_to_flush_in_one_line():
    b = built([])
    assert schedule_kind(b.config.schedule).synchronous
    assert b.config.schedule == "flush"
    said = lines_with(b.notes, "one pipeline stage")
    assert len(said) == 1 and "flush" in said[0] and "synchronous" in said[0]
    assert not lines_with(b.notes, "warning")


def test_explicit_2bw_at_one_stage_warns_once():
    b = built(["--pipeline-schedule", "2bw"])
    assert b.config.schedule == "2bw"  # asked for: kept
    warned = lines_with(b.notes, "warning")
    assert len(warned) == 1
    assert "delays the gradient" in warned[0] and "for nothing" in warned[0]
    assert "--pipeline-schedule flush" in warned[0]


def test_compensation_asks_for_2bw_and_warns_at_one_stage():
    b = built(["--2bw-compensation", "predict"])
    assert b.config.schedule == DEFAULT_SCHEDULE
    assert len(lines_with(b.notes, "for nothing")) == 1


@pytest.mark.parametrize("schedule", ["flush", "gpipe"])
def test_explicit_synchronous_schedule_at_one_stage_is_silent(schedule):
    b = built(["--pipeline-schedule", schedule])
    assert b.config.schedule == schedule
    assert not lines_with(b.notes, "pipeline stage") and not lines_with(b.notes, "warning")


def test_two_stages_keep_2bw_silently():
    b = built(["--pipeline-model-parallel-size", "2", "--global-batch-size", "2"], world=2)
    assert b.config.schedule == DEFAULT_SCHEDULE == "2bw"
    assert not lines_with(b.notes, "pipeline stage")
    b = built(["--pipeline-model-parallel-size", "2", "--global-batch-size", "2",
               "--pipeline-schedule", "2bw"], world=2)
    assert not lines_with(b.notes, "warning")


def test_deepspeed_stages_choose_the_default(tmp_path):
    """The stage count may come from a DeepSpeed JSON: the default follows it."""
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, '
                  '"pipeline": {"stages": 2}}')
    b = built(["--deepspeed_config", str(ds)], world=2)
    assert b.config.parallel.pipeline == 2 and b.config.schedule == DEFAULT_SCHEDULE


def test_kind_owns_the_warning():
    assert schedule_kind("2bw").one_stage_warning(1)
    assert schedule_kind("2bw").one_stage_warning(2) is None
    assert schedule_kind("flush").one_stage_warning(1) is None
