#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron mmap indexed datasets (byte-compatible with Megatron-LM).

  python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
      --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model \
      --append-eod --workers 4

Megatron-LM's tokenizer flags: --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json
--merge-file merges.txt; BertWordPieceLowerCase/Case --vocab-file vocab.txt; Llama2Tokenizer
--tokenizer-model tok.model; HuggingFaceTokenizer --tokenizer-model DIR; TikTokenizer
--tokenizer-model vocab.json --tiktoken-pattern v2 [--vocab-size N
--tiktoken-num-special-tokens K]; NullTokenizer --vocab-size N.

writes data/corpus_text_document.bin/.idx (one per --json-keys key; `_sentence` with
--split-sentences, for BERT). Train on it with `--data-path data/corpus_text_document`.
"""
import os
import sys


from megatron_2bw.config.numbers import FiniteParser
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.preprocess import preprocess_jsonl
from megatron_2bw.data.flags import add_tokenizer_args
from megatron_2bw.data.tokenizer import tokenizer_options


def parse(argv=None):
    p = FiniteParser(prog="preprocess_data.py", description=__doc__.split("\n")[0],
                     allow_abbrev=False)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="JSONL file: one JSON document per line")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each JSON line")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (BERT); otherwise one per document")
    g = p.add_argument_group("tokenizer")
    add_tokenizer_args(g, "GPTSentencePieceTokenizer", "Megatron-LM's tokenizer types "
                       "(default GPTSentencePieceTokenizer)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: the ids; TikTokenizer: the vocabulary (default 2^17)")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_{document|sentence}.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="update the progress line every this many documents")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.workers < 1:
        print("error: --workers must be >= 1", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        print(f"error: {out_dir}: --output-prefix directory does not exist: create it",
              file=sys.stderr)
        return 2
    try:
        outs = preprocess_jsonl(args.input, args.output_prefix, args.json_keys,
                                args.tokenizer_type, args.tokenizer_model, args.vocab_size,
                                args.split_sentences, args.append_eod, args.workers,
                                args.log_interval, tokenizer_options=tokenizer_options(args))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for key, prefix in outs.items():
        print(f"{key}: {prefix}.bin / {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
