"""checkpoint/files.py's DeepSpeed `latest` (the tag names the iteration directory, by its
global_stepN or by its record; a directory both wrote counts the newer), and
checkpoint/deepspeed_pipe/zero.py on DeepSpeed's saved optimizer forms, built here as its
engine writes them (deepspeed/runtime/engine.py `_common_checkpoint_state`,
runtime/zero/stage_1_and_2.py `state_dict`): ZeRO-0's torch state by module order in one group
or Megatron-DeepSpeed's weight-decay groups; ZeRO-1's partitions cut by param_shapes (files
without param_slice_mappings) with a rigid base state's padding; what cannot be mapped is a
reason, not a guess. (The real DeepSpeed's files: tests/distributed/test_ckpt_deepspeed.py.)"""
from collections import OrderedDict

import torch

from megatron_2bw.checkpoint.deepspeed_pipe.zero import stage_optimizer
from megatron_2bw.checkpoint.files import LATEST, iteration_dir, latest_iteration

PARAMS = [("tied_modules.embed.word_embeddings.weight", (4, 2)), ("2.dense.weight", (2, 2)),
          ("2.dense.bias", (2,)), ("3.weight", (2,))]


def _torch_state(order):
    groups = [{"params": list(range(sum(map(len, order[:i])), sum(map(len, order[:i + 1])))),
               "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8} for i in range(len(order))]
    flat = [p for g in order for p in g]
    state = {i: {"step": torch.tensor(5.0), "exp_avg": torch.full(shape, float(i)),
                 "exp_avg_sq": torch.full(shape, float(i) + 0.5)} for i, (_, shape) in
             enumerate(flat)}
    return {"state": state, "param_groups": groups}


def test_zero0_by_module_order_or_megatron_deepspeeds_groups():
    wd, no_wd = PARAMS[:2], PARAMS[2:]
    for order in ([PARAMS], [wd, no_wd]):
        got, why = stage_optimizer({"optimizer": _torch_state(order)}, [], PARAMS)
        assert why is None and got.steps == 5 and got.groups[0]["betas"] == (0.9, 0.999)
        flat = [p for g in order for p in g]
        for i, (name, shape) in enumerate(flat):
            want = torch.full(shape, float(i)).reshape(-1)
            assert torch.equal(got.tensors[name]["exp_avg"], want)


def test_zero0_that_matches_no_order_and_fp16s_flat_groups_are_reasons():
    state = _torch_state([PARAMS[2:], PARAMS[:2]])  # the groups the other way round
    got, why = stage_optimizer({"optimizer": state}, [], PARAMS)
    assert got is None and why.startswith("its ZeRO-0 optimizer state (4 parameters in 2 groups)")
    got, why = stage_optimizer({"optimizer": {"optimizer_state_dict": {}, "fp32_groups_flat":
                                              []}}, [], PARAMS)
    assert got is None and "fp16 optimizer at ZeRO-0 saves flat groups without names" in why
    assert stage_optimizer({"optimizer": None}, [], PARAMS) == \
        (None, "the checkpoint holds no optimizer state")


def test_zero1_partitions_cut_by_param_shapes_with_padding():
    """Two data-parallel ranks, one group of 4*2 + 2*2 = 12 elements padded to 14: rank 0 holds
    [0, 7), rank 1 [7, 12) and 2 elements of padding in its rigid base state."""
    shapes = [OrderedDict((n, torch.Size(s)) for n, s in PARAMS[:2])]
    whole = torch.arange(12.0)
    ranks = []
    for lo, hi in ((0, 7), (7, 12)):
        padded = torch.cat([whole[lo:hi], torch.zeros(7 - (hi - lo))])
        ranks.append({"single_partition_of_fp32_groups": [whole[lo:hi]],
                      "base_optimizer_state": {"state": {0: {"step": 3, "exp_avg": padded,
                                                             "exp_avg_sq": 2 * padded}},
                                               "param_groups": [{"params": [0], "lr": 1.0}]},
                      "group_paddings": [7 - (hi - lo)]})
    got, why = stage_optimizer({"param_shapes": shapes}, ranks, None)
    assert why is None and got.steps == 3
    assert torch.equal(got.tensors[PARAMS[0][0]]["fp32"], whole[:8])
    assert torch.equal(got.tensors[PARAMS[1][0]]["exp_avg_sq"], 2 * whole[8:12])


def test_deepspeeds_latest_names_the_iteration_and_its_directory(tmp_path):
    tag = tmp_path / "global_step7"
    tag.mkdir()
    torch.save({"global_steps": 7}, tag / "mp_rank_00_model_states.pt")
    assert latest_iteration(str(tmp_path)) is None  # no `latest` yet
    (tmp_path / "latest").write_text("global_step7")
    assert latest_iteration(str(tmp_path)) == 7
    assert iteration_dir(str(tmp_path), 7) == str(tag)
    assert iteration_dir(str(tmp_path), 8) == str(tmp_path / "iter_0000008")  # a save: ours
    (tmp_path / LATEST).write_text("5")  # Megatron-DeepSpeed's own file, or an older save
    assert latest_iteration(str(tmp_path)) == 7
    (tmp_path / LATEST).write_text("9")
    assert latest_iteration(str(tmp_path)) == 9
    (tmp_path / LATEST).unlink()
    tag.rename(tmp_path / "mytag")  # a tag of any name: its record's iteration
    (tmp_path / "latest").write_text("mytag")
    torch.save({"global_steps": 7, "iteration": 6}, tmp_path / "mytag" /
               "mp_rank_00_model_states.pt")
    assert latest_iteration(str(tmp_path)) == 6
    assert iteration_dir(str(tmp_path), 6) == str(tmp_path / "mytag")
