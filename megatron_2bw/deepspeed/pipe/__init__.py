"""DeepSpeed's pipeline-model API (`deepspeed.pipe`), trained by the 2BW engine.

    from megatron_2bw.deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec

Owns: `PipelineModule`, `LayerSpec`, `TiedLayerSpec` (module.py), placing a layer list on stages
with DeepSpeed's methods (partition.py, over models/partition.py), DeepSpeed's process
topologies (topology.py) and the module as a view of the engine's newest weights
(engine_view.py). `megatron_2bw.pipe` is this package under DeepSpeed's name.
Must not import: schedule, pipeline, tensor_parallel, optim, data, checkpoint, training, planner,
testing, pretrain, generate.
"""
from megatron_2bw.deepspeed.pipe.module import (LayerSpec, PipelineError, PipelineModule,
                                                TiedLayerSpec)
from megatron_2bw.deepspeed.pipe.partition import partition_layers
from megatron_2bw.deepspeed.pipe.topology import (PipeDataParallelTopology,
                                                  PipeModelDataParallelTopology, ProcessTopology)
from megatron_2bw.models.partition import partition_balanced, partition_uniform

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipelineError", "PipelineModule", "ProcessTopology", "TiedLayerSpec",
           "partition_balanced", "partition_layers", "partition_uniform"]
