"""Training data: files, tokenizers, datasets and reading ahead; every bad input is a one-line
`DataError` (a ConfigError) before any process group.

Owns: Megatron's mmap indexed dataset (indexed_dataset.py: PREFIX.bin + PREFIX.idx), JSONL
preprocessing (preprocess.py), Megatron-LM's tokenizer types (tokenizer.py: build_tokenizer and the
sentencepiece ones; tokenizer_base.py, tokenizer_gpt2.py, tokenizer_wordpiece.py,
tokenizer_tiktoken.py, tokenizer_hf.py), the GPT, BERT and blended datasets
(gpt_dataset.py, bert_dataset.py, blended_dataset.py), mock data (mock.py, bert_mock.py), the
embedded default corpus (default_corpus.py), index caches built once per node (cache.py), the
data/tokenizer check (consistency.py), the data flags (flags.py), the pretrain entry points
(build.py) and the --num-workers loader processes (prefetch.py).
Must not import: schedule, pipeline, models, tensor_parallel, optim, checkpoint, training, planner,
deepspeed, testing, pretrain, generate.
"""
