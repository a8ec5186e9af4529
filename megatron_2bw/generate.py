"""Sampling text from a checkpoint (any layout) or a HuggingFace directory (tools/generate.py).

    python tools/generate.py --load CHECKPOINT_OR_HF_DIR --prompt "def main(" --max-new-tokens 40
    python tools/generate.py --load DIR --prompt "..." --top-p 0.9 --temperature 0.8 --seed 7

Both kinds of directory become the one-process model through the converters (checkpoint/convert/: a
checkpoint is merged from its tensor shards and stages, newest weights under 2BW; a HuggingFace
GPT-2 or Llama directory is imported). The tokenizer is the one recorded with the checkpoint or
carried by the HuggingFace directory (checkpoint/convert/tokenizers.py), or --tokenizer-type/-model;
without one the prompt is space-separated token ids. Decoding recomputes the whole context every
step (no key/value cache): meant for looking at samples, not for serving. Greedy decoding picks the
most likely token (ties: the lowest id, as torch.argmax and HF's generate do); top-p samples
from the smallest set of tokens whose probability reaches p, after dividing logits by the
temperature. Generation stops after --max-new-tokens or at the tokenizer's end-of-document.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_2bw.checkpoint.convert.tokenizers import eod_or_none
from megatron_2bw.config import ConfigError
from megatron_2bw.config.flags import FlagParser, exit_on_config_error
from megatron_2bw.data.tokenizer import TOKENIZER_TYPES, NullTokenizer, build_tokenizer


def load(path: str, iteration: int | None = None):
    """(one-process model, tokenizer or None) of a checkpoint or a HuggingFace directory."""
    from megatron_2bw.checkpoint.convert.native import one_process_model, read_checkpoint
    from megatron_2bw.checkpoint.convert.tokenizers import recorded_tokenizer
    if os.path.isfile(os.path.join(path, "config.json")):
        from megatron_2bw.checkpoint.convert.hf import import_hf
        full = import_hf(path, divisible_by=1)
    else:
        full = read_checkpoint(path, iteration)
    return one_process_model(full), recorded_tokenizer(path), full.config.model


def next_token(logits: torch.Tensor, greedy: bool, top_p: float, temperature: float,
               generator: torch.Generator | None) -> int:
    """One token id from the last position's logits [vocab]."""
    if greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass of the tokens ranked above
    keep = before < top_p                                   # always keeps the first token
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    pick = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[pick])


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, greedy: bool = True,
             top_p: float = 1.0, temperature: float = 1.0, seed: int = 1234,
             vocab_limit: int | None = None, eod: int | None = None,
             max_context: int | None = None) -> list[int]:
    """The new token ids after `prompt` (at most max_new_tokens; stops after `eod`)."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = ids[-max_context:] if max_context else ids
        logits = model(torch.tensor([context]))[0, -1].float()
        token = next_token(logits[:vocab_limit], greedy, top_p, temperature, generator)
        ids.append(token)
        new.append(token)
        if eod is not None and token == eod:
            break
    return new


def build_parser() -> FlagParser:
    p = FlagParser(prog="generate.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="a checkpoint (--save) or HuggingFace directory")
    p.add_argument("--iteration", type=int, default=None, help="default: the newest")
    p.add_argument("--prompt", default="", help="text (token ids without a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="most likely token (the default)")
    p.add_argument("--top-p", type=float, default=None, help="sample from the top-p nucleus")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="default: the one recorded with the checkpoint")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="for the NullTokenizer")
    return p


def check(args: argparse.Namespace) -> None:
    if args.greedy and args.top_p is not None:
        raise ConfigError("--greedy and --top-p exclude each other: pick one way to decode")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not args.temperature > 0:
        raise ConfigError(f"--temperature must be > 0, got {args.temperature}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def prompt_ids(text: str, tokenizer, m) -> list[int]:
    """The prompt's ids, each within the model's vocabulary: the ids its tokenizer gives, below
    the rows of its embedding (m.vocab_size). Without a tokenizer, or with the NullTokenizer,
    the prompt is space-separated ids. One-line ConfigError with the real range otherwise."""
    if tokenizer is None or tokenizer.name == "NullTokenizer":
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            raise ConfigError(f"--prompt {text[:30]!r}: the checkpoint records no text tokenizer, "
                              "so the prompt is space-separated token ids; give ids, or "
                              "--tokenizer-type and --tokenizer-model") from None
    else:
        ids = tokenizer.tokenize(text)
    size = m.vocab_size if tokenizer is None else min(m.vocab_size, tokenizer.vocab_size)
    bad = next((i for i in ids if not 0 <= i < size), None)
    if bad is None:
        return ids
    if tokenizer is not None and tokenizer.vocab_size > m.vocab_size:
        raise ConfigError(f"the {tokenizer.name} gives ids up to {tokenizer.vocab_size - 1} "
                          f"(here {bad}) and the model's embedding has {m.vocab_size} rows: it "
                          "is not the tokenizer the model was trained with; drop "
                          "--tokenizer-type/--tokenizer-model to use the recorded one")
    where = (f"the {tokenizer.name}'s {size} ids" if tokenizer is not None and
             size < m.vocab_size else f"the {m.vocab_size} rows of its embedding")
    raise ConfigError(f"prompt token id {bad} is outside the model's vocabulary, ids 0-{size - 1} "
                      f"({where}): give ids below {size}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def prepare():
        check(args)
        model, tokenizer, m = load(args.load, args.iteration)
        if args.tokenizer_type or args.tokenizer_model:
            tokenizer = build_tokenizer(args.tokenizer_type or "GPTSentencePieceTokenizer",
                                        args.tokenizer_model, args.vocab_size)
        prompt = prompt_ids(args.prompt, tokenizer, m)
        if not prompt:
            if eod_or_none(tokenizer) is None:
                raise ConfigError("--prompt is empty and the tokenizer has no end-of-document "
                                  "token to start from: give a prompt")
            prompt = [eod_or_none(tokenizer)]
        return model, tokenizer, m, prompt

    model, tokenizer, m, prompt = exit_on_config_error(prepare)
    limit = min(tokenizer.vocab_size, m.vocab_size) if tokenizer is not None else m.vocab_size
    new = generate(model, prompt, args.max_new_tokens, greedy=args.top_p is None,
                   top_p=args.top_p or 1.0, temperature=args.temperature, seed=args.seed,
                   vocab_limit=limit, eod=eod_or_none(tokenizer),
                   max_context=m.max_positions if m.position_embedding_type ==
                   "learned_absolute" else None)
    text = (tokenizer or NullTokenizer(m.vocab_size)).detokenize(prompt + new)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
