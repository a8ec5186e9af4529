"""Megatron tensor parallelism: column/row-parallel linears, vocab-parallel embedding and
cross-entropy, the autograd mappings between them, and the RNG tracker for dropout."""
from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_2bw.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
        VocabParallelEmbedding, mark_sequence_parallel, set_partition_attrs)
from megatron_2bw.tensor_parallel.mappings import (TPGroup, copy_to_tp_region,
        gather_from_sequence_parallel_region, gather_from_tp_region, gather_linear,
        reduce_from_tp_region, reduce_output, reduce_scatter_to_sequence_parallel_region,
        scatter_to_sequence_parallel_region, scatter_to_tp_region)
from megatron_2bw.tensor_parallel.random import RNGTracker

__all__ = ["TPGroup", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "copy_to_tp_region", "reduce_from_tp_region",
           "scatter_to_tp_region", "gather_from_tp_region", "RNGTracker", "set_partition_attrs",
           "mark_sequence_parallel", "gather_linear", "reduce_output",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region"]
