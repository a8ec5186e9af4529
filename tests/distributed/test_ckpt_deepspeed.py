"""Megatron-DeepSpeed / DeepSpeed pipeline checkpoints load and continue here (issue 45, Build
point 3): a GPT shaped and named as Megatron-DeepSpeed's GPTModelPipe (tests/mds_models.py,
which cites the files it follows) is trained 3 batches by the real DeepSpeed 0.19.8 pipeline
engine on 2 gloo processes (2 stages) with Megatron-DeepSpeed's optimizer groups and scheduler,
at ZeRO-0 (the QKV per query group, before Megatron-DeepSpeed's commit 676a482) and ZeRO-1 (the
QKV in thirds, from it on), and saved as Megatron-DeepSpeed saves (its client state). Each
checkpoint is built once per module.

It loads (1) through --load (our GPT, the same architecture flags) at (t, d, w) = (1, 2, 1) and
(2, 1, 1), and (2) through the DeepSpeed drop-in's engine.load_checkpoint for the same
PipelineModule code. Either way: the loss on a fixed batch equals DeepSpeed's within 1e-5
(fp32), the iteration carries over, Adam's moments equal DeepSpeed's own (read from its running
optimizer) exactly, and one more batch gives DeepSpeed's own next weights (the fixed batch's
loss within 1e-5 of DeepSpeed's after the same batch). The drop-in returns DeepSpeed's load
path and client_state keys, as DeepSpeed's own load_checkpoint of the same tag does."""
import math
import shutil
from pathlib import Path

import pytest
import torch

import mds_models as mds
from megatron_2bw.checkpoint.api import load_checkpoint
from megatron_2bw.checkpoint.files import CheckpointError
from megatron_2bw.checkpoint.megatron import mapping
from megatron_2bw.checkpoint.resume import resume_note
from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.build import build_engine, mock_batches
from megatron_2bw.training.spawn import spawn
from test_ckpt_reshard import _dump, merged, unshard

RUNS = [(0, False, "zero0"), (1, True, "zero1-thirds")]
TAG = f"global_step{mds.ITERATION}"


@pytest.fixture(scope="module")
def deepspeed_checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, {stage: DeepSpeed's results on that stage's rank})."""
    tmp = tmp_path_factory.mktemp("deepspeed")
    runs = [(zero, thirds, str(tmp / name)) for zero, thirds, name in RUNS]
    spawn(mds.save_worker, 2, args=(runs, str(tmp / "out.pt")), timeout_minutes=4)
    out = torch.load(tmp / "out.pt", weights_only=False)
    return {name: (root, {r[root]["stage"]: r[root] for r in out})
            for (_, _, root), (_, _, name) in zip(runs, RUNS)}


def our_cfg(t, d, w, extra=()):
    return build_config(build_parser("gpt").parse_args(mds.our_flags(t, d) + list(extra)),
                        "gpt", t * d * w).config


def expected_moments(cfg, stages: dict, thirds: bool) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's Adam state in our names: its stage modules' names mapped by hand
    (GPTModelPipe's layer list: 1 embedding, 2.. the layers, then the final norm; the tied
    embedding's from stage 0), the layout by mapping.to_ours (thirds reordered per head)."""
    L, out = mds.LAYERS, {"exp_avg": {}, "exp_avg_sq": {}, "fp32": {}}
    logical = {"tied_modules.embed.word_embeddings.weight": "embedding.word_embeddings.weight",
               "tied_modules.embed.position_embeddings.weight":
               "embedding.position_embeddings.weight",
               f"{L + 2}.weight": "decoder.final_layernorm.weight",
               f"{L + 2}.bias": "decoder.final_layernorm.bias"}
    legacy = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "pre_mlp_layernorm",
              "self_attention.query_key_value": "self_attention.linear_qkv",
              "self_attention.dense": "self_attention.linear_proj",
              "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
    for i in range(L):
        for old, new in legacy.items():
            for p in ("weight", "bias"):
                logical[f"{i + 2}.{old}.{p}"] = f"decoder.layers.{i}.{new}.{p}"
    links = {x.theirs: x for x in mapping.links(cfg.model)}
    for stage in sorted(stages, reverse=True):  # stage 0 last: its tied copies win
        for name, state in stages[stage]["moments"].items():
            link = links[logical[name]]
            for kind in (k for k in out if k in state):
                t = state[kind].reshape(link.shape)
                if thirds and "linear_qkv" in link.theirs:
                    t = t.reshape(3, mds.HEADS, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
                out[kind][link.ours] = mapping.to_ours(link, t)
    return out


def _load_worker(rank, world, cfg, ckpt, out, load_optim, finetune, load_rng):
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    lines = []
    start = load_checkpoint(ckpt, engine, cfg, grid, load_optim=load_optim, finetune=finetune,
                            log=lines.append, load_rng=load_rng)
    rng, dump = torch.get_rng_state(), _dump(engine, cfg, grid)
    fixed = float(engine.eval_batch(mock_batches(cfg, grid.data, grid.dp_rank, start_batch=0)))
    data = mock_batches(cfg, grid.data, grid.dp_rank, start_batch=start)
    trained = float(engine.train_batch(data))
    after = float(engine.eval_batch(mock_batches(cfg, grid.data, grid.dp_rank, start_batch=0)))
    torch.save({"start": start, "fixed": fixed, "after": after, "trained": trained,
                "iteration": engine.iteration, "lines": lines, "rng": rng, "dump": dump,
                "stage": grid.stage, "tp": grid.tp_rank}, f"{out}.{rank}")


def load(cfg, ckpt, tmp_path, load_optim=True, finetune=False, load_rng=True) -> list[dict]:
    world = cfg.parallel.tensor * cfg.parallel.pipeline * cfg.data_parallel_size
    out = str(tmp_path / "loaded")
    spawn(_load_worker, world, args=(cfg, ckpt, out, load_optim, finetune, load_rng),
          timeout_minutes=3)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("layout", [(1, 2, 1), (2, 1, 1)], ids=["t1d2w1", "t2d1w1"])
@pytest.mark.parametrize("name", [name for _, _, name in RUNS])
def test_pretrain_load_carries_weights_iteration_and_adam_over_and_continues_deepspeeds_run(
        deepspeed_checkpoints, tmp_path, name, layout):
    ckpt, theirs = deepspeed_checkpoints[name]
    cfg = our_cfg(*layout)
    results = load(cfg, ckpt, tmp_path)
    last = results[-1]
    assert {r["start"] for r in results} == {mds.ITERATION}
    assert math.isclose(last["fixed"], theirs[0]["fixed"], rel_tol=1e-5), \
        (last["fixed"], theirs[0]["fixed"])
    assert last["iteration"] == mds.ITERATION + 1
    assert math.isclose(last["trained"], theirs[0]["losses"][-1], rel_tol=1e-5)
    assert math.isclose(last["after"], theirs[0]["after"], rel_tol=1e-5), \
        (last["after"], theirs[0]["after"])
    dumps = unshard([r["dump"] for r in results])
    assert {x["steps"] for x in dumps} == {mds.ITERATION}
    want = expected_moments(cfg, theirs, thirds="thirds" in name)
    for kind in ("exp_avg", "exp_avg_sq"):
        got = merged(dumps, kind)
        assert set(got) == set(want[kind])
        bad = [n for n in got if not torch.equal(got[n], want[kind][n])]
        assert not bad, (kind, bad)
    assert f"checkpoint {ckpt}/{TAG}: not written by megatron-2bw: files not verified" in \
        last["lines"]
    assert not any(x.startswith("optimizer state restarts") for x in last["lines"])


def test_no_load_optim_finetune_and_no_load_rng_keep_megatrons_meanings(
        deepspeed_checkpoints, tmp_path):
    """Saved at t=1 d=2: that layout gets each stage's torch RNG state back; --no-load-rng and
    --finetune keep their own, --no-load-optim starts Adam fresh, --finetune at iteration 0."""
    ckpt, theirs = deepspeed_checkpoints["zero1-thirds"]
    cfg = our_cfg(1, 2, 1)
    same = load(cfg, ckpt, tmp_path)
    assert all(torch.equal(r["rng"], theirs[r["stage"]]["rng"]) for r in same)
    for r in load(cfg, ckpt, tmp_path, load_rng=False):
        assert not torch.equal(r["rng"], theirs[r["stage"]]["rng"])
    fresh = load(cfg, ckpt, tmp_path, load_optim=False)
    assert {r["start"] for r in fresh} == {mds.ITERATION}
    assert all(r["dump"]["steps"] == 0 and not any(v.any() for v in r["dump"]["exp_avg"]
                                                   .values()) for r in fresh)
    assert math.isclose(fresh[-1]["fixed"], theirs[0]["fixed"], rel_tol=1e-5)
    tuned = load(cfg, ckpt, tmp_path, finetune=True)
    assert {r["start"] for r in tuned} == {0} and tuned[-1]["dump"]["steps"] == 0
    assert math.isclose(tuned[-1]["fixed"], theirs[0]["fixed"], rel_tol=1e-5)
    assert not any(torch.equal(r["rng"], theirs[r["stage"]]["rng"]) for r in tuned)


def _drop_in_worker(rank, world, root, zero, thirds, out, stages=2):
    import megatron_2bw as deepspeed
    from megatron_2bw.deepspeed.from_deepspeed import _engine_index
    net = mds.build_model(deepspeed, thirds, num_stages=stages)
    engine, _, _, _ = deepspeed.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": mds.BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": mds.LR, "betas": [0.9, 0.999],
                                                  "eps": 1e-8, "weight_decay": 0.0}},
        "gradient_clipping": 0.0, "zero_optimization": {"stage": zero},
        "pipeline": {"schedule": "flush"}})
    path, client = engine.load_checkpoint(root)
    fixed = float(engine.eval_batch(mds.samples(0, mds.BATCH), num_micro_batches=mds.BATCH))
    # the whole optimizer state on data-parallel rank 0 (collective under ZeRO-1: as it saves)
    opt, w = engine._unsharded_state()["optimizer"], engine._engine.weights
    moments = None if "pieces" in opt else {
        n: {k: opt[k][w.offsets[i]:w.offsets[i] + w.shapes[i].numel()].clone()
            for k in ("exp_avg", "exp_avg_sq")}
        for n, i in _engine_index(net, {n: i for i, n in enumerate(w.names)}).items()}
    steps, global_steps = (opt.get("steps"), engine.global_steps)
    trained = float(engine.train_batch(mds.samples(mds.ITERATION * mds.BATCH, mds.BATCH)))
    after = float(engine.eval_batch(mds.samples(0, mds.BATCH), num_micro_batches=mds.BATCH))
    torch.save({"path": path, "client_keys": sorted(client), "iteration": client.get(
        "iteration"), "fixed": fixed, "moments": moments, "steps": steps, "global_steps":
        global_steps, "trained": trained, "after": after, "stage": engine.stage_id},
        f"{out}.{rank}")


@pytest.mark.parametrize("name", [name for _, _, name in RUNS])
def test_the_drop_ins_load_checkpoint_reads_what_deepspeed_wrote(deepspeed_checkpoints,
                                                                 tmp_path, name):
    ckpt, theirs = deepspeed_checkpoints[name]
    zero, thirds = next((z, t) for z, t, n in RUNS if n == name)
    spawn(_drop_in_worker, 2, args=(ckpt, zero, thirds, str(tmp_path / "got")),
          timeout_minutes=3)
    for rank in range(2):
        got = torch.load(f"{tmp_path / 'got'}.{rank}", weights_only=False)
        ds = theirs[got["stage"]]
        assert got["path"] == ds["load_path"] and got["client_keys"] == ds["client_keys"]
        assert got["iteration"] == mds.ITERATION and got["global_steps"] == ds["global_steps"]
        assert math.isclose(got["fixed"], ds["fixed"], rel_tol=1e-5), (got["fixed"], ds["fixed"])
        assert got["steps"] == mds.ITERATION and set(got["moments"]) == set(ds["moments"])
        bad = [n for n, m in ds["moments"].items()
               if not all(torch.equal(m[k], got["moments"][n][k]) for k in ("exp_avg",
                                                                           "exp_avg_sq"))]
        assert not bad, bad
        assert math.isclose(got["trained"], ds["losses"][-1], rel_tol=1e-5)
        assert math.isclose(got["after"], ds["after"], rel_tol=1e-5), (got["after"], ds["after"])



@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    """ZeRO-1 over 2 data-parallel replicas of the 2 stages (4 processes): each stage's flat
    groups are cut into two partitions, one parameter across the cut (2.self_attention.dense)."""
    tmp = tmp_path_factory.mktemp("deepspeed-dp2")
    spawn(mds.save_worker, 4, args=([(1, True, str(tmp / "ckpt"))], str(tmp / "out.pt")),
          timeout_minutes=4)
    out = torch.load(tmp / "out.pt", weights_only=False)
    return str(tmp / "ckpt"), {r[str(tmp / "ckpt")]["stage"]: r[str(tmp / "ckpt")] for r in out}


def test_zero1_partitions_of_two_replicas_join_by_parameter(two_replicas, tmp_path):
    ckpt, theirs = two_replicas
    assert sorted(p.name for p in (Path(ckpt) / TAG).glob("zero_pp_rank_*")) == [
        f"zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt" for d in range(2) for mp in range(2)]
    cfg = our_cfg(1, 2, 1)
    results = load(cfg, ckpt, tmp_path)
    assert math.isclose(results[-1]["fixed"], theirs[0]["fixed"], rel_tol=1e-5)
    assert math.isclose(results[-1]["after"], theirs[0]["after"], rel_tol=1e-5)
    want = expected_moments(cfg, theirs, thirds=True)
    dumps = unshard([r["dump"] for r in results])
    for kind in ("exp_avg", "exp_avg_sq"):
        got = merged(dumps, kind)
        assert [n for n in got if not torch.equal(got[n], want[kind][n])] == []
    spawn(_drop_in_worker, 4, args=(ckpt, 1, True, str(tmp_path / "got")), timeout_minutes=3)
    for rank in range(4):
        got = torch.load(f"{tmp_path / 'got'}.{rank}", weights_only=False)
        ds = theirs[got["stage"]]
        assert math.isclose(got["fixed"], ds["fixed"], rel_tol=1e-5)
        assert got["moments"] is None or all(
            torch.equal(m[k], got["moments"][n][k]) for n, m in ds["moments"].items()
            for k in ("exp_avg", "exp_avg_sq"))
        assert math.isclose(got["after"], ds["after"], rel_tol=1e-5)


def test_a_bf16_run_loads_its_fp32_master_weights_and_moments(tmp_path):
    """ZeRO-1 with bf16 (DeepSpeed's bf16 optimizer files): the layer files hold bf16 weights,
    the zero files the fp32 master; an fp32 run continues from the master, bitwise."""
    ckpt = str(tmp_path / "bf16")
    spawn(mds.save_worker, 2, args=([(1, False, ckpt, True)], str(tmp_path / "out.pt")),
          timeout_minutes=4)
    theirs = {r[ckpt]["stage"]: r[ckpt] for r in torch.load(tmp_path / "out.pt",
                                                           weights_only=False)}
    assert sorted(p.name for p in (Path(ckpt) / TAG).glob("*zero*")) == [
        f"bf16_zero_pp_rank_0_mp_rank_0{mp}_optim_states.pt" for mp in range(2)]
    cfg = our_cfg(1, 2, 1)
    results = load(cfg, ckpt, tmp_path)
    assert any("was saved with bf16; continuing with fp32" in x for x in results[-1]["lines"])
    want, dumps = expected_moments(cfg, theirs, thirds=False), unshard([r["dump"] for r in results])
    for kind, ours in (("fp32", "newest"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        got = merged(dumps, ours)
        assert [n for n in got if not torch.equal(got[n], want[kind][n])] == [], kind

# -- refusals, messages, inspect ---------------------------------------------------------------
def _copy(deepspeed_checkpoints, tmp_path, name="zero0") -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(deepspeed_checkpoints[name][0], root)
    return root


def _listing(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _one_line(fn) -> str:
    with pytest.raises(CheckpointError) as e:
        fn()
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def _resume(ckpt, extra=()):
    return resume_note(our_cfg(1, 1, 1, ["--load", str(ckpt), *extra]), 1)


def test_the_resume_check_reads_its_layout_and_refuses_another_architecture(
        deepspeed_checkpoints):
    ckpt, _ = deepspeed_checkpoints["zero0"]
    note = _resume(ckpt)
    assert f"resuming iteration {mds.ITERATION} of --load {ckpt} (DeepSpeed pipeline " \
        "checkpoint by Megatron-DeepSpeed) saved with t=1 d=2 w=1 flush on 2 ranks" in note
    line = _one_line(lambda: _resume(ckpt, ["--swiglu"]))
    assert "(a Megatron checkpoint, iteration 3) differs from this run: " in line and \
        "swiglu False (this run: True; use no --swiglu)" in line, line
    line = _one_line(lambda: _resume(ckpt, ["--num-layers", "3"]))
    assert "num_layers 2 (this run: 3; use --num-layers 2)" in line


@pytest.mark.parametrize("damage,expect", [
    ("unknown", "whose layer 2 (qkv.weight) is no layer of Megatron-DeepSpeed's GPTModelPipe: "
                "--load reads Megatron-DeepSpeed's GPT"),
    ("no-stage-file", "lacks mp_rank_01_model_states.pt (stage 1, tensor rank 0): the "
                      "checkpoint is incomplete"),
    ("no-layer-file", "holds 1 transformer layer files, its arguments say num_layers 2: a "
                      "layer file is missing"),
    ("no-zero-file", "lacks the ZeRO-1 file of data-parallel rank 0 of model rank 1"),
    ("truncated", "layer_02-model_states.pt is truncated or corrupted")])
def test_a_foreign_layout_an_incomplete_or_truncated_checkpoint_is_one_line_before_any_group(
        deepspeed_checkpoints, tmp_path, damage, expect):
    ckpt = _copy(deepspeed_checkpoints, tmp_path, "zero1-thirds" if damage == "no-zero-file"
                 else "zero0")
    tag = ckpt / TAG
    if damage == "unknown":
        torch.save({"qkv.weight": torch.zeros(3)}, tag / "layer_02-model_states.pt")
    elif damage == "no-stage-file":
        (tag / "mp_rank_01_model_states.pt").unlink()
    elif damage == "no-layer-file":
        (tag / "layer_03-model_states.pt").unlink()
    elif damage == "no-zero-file":
        (tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    else:
        path = tag / "layer_02-model_states.pt"
        path.write_bytes(path.read_bytes()[:2000])
    before = _listing(ckpt)
    assert expect in _one_line(lambda: _resume(ckpt))
    assert _listing(ckpt) == before


def _refused_worker(rank, world, cfg, ckpt, out):
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    before = {k: v.clone() for k, v in engine.fp32_state().items()}
    try:
        load_checkpoint(ckpt, engine, cfg, grid)
        problem = None
    except CheckpointError as e:
        problem = str(e)
    same = all(torch.equal(before[k], v) for k, v in engine.fp32_state().items())
    torch.save({"problem": problem, "untouched": same}, out)


def test_a_corrupted_tensor_is_one_line_at_load_and_leaves_load_byte_identical(
        deepspeed_checkpoints, tmp_path):
    ckpt = _copy(deepspeed_checkpoints, tmp_path)
    path = ckpt / TAG / "layer_03-model_states.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor's record: the pickled record still reads
    path.write_bytes(bytes(data))
    before = _listing(ckpt)
    assert _resume(ckpt) is not None  # the resume check reads no tensor
    spawn(_refused_worker, 1, args=(our_cfg(1, 1, 1), str(ckpt), str(tmp_path / "r.pt")))
    got = torch.load(tmp_path / "r.pt")
    assert got["problem"].startswith(f"checkpoint file {path} is corrupted (its record "
                                     "layer_03-model_states/data/") and "\n" not in got["problem"]
    assert got["problem"].endswith("fails zip's CRC-32): copy it again or load another tag")
    assert got["untouched"] and _listing(ckpt) == before


def test_an_optimizer_state_that_cannot_be_mapped_restarts_in_one_line(deepspeed_checkpoints,
                                                                       tmp_path):
    """A ZeRO-0 state whose param groups match neither the module order nor Megatron-DeepSpeed's
    groups (here: stage 1's two groups swapped): the weights load, Adam starts fresh, said once."""
    ckpt, theirs = deepspeed_checkpoints["zero0"]
    ckpt = _copy(deepspeed_checkpoints, tmp_path)
    path = ckpt / TAG / "mp_rank_01_model_states.pt"
    record = torch.load(path, weights_only=False)
    record["optimizer"]["param_groups"].reverse()
    torch.save(record, path)
    [got] = load(our_cfg(1, 1, 1), str(ckpt), tmp_path)
    assert math.isclose(got["fixed"], theirs[0]["fixed"], rel_tol=1e-5)
    assert got["dump"]["steps"] == 0 and got["start"] == mds.ITERATION
    [line] = [x for x in got["lines"] if x.startswith("optimizer state restarts: ")]
    assert line == ("optimizer state restarts: its ZeRO-0 optimizer state (16 parameters in 2 "
                    "groups) matches this model's parameters in neither their module order nor "
                    "Megatron-DeepSpeed's weight-decay groups (mp_rank_01_model_states.pt)")


def test_the_drop_in_loads_zero1_at_another_stage_count(deepspeed_checkpoints, tmp_path):
    """ZeRO-1 names every parameter's state: one stage reads both stages' (the tied embedding's
    from stage 0) and continues DeepSpeed's run exactly."""
    ckpt, theirs = deepspeed_checkpoints["zero1-thirds"]
    spawn(_drop_in_worker, 1, args=(ckpt, 1, True, str(tmp_path / "got"), 1))
    got = torch.load(f"{tmp_path / 'got'}.0", weights_only=False)
    want = {**theirs[1]["moments"], **theirs[0]["moments"]}
    assert set(got["moments"]) == set(want) and all(
        torch.equal(m[k], got["moments"][n][k]) for n, m in want.items()
        for k in ("exp_avg", "exp_avg_sq"))
    assert math.isclose(got["fixed"], theirs[0]["fixed"], rel_tol=1e-5)
    assert math.isclose(got["after"], theirs[0]["after"], rel_tol=1e-5)
