"""Checkpoint conversion: readers and writers around one full model.

    reader (any layout or format)  ->  FullModel (config + full fp32 tensors by name)  ->  writer

`native.py` reads and writes this project's checkpoints (any t, d, schedule); `hf.py` reads and
writes HuggingFace model directories (GPT2LMHeadModel, LlamaForCausalLM) through the name and
layout mapping of `hf_mapping.py`. A new format adds a reader and a writer, nothing else.
`tools/checkpoint_convert.py` is the command line; `tools/generate.py` samples from either side.

Owns: `FullModel` and the readers/writers around it (native.py, hf.py, hf_mapping.py,
hf_import.py), torch -> torch_dist (to_dist.py), ours -> megatron-core (to_megatron.py), the tokenizer kept with checkpoints
(tokenizers.py) and tools/checkpoint_convert.py (cli.py).
Must not import: planner, deepspeed, testing, pretrain, generate.
"""
