"""Rank/world detection from launcher environments (torchrun, SLURM srun, MPI)."""
import pytest

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
    assert D.env_rank_world() == (0, 1, 0)


def test_torchrun_variables_win(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "2")
    assert D.env_rank_world() == (3, 8, 1)


def test_plain_srun(clean_env):
    clean_env.setenv("SLURM_PROCID", "9")
    clean_env.setenv("SLURM_NTASKS", "16")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_JOB_NODELIST", "gpu[007-008],cpu1")
    clean_env.setenv("SLURM_JOB_ID", "123456")
    assert D.env_rank_world() == (9, 16, 1)
    D.slurm_rendezvous()
    import os
    assert os.environ["MASTER_ADDR"] == "gpu007"
    assert os.environ["MASTER_PORT"] == str(20000 + 123456 % 20000)


def test_mpi(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "2")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "4")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert D.env_rank_world() == (2, 4, 0)


def test_mpich_pmi_is_read_by_the_one_list_both_front_doors_ask(clean_env):
    """MPICH / Intel MPI (PMI_*): pretrain's env_rank_world and DeepSpeed's init_distributed
    (discover_env) read the same LAUNCHER_VARS."""
    clean_env.setenv("PMI_RANK", "5")
    clean_env.setenv("PMI_SIZE", "6")
    clean_env.setenv("MPI_LOCALRANKID", "1")
    assert D.launched() and D.env_rank_world() == (5, 6, 1)
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
])
def test_expand_nodelist_like_scontrol(nodelist, hosts):
    assert D.expand_nodelist(nodelist) == hosts


def test_sbatch_examples_use_rendezvous_from_scontrol():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "examples" / "slurm"
    for name in ("pretrain_gpt_2bw.sbatch", "pretrain_gpt_gpipe.sbatch"):
        text = (root / name).read_text()
        assert "scontrol show hostnames" in text and "--rdzv_endpoint" in text
        assert "--pipeline-schedule" in text


@pytest.mark.parametrize("name", ["pretrain_gpt_2bw.sbatch", "pretrain_gpt_gpipe.sbatch",
                                  "pretrain_gpt_srun.sbatch"])
def test_sbatch_examples_flags_parse_and_validate(name):
    """The pretrain flags of each SLURM example are real flags and a valid config for the
    allocation the script asks for (nodes x GPUs per node)."""
    import re
    import shlex
    from pathlib import Path

    from megatron_2bw.config.build import build_config
    from megatron_2bw.pretrain import build_parser
    text = (Path(__file__).resolve().parents[2] / "examples" / "slurm" / name).read_text()
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
    gpus = int(re.search(r"#SBATCH --gpus-per-node=(\d+)", text).group(1))
    command = text[text.index("pretrain_gpt.py") + len("pretrain_gpt.py"):].replace("\\\n", " ")
    command = command.splitlines()[0].replace("$SCHEDULE", "2bw")
    command = re.sub(r"\$\{?\w+\}?", "x", command)  # other shell variables: any word
    args = build_parser("gpt").parse_args(shlex.split(command))
    cfg = build_config(args, "gpt", nodes * gpus).config
    assert cfg.optimizer.adam_beta2 == 0.95 or "srun" in name
