"""DeepSpeed's pipeline-model API (`deepspeed.pipe`), trained by the 2BW engine.

    from megatron_2bw.pipe import PipelineModule, LayerSpec, TiedLayerSpec
"""
from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from .partition import partition_balanced, partition_layers, partition_uniform
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipelineError", "PipelineModule", "ProcessTopology", "TiedLayerSpec",
           "partition_balanced", "partition_layers", "partition_uniform"]
