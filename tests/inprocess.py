"""A tool's `main(argv)` run in this process, with what a subprocess would give back: the exit
status (a SystemExit's code, or main's return value), stdout and stderr. For tools whose process
boundary adds nothing to the test (no signals, no launcher): it saves a torch import per call."""
import io
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace


def run_main(main, argv) -> SimpleNamespace:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else 1
    return SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())
