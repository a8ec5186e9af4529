"""Foreign checkpoints are never called broken (issue 45): `m2bw-inspect` names the format, the
writer, the iteration and the layout of megatron-core's torch_dist, Megatron's torch format
(legacy names) and our own megatron-format export; a checkpoint without our checksums is "not
written by megatron-2bw: files not verified" (one line) and loads; what is wrong is one line:
an unknown format, a truncated file (theirs: shorter than the shards its .metadata places in it,
or a torch file whose zip records fail their CRC; ours: its checksum, as before)."""
import os
import shutil

import pytest

import mcore_models as mc
from inprocess import run_main
from megatron_2bw.checkpoint.convert.cli import main as convert_main
from megatron_2bw.checkpoint.files import CheckpointError
from megatron_2bw.checkpoint.inspect import main as inspect_main
from megatron_2bw.checkpoint.resume import resume_note
from megatron_2bw.training.spawn import spawn
from test_ckpt_megatron import load_and_evaluate, our_cfg
from test_resume import make_cfg, run

NOT_VERIFIED = "not written by megatron-2bw: files not verified"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inspect-megatron")
    spawn(mc.save_worker, 2, args=([("bert", 2, str(tmp / "bert"))], str(tmp / "l1.pt")),
          timeout_minutes=3)
    spawn(mc.torch_format_worker, 2, args=([("gpt-learned", 2, 2, True, str(tmp / "legacy"))],
                                           str(tmp / "l2.pt")), timeout_minutes=3)
    run(make_cfg(["--train-iters", "2", "--save", str(tmp / "ours")]), str(tmp / "losses"))
    assert run_main(convert_main, ["to-megatron", "--load", tmp / "ours", "--save",
                                   tmp / "export"]).returncode == 0
    return tmp


def inspect(*argv):
    proc = run_main(inspect_main, argv)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr.splitlines()


def test_megatron_cores_checkpoint_is_named_and_not_verified(checkpoints):
    root = checkpoints / "bert"
    code, out, err = inspect(root, "--tensors")
    assert code == 0, err
    assert out[0] == f"checkpoint {root} iteration {mc.ITERATION} (megatron-core torch_dist, " \
                     "written by megatron-core)"
    assert out[1].startswith("  saved by t=2 d=1 w=1 schedule 1F1B (Megatron)")
    assert out[1].endswith(f"consumed samples {mc.ITERATION * mc.BATCH}")
    assert out[2] == f"  model bert layers {mc.LAYERS} hidden {mc.HIDDEN} heads {mc.HEADS} vocab " \
                     f"{mc.VOCAB}"
    assert out[3] == "  optimizer state: the checkpoint holds no optimizer state"
    assert any(x.split()[0] == "encoder.layers.self_attention.linear_qkv.weight" and
               "(2, 96, 32)" in x for x in out)
    assert out[-1] == f"complete: every shard file is present and every tensor covered; " \
                      f"{NOT_VERIFIED}"


def test_megatrons_torch_format_with_legacy_names_is_named(checkpoints):
    root = checkpoints / "legacy"
    code, out, err = inspect(root, "--tensors")
    assert code == 0, err
    assert out[0] == f"checkpoint {root} iteration {mc.ITERATION} (Megatron torch format, " \
                     "written by Megatron legacy)"
    assert out[1].startswith("  saved by t=2 d=2 w=1 schedule 1F1B (Megatron)")
    assert "  iter_0000005/mp_rank_01_001: language_model.encoder.layers.0.mlp.dense_h_to_4h." \
           "weight" in out
    assert out[-1] == f"complete: every stage file is present; {NOT_VERIFIED}"


def test_our_export_is_named_and_verified(checkpoints):
    root = checkpoints / "export"
    code, out, err = inspect(root)
    assert code == 0, err
    assert out[0] == f"checkpoint {root} iteration 2 (megatron-core torch_dist, written by " \
                     "megatron-2bw (megatron-core format))"
    assert out[1] == "  saved by t=1 d=2 w=1 schedule 2bw compensation none; consumed samples 16"
    assert out[-1] == "complete: every shard is present and matches its checksum"
    assert any(x.split()[0] == "metadata.json" for x in out)


def test_an_unknown_format_is_one_line(tmp_path):
    root = tmp_path / "ck"
    (root / "iter_0000001").mkdir(parents=True)
    (root / "iter_0000001" / "model.safetensors").write_bytes(b"\0" * 8)
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")
    code, out, err = inspect(root)
    assert code == 1 and len(err) == 1
    assert "is in no format this project reads (it holds model.safetensors" in err[0]


def test_a_truncated_megatron_core_file_is_one_line_when_loaded_and_inspected(checkpoints,
                                                                            tmp_path):
    root = tmp_path / "bert"
    shutil.copytree(checkpoints / "bert", root)
    shard = root / f"iter_{mc.ITERATION:07d}" / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    code, _, err = inspect(root)
    assert code == 1 and len(err) == 1 and f"{shard} is truncated ({len(data) // 2} bytes" \
        in err[0]
    with pytest.raises(Exception) as e:
        load_and_evaluate(our_cfg("bert", 1, 1, 1), str(root), tmp_path / "x.pt")
    assert f"checkpoint file {shard} is truncated" in str(e.value)


def test_a_truncated_megatron_torch_file_is_one_line_before_any_process_group(checkpoints,
                                                                            tmp_path):
    root = tmp_path / "legacy"
    shutil.copytree(checkpoints / "legacy", root)
    first = root / f"iter_{mc.ITERATION:07d}" / "mp_rank_00_000" / "model_optim_rng.pt"
    first.write_bytes(first.read_bytes()[:1000])
    family, argv = mc.our_flags("gpt-learned", 1, 1)
    from megatron_2bw.config.build import build_config
    from megatron_2bw.pretrain import build_parser
    cfg = build_config(build_parser(family).parse_args(argv + ["--load", str(root)]), family,
                       1).config
    with pytest.raises(CheckpointError) as e:
        resume_note(cfg, 1)
    assert "\n" not in str(e.value) and f"{first} is truncated or corrupted" in str(e.value)


def test_a_truncated_file_of_ours_still_fails_its_checksum(checkpoints, tmp_path):
    root = tmp_path / "export"
    shutil.copytree(checkpoints / "export", root)
    shard = root / "iter_0000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    code, _, err = inspect(root)
    assert code == 1 and err == [f"error: checkpoint {root} iteration 2 is damaged: "
                                 "__0_0.distcp does not match its checksum"]
    assert os.path.getsize(shard) > 0
