"""DeepSpeed's pipeline-model API (`deepspeed.pipe`), trained by the 2BW engine.

    from megatron_2bw.deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec
"""
from megatron_2bw.deepspeed.pipe.module import (LayerSpec, PipelineError, PipelineModule,
        TiedLayerSpec)
from megatron_2bw.models.partition import partition_balanced, partition_uniform
from megatron_2bw.deepspeed.pipe.partition import partition_layers
from megatron_2bw.deepspeed.pipe.topology import (PipeDataParallelTopology,
        PipeModelDataParallelTopology, ProcessTopology)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipelineError", "PipelineModule", "ProcessTopology", "TiedLayerSpec",
           "partition_balanced", "partition_layers", "partition_uniform"]
