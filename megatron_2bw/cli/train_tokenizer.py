#!/usr/bin/env python
"""Train a sentencepiece tokenizer on text or JSONL, for --tokenizer-model.

  python tools/train_tokenizer.py --input corpus.jsonl --model-prefix tok --vocab-size 8000
  python tools/train_tokenizer.py --input a.txt b.txt --model-prefix tok --model-type bpe

Plain text: every non-empty line is a training sentence. JSONL (.jsonl/.json, or --json-keys):
the lines of each document's --json-keys values. Writes {model-prefix}.model with ids unk 0,
bos 1, eos 2 (GPT's end of document), pad 3.
"""
import os
import sys


from megatron_2bw.config.numbers import FiniteParser
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.preprocess import document_texts, numbered_lines
from megatron_2bw.data.tokenizer import train_sentencepiece


def parse(argv=None):
    p = FiniteParser(prog="train_tokenizer.py", description=__doc__.split("\n")[0],
                     allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    p.add_argument("--json-keys", nargs="+", default=None,
                   help="read the inputs as JSONL and take these keys (default: text, for "
                        ".jsonl/.json files)")
    p.add_argument("--model-prefix", "--output-prefix", dest="model_prefix", required=True,
                   help="writes PREFIX.model (--output-prefix, as in preprocess_data.py, is the "
                        "same flag)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--no-byte-fallback", action="store_false", dest="byte_fallback",
                   help="map unknown characters to <unk> instead of byte pieces")
    p.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="at most this many sentences are sampled for training")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="sentencepiece trainer threads")
    args = p.parse_args(argv)
    # sentencepiece's own ranges, refused before the input is read (its errors are its code's)
    for flag, value, ok, rule in (
            ("--vocab-size", args.vocab_size, args.vocab_size >= 1, ">= 1"),
            ("--character-coverage", args.character_coverage,
             0.98 <= args.character_coverage <= 1, "in [0.98, 1] (sentencepiece's range)"),
            ("--workers", args.workers, 1 <= args.workers <= 1024, "in 1..1024"),
            ("--input-sentence-size", args.input_sentence_size, args.input_sentence_size >= 0,
             ">= 0 (0: every sentence)")):
        if not ok:
            p.error(f"{flag} {value}: must be {rule}")
    out_dir = os.path.dirname(os.path.abspath(args.model_prefix))
    if not os.path.isdir(out_dir):
        p.error(f"--model-prefix {args.model_prefix}: {out_dir} is not a directory: create it")
    return args


def sentences(paths, json_keys):
    for path in paths:
        as_json = json_keys is not None or path.endswith((".jsonl", ".json"))
        keys = json_keys or ["text"]
        for lineno, line in numbered_lines(path):
            if not as_json:
                yield line.strip()
                continue
            try:
                texts = document_texts(line, lineno, keys)
            except DataError as e:
                raise DataError(f"{path}: {e}") from None
            for text in texts.values():
                yield from (s.strip() for s in text.splitlines() if s.strip())


def main(argv=None) -> int:
    args = parse(argv)
    model = args.model_prefix + ".model"
    try:
        lines = list(sentences(args.input, args.json_keys))
        if not lines:
            raise DataError(f"{args.input[0]}: no text to train on (empty input)")
        train_sentencepiece(lines, model, args.vocab_size, args.model_type,
                            num_threads=args.workers, character_coverage=args.character_coverage,
                            byte_fallback=args.byte_fallback,
                            input_sentence_size=args.input_sentence_size,
                            shuffle_input_sentence=True)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {model} ({args.vocab_size} pieces, {args.model_type}) from {len(lines)} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
