"""Which activation messages carry a shape header (schedule.actions.SHAPE_MODES): none for the
pretrain scripts' fixed shapes, one per batch by DeepSpeed's default, one per microbatch under
dynamic_shape; the real interpreter and the NCCL-order model agree in each mode (the recording
stage of test_nccl_order.py)."""
import pytest

from megatron_2bw.schedule import CommLayout
from megatron_2bw.schedule.actions import header_period, is_header, shape_mode
from megatron_2bw.schedule.kinds import schedule_kind
from test_nccl_order import _schedule
from test_nccl_order_interpreter import _model_log, _Stage


def test_fixed_shapes_send_no_header_and_the_modes_are_named():
    """The pretrain scripts' engine (every batch [b, seq]) sends no shape header at all: no
    tail, no host read of one, early receives as without headers; DeepSpeed's default a header
    per batch, dynamic_shape=True one per microbatch (after the run's first)."""
    assert [shape_mode(x) for x in (False, True, "fixed")] == ["batch", "microbatch", "fixed"]
    with pytest.raises(ValueError, match="unknown shape mode 'sometimes'"):
        shape_mode("sometimes")
    m, first = 4, 4
    headers = {mode: [mb for mb in range(16) if is_header(header_period(mode, m), first, mb)]
               for mode in ("fixed", "batch", "microbatch")}
    assert headers == {"fixed": [], "batch": [0, 8, 12],
                       "microbatch": [mb for mb in range(16) if mb != first]}
    sched = _schedule(schedule_kind("2bw"), 3, 3, 1).materialized()
    for s in range(3):
        stage = _Stage(3, s)
        stage.shapes = "fixed"
        assert stage.run(sched, s) == _model_log(sched, CommLayout(shapes="fixed"), s)


def test_the_pretrain_engine_runs_with_fixed_shapes():
    from megatron_2bw.config import Config
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine
    cfg = Config().replace(model={"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                  "seq_length": 16, "vocab_size": 128})
    engine = build_engine(cfg, ProcessGrid(1, 1, 1), "cpu")
    assert engine.shapes == "fixed" and engine._comm_layout.shapes == "fixed"
