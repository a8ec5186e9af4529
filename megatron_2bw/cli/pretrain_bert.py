"""`m2bw-pretrain-bert` (installed), `python -m megatron_2bw.cli.pretrain_bert` or the checkout's
`pretrain_bert.py`: pretrain a BERT (megatron_2bw/pretrain.py). Under torchrun:
`torchrun --nproc_per_node 2 -m megatron_2bw.cli.pretrain_bert ...` or
`torchrun --nproc_per_node 2 $(which m2bw-pretrain-bert) ...`."""
import sys

from megatron_2bw.pretrain import main as _pretrain


def main(argv=None) -> int:
    return _pretrain("bert", argv)


if __name__ == "__main__":
    sys.exit(main())
