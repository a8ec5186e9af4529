"""--num-workers in training (issue 34): the same losses, bitwise, with the data read in the main
process (0) and by two loader processes per data rank, also across a resume (d=2: both stages
read data; dropout on). A loader that started from the wrong microbatch fails it."""
import torch

from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.build import batches, mock_dataset
from megatron_2bw.training.loop import train
from megatron_2bw.training.spawn import spawn

BASE = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --pipeline-model-parallel-size 2 "
        "--hidden-dropout 0.1 --attention-dropout 0.1 --lr 3e-3 --log-interval 1 "
        "--train-iters 6").split()


def _worker(rank, world_size, runs, out):
    """The runs one after another in these processes (one process group: a spawn costs more
    than the training)."""
    grid = ProcessGrid.from_config(runs[0], rank, world_size).init_groups()
    dataset = mock_dataset(runs[0])
    for i, cfg in enumerate(runs):
        losses = train(cfg, grid, "cpu", log=lambda line: None,
                       make_data=lambda start: batches(cfg, dataset, grid.data, grid.dp_rank,
                                                       start))
        torch.save(losses, f"{out}.{i}.{rank}")


def test_two_loader_workers_read_what_the_main_process_reads_also_after_a_resume(tmp_path):
    ckpt = ["--num-workers", "2", "--save", str(tmp_path / "ckpt")]
    argvs = (["--num-workers", "0"], ckpt + ["--exit-interval", "3"],
             ckpt + ["--load", str(tmp_path / "ckpt")])
    runs = [build_config(build_parser("gpt").parse_args(BASE + a), "gpt", 2).config
            for a in argvs]
    spawn(_worker, 2, args=(runs, tmp_path / "losses"), timeout_minutes=1)
    full, first, rest = (torch.load(tmp_path / f"losses.{i}.1") for i in range(3))  # last stage
    assert len(full) == 6 and first == full[:3] and rest == full[3:], (full, first, rest)
