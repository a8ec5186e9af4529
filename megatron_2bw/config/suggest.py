"""The did-you-mean of an unknown flag: a suggestion only where it is plausibly the flag meant.

    closest_flag("--num-layerz", parser_flags)   # "--num-layers"
    closest_flag("--zero-stage", parser_flags)   # None where no flag of that vocabulary exists

difflib's closest names, kept only when each of the typed flag's words is close to one of the
candidate's (one word of a flag of three or more may go unmatched): a flag of another
vocabulary gets no suggestion rather than a misleading one.
"""
from __future__ import annotations

import difflib


def _words(flag: str) -> list[str]:
    return [w for w in flag.lstrip("-").replace("_", "-").split("-") if w]


def closest_flag(flag: str, valid) -> str | None:
    """The valid flag (of `valid`) a typo most likely meant, or None (module docstring)."""
    typed = _words(flag)

    def close(a: str, b: str) -> bool:
        return a == b or (min(len(a), len(b)) >= 3
                          and difflib.SequenceMatcher(None, a, b).ratio() >= 0.75)

    def plausible(candidate: str) -> bool:
        words = _words(candidate)
        missing = sum(not any(close(t, w) for w in words) for t in typed)
        return missing <= (1 if len(typed) >= 3 else 0)

    names = {"--" + "-".join(_words(v)): v for v in valid if v.startswith("--")}
    matches = difflib.get_close_matches("--" + "-".join(typed), list(names), n=10, cutoff=0.6)
    return next((names[m] for m in matches if plausible(m)), None)
