"""Every fix a refusal suggests is itself accepted (DESIGN.md section 5): the flags each refusal
names after its "use ...", "give ...", "add ..." part, with the values it names (a sample value
where it names a placeholder: N, DIR, {uniform,block}), parse on pretrain_gpt.py's (or
pretrain_bert.py's; tools/plan.py's for the planner's machine flags) command line without a
refusal. The refusals are compat.py's tables (its
retired flags, what to do instead of each missing feature, Megatron-DeepSpeed's included) and
every error message of the packages a pretrain run reaches, read from their source (the string
constants of ConfigError(...), fail(...), DataError(...), ... calls and of the parser's
one-message refusals)."""
import argparse
import ast
import re
from pathlib import Path

import pytest

from megatron_2bw.config.compat import INSTEAD, RETIRED
from megatron_2bw.planner.cli import build_parser as plan_parser
from megatron_2bw.pretrain import build_parser

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_2bw"
SCOPE = ("config/", "data/", "pretrain.py", "parallel/", "checkpoint/", "planner/",
         "training/", "pipeline/", "models/", "optim/", "schedule/", "tensor_parallel/")
NOT_PRETRAIN = ("checkpoint/convert/", "planner/cli.py")  # tools' own errors
FIX = re.compile(r"(?:^|[\s:;,(])(use|give|add|pass|raise|set|train in|launch with|choose|try)"
                 r"\s")
PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_.,]*|\{\}|\{.*\}|N\d*|X|DIR|PATH|FILE.*|B0.*|"
                         r"START|INCREMENT|SAMPLES|VALUE|K|M)$")
LAUNCHED = re.compile(r"\b(torchrun|deepspeed|srun|mpirun)\b.*")
SAMPLES = {"--rampup-batch-size": ["1", "1", "10"], "--pipeline-partition": ["0,2,4"],
           "--step-batch-size-schedule": ["0:1"]}


def _text(node) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _text(node.left), _text(node.right)
        return None if a is None and b is None else (a or "{}") + (b or "{}")
    return None


def error_messages() -> list[tuple[str, str]]:
    """(module, message) of every error raised, or refusal listed, with a flag in it."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if not where.startswith(SCOPE) or where.startswith(NOT_PRETRAIN):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None) or ""
            listed = name == "append" and getattr(node.func.value, "id", "") in ("out",)
            if name.endswith("Error") or name in ("fail", "_fail", "SystemExit") or listed:
                out += [(where, t) for t in map(_text, node.args) if t and "--" in t]
    return out


def table_messages() -> list[tuple[str, str]]:
    return ([("compat.RETIRED", fix) for fix in RETIRED.values()]
            + [("compat.INSTEAD", fix) for fix in INSTEAD.values()])


def suggested(message: str) -> list[list[str]]:
    """The fixes a message suggests: after its first "use"/"give"/... each alternative's flags,
    with the values named (or a sample for a placeholder)."""
    m = FIX.search(message)
    if not m:
        return []
    fixes = []
    for part in re.split(r"\bor\b|[();]|, |\binstead of\b.*", message[m.start():]):
        part = LAUNCHED.sub("", part)  # a launcher's own flags (torchrun --standalone)
        words = part.replace("/--", " --").split()  # --a/--b: both
        flags = [i for i, w in enumerate(words) if re.match(r"^--[a-zA-Z0-9]", w)]
        if flags:
            fixes.append([(w.rstrip(".,:'\""), words[i + 1:i + 4]) for i, w in
                          ((i, words[i]) for i in flags)])
    return fixes


def _argv(fix, parser) -> list[str] | None:
    argv = []
    for flag, after in fix:
        action = parser._option_string_actions.get(flag)
        if action is None:
            return None
        argv.append(flag)
        if action.nargs == 0:
            continue
        if flag in SAMPLES:
            argv += SAMPLES[flag]
            continue
        value = after[0].rstrip(".,:;)'\"") if after else ""
        if not value or value.startswith("--") or PLACEHOLDER.match(value) or not _valid(
                action, value):
            value = _sample(action)
        argv += [value] * (action.nargs if isinstance(action.nargs, int) else 1)
    return argv


def _valid(action, value) -> bool:
    try:
        typed = action.type(value) if action.type else value
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return not action.choices or typed in action.choices


def _sample(action) -> str:
    if action.choices:
        return str(list(action.choices)[0])
    return {int: "1", float: "0.5"}.get(action.type, "x")


PARSERS = {"gpt": lambda: build_parser("gpt"), "bert": lambda: build_parser("bert"),
           "tools/plan.py": plan_parser}
PREFIX = {"gpt": ["--mock-data"], "bert": ["--mock-data"], "tools/plan.py": []}
MESSAGES = table_messages() + error_messages()


def test_the_scan_reads_the_refusals():
    """The scan finds what it should (not an empty list that passes)."""
    assert len(MESSAGES) > 150
    fixes = [f for _, m in MESSAGES for f in suggested(m)]
    assert len(fixes) > 50
    assert [("--recompute-granularity", ["full", "--recompute-method", "uniform"]),
            ("--recompute-method", ["uniform", "(what", "it"])] not in fixes  # retired: gone
    assert suggested("--zero-stage 2: ... use --zero-stage 1 (the distributed optimizer)") == \
        [[("--zero-stage", ["1"])]]


@pytest.mark.parametrize("where,message", MESSAGES, ids=[f"{w}:{m[:60]}" for w, m in MESSAGES])
def test_every_suggested_fix_is_accepted_by_the_parser(where, message, capsys):
    for fix in suggested(message):
        accepted = []
        for family, make in PARSERS.items():
            argv = _argv(fix, make())
            if argv is None:
                continue
            try:
                make().parse_args(PREFIX[family] + argv)
            except SystemExit:
                pytest.fail(f"{where}: the fix {' '.join(argv)} of {message!r} is refused: "
                            f"{capsys.readouterr().err.strip()}")
            accepted.append(family)
        assert accepted, f"{where}: {message!r} suggests {[f for f, _ in fix]}, not a flag of " \
                         "pretrain_gpt.py or pretrain_bert.py"
