"""What the benches that time named shapes in interleaved rounds share (grad_accumulation.py,
grad_reduce.py): their options, the shapes' specs, the paired rows and the main loop."""
from __future__ import annotations

import _common as C


def add_round_args(p, shapes: dict, repeats: int = 7) -> None:
    """The options of a bench that times named shapes in interleaved rounds (grad_accumulation.py,
    grad_reduce.py): --shapes, --warmup-batches, --batches, --repeats, --timeout, --json, --tiny."""
    p.add_argument("--shapes", default=",".join(shapes),
                   help=f"comma-separated subset of {','.join(shapes)}")
    p.add_argument("--warmup-batches", type=int, default=2)
    p.add_argument("--batches", type=int, default=4, help="timed batches per round")
    p.add_argument("--repeats", type=int, default=repeats, help="interleaved rounds")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")


def chosen(p, text: str, known, what: str) -> list:
    """The comma-separated names of `text`, each one of `known` (else the parser's error)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in known]
    if bad:
        p.error(f"unknown {what}(s) {', '.join(bad)}: use {', '.join(known)}")
    return names


def round_spec(shape: dict, args, tiny: dict) -> dict:
    """A shape's spec with the rounds' settings (`tiny` replaces what --tiny shrinks)."""
    spec = dict(shape, warmup=args.warmup_batches, batches=args.batches, repeats=args.repeats)
    if args.tiny:
        spec.update(tiny, warmup=1, batches=1, repeats=2)
    return spec


def samples_per_s(times: dict, samples: int) -> dict:
    """{name: {"samples_per_s_runs", "samples_per_s" (median)}} of {name: [seconds per round]}."""
    out = {n: {"samples_per_s_runs": [samples / t for t in ts]} for n, ts in times.items()}
    for e in out.values():
        e["samples_per_s"] = C.median(e["samples_per_s_runs"])
    return out


def paired_row(out: dict, losses: dict, a: str, b: str) -> dict:
    """Run a against run b: the paired ratio, its interval, whether their losses are equal."""
    return {"ratio": C.paired(out, a, b), "interval": C.paired_interval(out, a, b),
            "losses_equal": losses[a] == losses[b]}


def run_shapes(script: str, args, shapes: dict, tiny: dict, measure) -> int:
    """Print the header, then for each of `args.shape_names` its spec (`round_spec`) measured
    and summarized by `measure(shape, spec) -> (summary, text, ok)`; write `--json`; 0 when
    every shape was ok."""
    print(f"# {script}  {C.stamp()}\n# {C.command_line()}", flush=True)
    results, ok = {}, True
    for shape in args.shape_names:
        results[shape], text, good = measure(shape, round_spec(shapes[shape], args, tiny))
        ok = ok and good
        print(text, flush=True)
    if args.json:
        C.write_json(args.json, {"date": C.stamp(), "command": C.command_line(),
                                 "results": results})
    return 0 if ok else 1
