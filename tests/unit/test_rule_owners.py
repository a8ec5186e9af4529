"""One owner per rule: the schedule kinds (megatron_2bw/schedule/kinds.py) own the schedule
names, the version-slot rule and the minimum number of microbatches; everything else asks them.

An AST scan of the package, tools/, bench/, examples/ and the entry points fails on:

- name-compare  a schedule name compared with anything (`schedule == "2bw"`, `"ours-2bw" in
                names`): a rule keyed on a name instead of a question to the kind;
- name-list     two or more schedule names in one tuple/list/set/dict literal or one
                comma-separated string (`("2bw", "flush", "gpipe")`, `"2bw,flush,gpipe"`);
- slot-rule     `X % 2` on a batch, iteration or microbatch index (`(k // m) % 2`, `t % 2`);
- min-mb        an order comparison of a microbatch count with a stage count (`m < d`,
                `args.num_microbatches < args.pipeline_stages`).

A name as a plain value (an argument, a default, a constant's value) is allowed: that is asking
for a schedule, not restating one. `test_the_scanner_finds_todays_duplicates` feeds the scanner
the duplicates this codebase had before the registry, verbatim, and a few look-alikes it must
leave alone.
"""
import ast
import os
import re

from megatron_2bw.schedule.kinds import schedule_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWNER = os.path.join("megatron_2bw", "schedule", "kinds.py")
SCANNED = ("megatron_2bw", "tools", "bench", "examples")
NAMES = set(schedule_names())
INDEXES = {"t", "t0", "k", "mb", "batch", "iteration", "step", "version"}
MICROBATCHES = {"m", "mbs", "num_microbatches", "micro_batches", "gas",
                "gradient_accumulation_steps", "accumulation"}
STAGES = {"d", "pipeline", "pipeline_stages", "num_stages", "stages"}
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _names_in(node) -> set:
    """What an expression is made of: names, attribute names (`cfg.m` is `m`, not `cfg`) and
    constant subscript keys (`spec["d"]` is `d`)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return {node.slice.value} if isinstance(node.slice.value, str) else set()
    if isinstance(node, ast.Call):  # a question to something: not a rule
        return set()
    return set().union(set(), *(_names_in(c) for c in ast.iter_child_nodes(node)))


def _strings(node) -> list:
    return [n.value for n in ast.walk(node)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _names_among(values) -> set:
    return {v for v in values if isinstance(v, str) and v in NAMES}


def scan(source: str, path: str = "<snippet>") -> list:
    """[(path, line, rule)] for every restated schedule rule in `source`."""
    found = []
    tree = ast.parse(source)
    exports = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assign)
               and any(getattr(t, "id", None) == "__all__" for t in a.targets)
               for n in ast.walk(a.value)}  # __all__ lists identifiers, not schedule names
    for node in ast.walk(tree):
        hit = None
        if id(node) in exports:
            continue
        if isinstance(node, ast.Compare):
            tokens = {t for s in _strings(node) for t in re.split(r"[^0-9A-Za-z]+", s)}
            if tokens & NAMES:
                hit = "name-compare"
            elif any(isinstance(op, ORDER) for op in node.ops):
                sides = [_names_in(x) for x in [node.left] + node.comparators]
                if any(a & MICROBATCHES and b & STAGES
                       for i, a in enumerate(sides) for j, b in enumerate(sides) if i != j):
                    hit = "min-mb"
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elts = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            hit = "name-list" if len(_names_among(elts)) >= 2 else None
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            hit = "name-list" if len(_names_among(keys)) >= 2 else None
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts = [p.strip() for p in node.value.split(",")]
            if len(parts) >= 2 and len(_names_among(parts)) >= 2 and set(parts) <= NAMES:
                hit = "name-list"
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) \
                and isinstance(node.right, ast.Constant) and node.right.value == 2 \
                and _names_in(node.left) & INDEXES:
            hit = "slot-rule"
        if hit:
            found.append((path, node.lineno, hit))
    return found


def _sources():
    for top in SCANNED:
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if not x.startswith((".", "__"))]
            for f in files:
                if f.endswith(".py"):
                    yield os.path.relpath(os.path.join(d, f), ROOT)
    for f in os.listdir(ROOT):
        if f.endswith(".py"):
            yield f


def test_no_schedule_rule_is_defined_outside_the_registry():
    paths = [p for p in _sources() if p != OWNER]
    assert len(paths) > 50 and os.path.join("megatron_2bw", "config", "schema.py") in paths
    found = []
    for path in paths:
        with open(os.path.join(ROOT, path)) as f:
            found += scan(f.read(), path)
    assert not found, "schedule rules restated outside schedule/kinds.py (ask the kind): " + \
        "; ".join(f"{p}:{line} {rule}" for p, line, rule in found)


def test_each_name_is_spelled_once_in_its_kind():
    with open(os.path.join(ROOT, OWNER)) as f:
        spelled = _strings(ast.parse(f.read()))
    assert NAMES == {"2bw", "flush", "gpipe"}
    assert {name: spelled.count(name) for name in NAMES} == {name: 1 for name in NAMES}


# today's duplicates, as they stood before the registry (one per site), and what each must raise
BEFORE = [
    ('SCHEDULES = ("2bw", "flush", "gpipe")', "name-list"),                     # config.py
    ('g.add_argument("--pipeline-schedule", choices=("2bw", "flush", "gpipe"))', "name-list"),
    ('KINDS = ("gpipe", "flush", "2bw")', "name-list"),                         # schedules.py
    ('SEGMENTS = {"2bw": (3, 4), "flush": (1, 2), "gpipe": (1, 2)}', "name-list"),  # planner
    ('p.add_argument("--schedules", default="2bw,flush,gpipe")', "name-list"),  # plan_accuracy
    ('COLOURS = {"2bw": "#d62728", "flush": "#1f77b4", "gpipe": "#2ca02c"}', "name-list"),
    ('def num_slots(schedule):\n    return 2 if schedule == "2bw" else 1', "name-compare"),
    ('def in_flight(schedule, d, m, stage):\n    return m if schedule == "gpipe" else '
     'min(d - stage, m)', "name-compare"),
    ('overlap = f if L.schedule == "2bw" else 0.0', "name-compare"),           # cost_model.py
    ('delayed = cfg.schedule == "2bw"', "name-compare"),                      # testing/reference.py
    ('ver = lambda k: (k // m) % 2', "slot-rule"),                              # schedules.py
    ('newest = (t + 1) % 2 if w.num_slots > 1 else 0', "slot-rule"),           # engine.py
    ('w[t0 % 2] = max(t0 - 1, 0)', "slot-rule"),                                # schedules.py
    ('return (self.iteration - 1) % 2', "slot-rule"),                           # engine.py
    ('if m < d:\n    raise ValueError("2bw needs m >= d")', "min-mb"),          # check_2bw
    ('if self.schedule == "2bw" and mbs < p.pipeline:\n    _fail("")', "min-mb"),  # config.py
    ('if cfg.schedule == "2bw" and m < d:\n    fail("")', "min-mb"),            # ds merge
    ('if sched == "2bw" and m < d:\n    pass', "min-mb"),                       # planner search
    ('if args.schedule == "2bw" and args.num_microbatches < args.pipeline_stages:\n    pass',
     "min-mb"),                                                                 # plot_schedule
    ('if schedule == "2bw" and m < spec["d"]:\n    pass', "min-mb"),            # bench/memory
    ('if "ours-2bw" in args.names and args.num_microbatches < args.pipeline_stages:\n    pass',
     "min-mb"),                                                                 # bench/peers
    ('k = 1 if n == "engine-2bw" else 3', "name-compare"),                     # bench/overhead
]


def test_the_scanner_finds_todays_duplicates():
    for source, rule in BEFORE:
        rules = {r for _, _, r in scan(source)}
        assert rule in rules, (source, rules)


def test_the_scanner_leaves_questions_and_plain_values_alone():
    for source in ('kind = schedule_kind("2bw")', 'Config(schedule="gpipe")', 'BASELINE = "gpipe"',
                   'if not schedule_kind(s).accepts(d, m):\n    pass', 'odd = len(items) % 2',
                   'if m > cap:\n    pass', 'msg = "2bw needs m >= d, or use flush"',
                   'if d > model.num_layers:\n    pass', 'x = {"gpipe": 1, "1f1b": 2}[name]',
                   'slot = kind.slot_of_batch(t)', 'p.add_argument("--schedule", default="2bw")'):
        assert scan(source) == [], source


# names: one definition per public name, so a name says which rule it is
ENTRY_POINTS = {"main", "parse", "run", "build_parser"}  # each tool's own, by convention
# the commands (cli/: what tools/ held, and the judges' GPU check) each keep their own plan,
# summarize, report, parse_args
COMMANDS = (os.path.join("megatron_2bw", "cli"),
            os.path.join("megatron_2bw", "testing", "gpu_check"))  # gpu_check.py, _report.py
# megatron_2bw.deepspeed.pipe and .comm mirror deepspeed.pipe's and deepspeed.comm's names
DEEPSPEED_API = {"LayerSpec", "destroy_process_group"}


def test_public_functions_and_classes_have_one_definition_each():
    where = {}
    for path in _sources():
        if not path.startswith("megatron_2bw") or path.startswith(COMMANDS):
            continue
        with open(os.path.join(ROOT, path)) as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) \
                        and not node.name.startswith("_"):
                    where.setdefault(node.name, []).append(path)
    twice = {n: p for n, p in where.items() if len(p) > 1 and n not in ENTRY_POINTS | DEEPSPEED_API}
    assert not twice, twice
    assert where["split_evenly"] == [os.path.join("megatron_2bw", "models", "partition.py")]
