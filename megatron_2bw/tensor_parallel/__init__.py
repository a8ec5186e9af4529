"""Megatron tensor parallelism: column/row-parallel linears, vocab-parallel embedding and
cross-entropy, the autograd mappings between them, and the RNG tracker for dropout.

Owns: the parallel layers (layers.py), the four mappings and their sequence-parallel forms
(mappings.py, over `TPGroup`, whose collectives go through parallel.comm), vocab-parallel
cross-entropy (cross_entropy.py), dropout RNG per tensor rank (random.py), drawing one shard of a
full initialization (initialize.py) and splitting / merging full tensors (shards.py).
Must not import: config, schedule, pipeline, models, optim, data, checkpoint, training, planner,
deepspeed, testing, pretrain, generate.
"""
from megatron_2bw.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_2bw.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                 VocabParallelEmbedding, mark_sequence_parallel,
                                                 set_partition_attrs)
from megatron_2bw.tensor_parallel.mappings import (TPGroup, copy_to_tp_region,
                                                   gather_from_sequence_parallel_region,
                                                   gather_from_tp_region, gather_linear,
                                                   reduce_from_tp_region, reduce_output,
                                                   reduce_scatter_to_sequence_parallel_region,
                                                   scatter_to_sequence_parallel_region,
                                                   scatter_to_tp_region)
from megatron_2bw.tensor_parallel.random import RNGTracker

__all__ = ["TPGroup", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "copy_to_tp_region", "reduce_from_tp_region",
           "scatter_to_tp_region", "gather_from_tp_region", "RNGTracker", "set_partition_attrs",
           "mark_sequence_parallel", "gather_linear", "reduce_output",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region"]
