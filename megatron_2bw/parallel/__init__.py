from megatron_2bw.parallel.grid import ProcessGrid

__all__ = ["ProcessGrid"]
