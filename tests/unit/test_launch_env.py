"""Rank/world detection from launcher environments (torchrun, SLURM srun, MPI)."""
import re

import pytest

from megatron_2bw.config.launcher_env import env_rank_world
from megatron_2bw.parallel import launcher as D


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
              "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID",
              "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_no_launcher_is_a_single_process(clean_env):
    assert env_rank_world() == (0, 1, 0)


def test_torchrun_variables_win(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "2")
    assert env_rank_world() == (3, 8, 1)


def test_plain_srun(clean_env):
    clean_env.setenv("SLURM_PROCID", "9")
    clean_env.setenv("SLURM_NTASKS", "16")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_JOB_NODELIST", "gpu[007-008],cpu1")
    clean_env.setenv("SLURM_JOB_ID", "123456")
    assert env_rank_world() == (9, 16, 1)
    D.slurm_rendezvous()
    import os
    assert os.environ["MASTER_ADDR"] == "gpu007"
    assert os.environ["MASTER_PORT"] == str(20000 + 123456 % 20000)


def test_deepspeeds_launcher(clean_env):
    """`deepspeed --num_nodes 2 --num_gpus 4 ...` (deepspeed.launcher.launch on each node):
    torchrun's variables, the node as CROSS_RANK / CROSS_SIZE and its processes as LOCAL_SIZE,
    numbered contiguously; inside an sbatch allocation its block wins over the batch step's
    SLURM_GTIDS (which names the one batch task)."""
    for k, v in (("RANK", "6"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "2"), ("CROSS_RANK", "1"),
                 ("CROSS_SIZE", "2"), ("LOCAL_SIZE", "4"), ("SLURM_GTIDS", "0"),
                 ("SLURM_PROCID", "6"), ("SLURM_NTASKS", "1")):
        clean_env.setenv(k, v)
    clean_env.delenv("TORCHELASTIC_RUN_ID", raising=False)
    clean_env.delenv("GROUP_RANK", raising=False)
    assert env_rank_world() == (6, 8, 2) and D.launched()
    assert D.node_ranks(6, 2) == [4, 5, 6, 7]


def test_mpi(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "2")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert env_rank_world() == (2, 4, 0)


def test_mpich_pmi_is_read_by_the_one_list_both_front_doors_ask(clean_env):
    """MPICH / Intel MPI (PMI_*): pretrain's env_rank_world and DeepSpeed's init_distributed
    (discover_env) read the same LAUNCHER_VARS."""
    clean_env.setenv("PMI_RANK", "5")
    clean_env.setenv("PMI_SIZE", "6")
    clean_env.setenv("MPI_LOCALRANKID", "1")
    assert D.launched() and env_rank_world() == (5, 6, 1)
    clean_env.setenv("MPI_LOCALNRANKS", "6")  # one node: no MASTER_ADDR needed
    D.discover_env(29500)
    import os
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == \
        ("5", "6", "1")


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[01-02,10],login", ["gpu01", "gpu02", "gpu10", "login"]),
    ("a[9-11],b", ["a9", "a10", "a11", "b"]),
    # prefix[ranges]suffix
    ("a[1-2]-ib", ["a1-ib", "a2-ib"]),
    ("gpu[7]", ["gpu7"]),
    # several bracket groups: the first varies slowest, as scontrol show hostnames lists them
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("x[8-9]y[1,3]z", ["x8y1z", "x8y3z", "x9y1z", "x9y3z"]),
    # zero padding: the width of the range's first number
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    # comma lists inside and outside brackets
    ("a[1,3-4],b7,c[01-02]x", ["a1", "a3", "a4", "b7", "c01x", "c02x"]),
    (" login1,login2 ", ["login1", "login2"]),
])
def test_expand_nodelist_like_scontrol(nodelist, hosts):
    assert D.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist,problem", [
    ("a[1-2", "unbalanced brackets"), ("a1-2]", "unbalanced brackets"),
    ("a[[1]]", "unbalanced brackets"), ("a[x]", "[x] is not a list of numbers"),
    ("a[3-1]", "[3-1] is not a list of numbers"), ("a[1-]", "[1-] is not a list of numbers"),
])
def test_a_bad_host_list_is_one_line_naming_it(nodelist, problem):
    from megatron_2bw.config import ConfigError
    with pytest.raises(ConfigError, match=re.escape(f"SLURM host list {nodelist!r}: {problem}")):
        D.expand_nodelist(nodelist)


def test_slurm_hosts_asks_scontrol_where_it_exists_else_parses(monkeypatch):
    import subprocess
    calls = []

    def fake_run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="h-a\nh-b\n", stderr="")
    monkeypatch.setattr(D.shutil, "which", lambda name: "/usr/bin/scontrol")
    monkeypatch.setattr(D.subprocess, "run", fake_run)
    assert D.slurm_hosts("h-[a,b]") == ["h-a", "h-b"]  # a form only scontrol knows
    assert calls == [["/usr/bin/scontrol", "show", "hostnames", "h-[a,b]"]]

    def failing(argv, **kw):
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="no controller")
    monkeypatch.setattr(D.subprocess, "run", failing)
    assert D.slurm_hosts("a[1-2]-ib") == ["a1-ib", "a2-ib"]
    monkeypatch.setattr(D.shutil, "which", lambda name: None)
    assert D.slurm_hosts("rack[1-2]-n[01-02]")[1] == "rack1-n02"


def test_srun_rendezvous_is_the_first_host_by_name_and_a_port_from_the_job_id(clean_env,
                                                                             monkeypatch):
    monkeypatch.setattr(D.shutil, "which", lambda name: None)  # the parser
    clean_env.setenv("SLURM_JOB_NODELIST", "a[1-2]-ib")
    clean_env.setenv("SLURM_JOB_ID", "20077")
    D.slurm_rendezvous()
    import os
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("a1-ib", "20077")
    assert D.slurm_port(20077) != D.slurm_port(20078)  # two jobs on one node
    assert {D.slurm_port(j) for j in (1, 19999, 20000, 987654321)} <= set(range(20000, 40000))
    clean_env.setenv("MASTER_PORT", "31337")  # set by the user: kept
    clean_env.setenv("MASTER_ADDR", "10.0.0.1")
    D.slurm_rendezvous()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.1", "31337")


SLURM_DIR = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "slurm"
SCRIPTS = ["pretrain_gpt_2bw.sbatch", "pretrain_gpt_gpipe.sbatch", "pretrain_gpt_srun.sbatch"]


def test_sbatch_examples_use_rendezvous_from_scontrol():
    for name in ("pretrain_gpt_2bw.sbatch", "pretrain_gpt_gpipe.sbatch"):
        text = (SLURM_DIR / name).read_text()
        assert "scontrol show hostnames" in text and "--rdzv_endpoint" in text
        assert "--pipeline-schedule" in text
        # the first host by name (hostname --ip-address can be 127.0.1.1), the port from the
        # job id (the launcher's formula) unless MASTER_PORT is set
        assert "--ip-address" not in text and '--rdzv_endpoint "$head_node:$port"' in text
        assert "port=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}" in text
        assert D.slurm_port(123) == 20000 + 123 % 20000


@pytest.mark.parametrize("name", SCRIPTS)
def test_sbatch_examples_preempt_through_the_batch_shell_and_requeue(name):
    """USR1 to the batch shell (B:), requeue allowed, the step run by preemption.sh with USR1
    ignored by whatever srun starts (torchrun or python): tests/e2e/test_slurm_preemption.py
    runs them."""
    text = (SLURM_DIR / name).read_text()
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
    assert "source examples/slurm/preemption.sh" in text
    assert 'run_preemptible "$CKPT"' in text
    assert 'srun --kill-on-bad-exit=1 "${IGNORE_USR1[@]}" ' in text


def _script_args(text: str) -> list[str]:
    """The pretrain flags of a batch script's ARGS=(...), its VAR=${VAR:-default} variables at
    their defaults (SCHEDULE too), other shell words as `x`, "$@" empty."""
    import shlex
    defaults = dict(re.findall(r'^(\w+)=\$\{\1:-"?(.*?)"?\}$', text, re.M))
    block = re.search(r"^ARGS=\((.*?)\)$", text, re.S | re.M).group(1).replace("\\\n", " ")
    block = block.replace('"$@"', "")
    for _ in range(2):  # CKPT's default names SCHEDULE
        block = re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), "x"), block)
    return shlex.split(block)


@pytest.mark.parametrize("name", SCRIPTS)
def test_sbatch_examples_flags_parse_and_validate(name):
    """The pretrain flags of each SLURM example are real flags and a valid config for the
    allocation the script asks for (nodes x GPUs per node)."""
    from megatron_2bw.config.build import build_config
    from megatron_2bw.pretrain import build_parser
    text = (SLURM_DIR / name).read_text()
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
    gpus = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1))
    argv = _script_args(text)
    assert "pretrain_gpt.py \"${ARGS[@]}\"" in text and "--bf16" in argv
    args = build_parser("gpt").parse_args(argv)
    cfg = build_config(args, "gpt", nodes * gpus).config
    assert cfg.optimizer.adam_beta2 == 0.95 or "srun" in name
    assert cfg.train.save == cfg.train.load and cfg.train.train_iters in (100000, 20000)


def test_exit_duration_clock_is_the_process_start():
    """--exit-duration-in-mins counts from here (training/loop.py): when the OS says this
    process started, not when the training loop or this module began (the end-to-end check:
    tests/e2e/test_slurm_preemption.py::test_exit_duration_counts_from_process_start)."""
    import time

    import psutil

    from megatron_2bw.training import reliability
    started = reliability.process_start_time()
    assert abs(started - psutil.Process().create_time()) < 0.05
    assert started <= reliability._IMPORTED_AT <= time.time()


def test_master_port_0_with_several_ranks_is_refused_in_one_line():
    from megatron_2bw.config import ConfigError
    from megatron_2bw.parallel.launcher import check_rendezvous
    check_rendezvous(1, {"MASTER_PORT": "0"})  # one rank: no one to find it
    check_rendezvous(2, {"MASTER_PORT": "29500"})
    check_rendezvous(2, {})
    with pytest.raises(ConfigError, match=r"^MASTER_PORT=0 \(--master_port 0\): the other ranks "
                                          r"cannot find rank 0's port; give a free port"):
        check_rendezvous(2, {"MASTER_PORT": "0"})


@pytest.mark.parametrize("flag,local_rank", [("--local-rank=1", 1), ("--local_rank=0", 0),
                                             ("--local_rank=-1", 0)])
def test_local_rank_without_a_launcher_is_the_devices_index_as_in_megatron(clean_env, flag,
                                                                          local_rank):
    """(-1: older scripts' "not distributed", no device index)"""
    from megatron_2bw.pretrain import parse
    parsed = parse("gpt", ["--mock-data", "--train-iters", "1", flag])
    assert (parsed.rank, parsed.world_size, parsed.local_rank) == (0, 1, local_rank)


def test_skip_train_without_validation_data_is_refused_before_any_group(clean_env, capsys):
    from megatron_2bw.pretrain import parse
    with pytest.raises(SystemExit) as e:
        parse("gpt", ["--train-iters", "1", "--skip-train", "--split", "100,0,0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "--skip-train evaluates the validation data, and it is empty: give --split a "
        "validation part (or --valid-data-path)")
