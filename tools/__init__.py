"""The workshop beside the library: benchmarks, calibration runs, the run harness and the options
page generator. Not installed; run from the repository root, e.g. ``python -m tools.bench``."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root, which holds tools/


def pythonpath() -> str:
    """``PYTHONPATH`` for a child process that imports ``tools``: the repository root first, so the
    child finds it whatever its working directory."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
