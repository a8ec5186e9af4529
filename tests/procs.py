"""Processes as Linux's /proc shows them, for the fault tests: a launcher's children and a
process's state letter (R, S, T stopped, Z zombie; "gone" once it has been reaped)."""
from pathlib import Path


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def alive(pid: int) -> bool:
    return state(pid) not in ("gone", "Z")
