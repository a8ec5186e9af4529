"""`m2bw-pretrain-gpt` (installed), `python -m megatron_2bw.cli.pretrain_gpt` or the checkout's
`pretrain_gpt.py`: pretrain a GPT (megatron_2bw/pretrain.py). Under torchrun:
`torchrun --nproc_per_node 2 -m megatron_2bw.cli.pretrain_gpt ...` or
`torchrun --nproc_per_node 2 $(which m2bw-pretrain-gpt) ...`."""
import sys

from megatron_2bw.pretrain import main as _pretrain


def main(argv=None) -> int:
    return _pretrain("gpt", argv)


if __name__ == "__main__":
    sys.exit(main())
