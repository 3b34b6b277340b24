import os

import pytest

# Two cores on CI: one intra-op thread per process, or ranks fight over the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Ranks of run_world are forked from a server that imported torch and Lightning once (~4 s of
# CPU saved per rank); they still take this process's environment (tools/harness/world.py).
os.environ.setdefault("LIGHTNING3D_WORLD_START", "forkserver")


# ------------------------------------------------------------------ the suite's own guard
@pytest.fixture(autouse=True)
def _leaves_nothing_behind():
    """Every test leaves the pytest process as it found it (tests/support/leftovers.py):
    no default process group, no launcher variables of a world it started, no child process."""
    from support.leftovers import Leftovers

    before = Leftovers.now()
    yield
    problems = before.left_behind()
    if problems:
        pytest.fail("the test left behind: " + "; ".join(problems), pytrace=False)
