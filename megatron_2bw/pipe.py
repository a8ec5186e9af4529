"""`deepspeed.pipe` under its DeepSpeed name:
`from megatron_2bw.deepspeed.pipe import PipelineModule`.
The code lives in megatron_2bw/deepspeed/pipe/ (this name is what DeepSpeed scripts write)."""
from megatron_2bw.deepspeed.pipe import *  # noqa: F401,F403
from megatron_2bw.deepspeed.pipe import __all__  # noqa: F401
