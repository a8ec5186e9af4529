"""What the drop-in is to a DeepSpeed script: the DeepSpeed release whose API it follows
(`deepspeed.__version__`: the one its equality tests run against; the project's own version is in
setup.py) and the `deepspeed.*` module names it answers for under the opt-in alias (alias.py),
each with the module that is it here."""
DEEPSPEED_API_VERSION = "0.19.8"

# deepspeed.<name> -> the module that is it here
NAMES = {
    "pipe": "megatron_2bw.deepspeed.pipe",
    "utils": "megatron_2bw.deepspeed.utils",
    "runtime": "megatron_2bw.deepspeed.runtime",
    "runtime.utils": "megatron_2bw.deepspeed.runtime.utils",
    "runtime.pipe": "megatron_2bw.deepspeed.runtime.pipe",
    "runtime.pipe.schedule": "megatron_2bw.deepspeed.runtime.pipe.schedule",
    "runtime.pipe.topology": "megatron_2bw.deepspeed.runtime.pipe.topology",
    "runtime.pipe.module": "megatron_2bw.deepspeed.pipe.module",
    "accelerator": "megatron_2bw.deepspeed.accelerator",
    "checkpointing": "megatron_2bw.deepspeed.checkpointing",
    "comm": "megatron_2bw.deepspeed.comm",
}
