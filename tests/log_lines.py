"""The training log's interval lines as tests read them (megatron_2bw's parser of Megatron's
line, training/observe/log_line.py): a test that waits for training to start, or reads a field,
asks here instead of matching the text itself."""
from megatron_2bw.training.observe.log_line import parse_line


def interval_fields(line: str) -> dict | None:
    """The fields of an interval line ({"consumed samples": ..., "loss scale": ...}), else None
    (a validation line, a note, anything else)."""
    parsed = parse_line(line.rstrip("\n"))
    return parsed[1] if parsed and "consumed samples" in parsed[1] else None
