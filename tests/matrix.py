"""The default run keeps a covering subset of a test matrix; `-m slow` runs all of it.

    @pytest.mark.parametrize("schedule,d,w", matrix(product(SCHEDULES, [2, 4], [1, 2]),
                                                    default=[("gpipe", 2, 1), ("2bw", 4, 2)]))

Every row becomes a pytest.param with a readable id; rows not in `default` are marked slow."""
import pytest


def matrix(rows, default):
    rows, default = [tuple(r) for r in rows], {tuple(r) for r in default}
    missing = default - set(rows)
    assert not missing, f"default rows not in the matrix: {sorted(missing)}"
    return [pytest.param(*r, id="-".join(str(x) for x in r),
                         marks=() if r in default else pytest.mark.slow) for r in rows]
