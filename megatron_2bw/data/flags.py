"""Megatron's data and tokenizer flags. `--seq-length` and `--vocab-size` are model flags
(megatron_2bw/config/flags.py); of the tokenizers, `--vocab-size` is read by the NullTokenizer
and the TikTokenizer."""
from __future__ import annotations

import argparse

from megatron_2bw.data.bert_dataset import PAIR_TASKS
from megatron_2bw.data.tokenizer import TOKENIZER_TYPES


def add_tokenizer_args(g, default_type: str | None, type_help: str) -> None:
    """Megatron's tokenizer flags (same names, defaults and meaning); pretrain_*.py and
    tools/preprocess_data.py share them. `--vocab-size` is the caller's."""
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=default_type,
                   help=type_help)
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece FILE.model (SentencePieceTokenizer, "
                        "GPTSentencePieceTokenizer, Llama2Tokenizer), a local directory "
                        "(HuggingFaceTokenizer) or a tiktoken vocabulary .json (TikTokenizer)")
    g.add_argument("--vocab-file", default=None,
                   help="GPT2BPETokenizer: vocab.json; BertWordPiece*: vocab.txt")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-extra-ids", type=int, default=0,
                   help="add <extra_id_0..N-1> (BertWordPiece*, SentencePieceTokenizer)")
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None,
                   help="TikTokenizer: the pre-tokenization pattern (required)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids 0..N-1 are special tokens, the vocabulary's from N")
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                   help="TikTokenizer: the first special tokens (default <unk> <s> </s>)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="HuggingFaceTokenizer: let transformers run the directory's code")


def add_data_args(p: argparse.ArgumentParser, family: str = "gpt") -> None:
    """The data flags; BERT's masking / pair flags only when family == "bert"."""
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="PREFIX of PREFIX.bin/.idx, or a blend: WEIGHT PREFIX WEIGHT PREFIX ... "
                        "(default: the embedded corpus of Python's help topics)")
    g.add_argument("--split", default="969, 30, 1",
                   help="train,valid,test weights over the documents of each prefix")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"the {split} split's own data, all of it (as --data-path; "
                            "Megatron's: instead of --data-path and --split)"
                            + ("; checked, not evaluated: no test evaluation here"
                               if split == "test" else ""))
    g.add_argument("--mock-data", action="store_true",
                   help="train on deterministic synthetic sequences")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset indices are cached (default: beside the data)")
    g.add_argument("--num-workers", type=int, default=None,
                   help="data loader worker processes per rank that reads data (0: read in "
                        "the main process; the samples are the same for every N; default: 2 "
                        "where CUDA is, as Megatron, else 0: on CPUs the ranks' math uses "
                        "the cores)")
    add_tokenizer_args(g, default_type=None,
                       type_help="default: GPT2BPETokenizer with --vocab-file and --merge-file, "
                                 "BertWordPieceLowerCase with --vocab-file alone, else "
                                 "GPTSentencePieceTokenizer for GPT, SentencePieceTokenizer "
                                 "for BERT")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x tensor-parallel size")
    if family != "bert":
        return
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="probability of a sample shorter than --seq-length")
    g.add_argument("--mask-prob", type=float, default=0.15,
                   help="fraction of tokens to predict (80%% [MASK], 10%% random, 10%% kept)")
    g.add_argument("--bert-no-binary-head", action="store_true",
                   help="no next-sentence / sentence-order head (single segments)")
    g.add_argument("--sentence-pair-task", choices=PAIR_TASKS, default="sop",
                   help="binary head label: sentence order (Megatron's) or next sentence")
