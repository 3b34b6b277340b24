"""Run the training app many times in a row and count how each run ended: a soak for failures
that show up once in many runs (an abort at interpreter exit, ``terminate called without an
active exception``, exit code 134), too rare and too slow for a test.

    python -m tools.harness.soak --runs 20                      # sharded dp2, tiny GPT
    python -m tools.harness.soak --runs 5 -- parallelism.zero_stage=3

Prints one line per run (exit code, seconds, the last stderr line of a failed run) and the
count of each exit code; exits 1 unless every run exited 0.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.harness.apps import app_env

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = [
    "model=gpt_tiny",
    "parallelism.data=2",
    "parallelism.checkpoint_format=sharded",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "data.max_bytes=300000",
    "data.batch_size=8",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "overrides", nargs="*", help="more Hydra overrides for every run (after --)"
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    codes: collections.Counter[int] = collections.Counter()
    with tempfile.TemporaryDirectory(prefix="lightning3d-soak-") as root:
        for run in range(args.runs):
            start = time.monotonic()
            proc = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "examples" / "train.py"),
                    *DEFAULT,
                    *args.overrides,
                    f"hydra.run.dir={root}/run{run}",
                ],
                cwd=root,
                env=app_env(),
                capture_output=True,
                text=True,
                check=False,
            )
            codes[proc.returncode] += 1
            last = (
                [line for line in proc.stderr.splitlines() if line.strip()][-1:]
                if proc.returncode
                else []
            )
            print(
                f"run {run}: exit {proc.returncode} in {time.monotonic() - start:.1f} s {' '.join(last)[:300]}",
                flush=True,
            )
            if "terminate called" in proc.stderr:
                print(proc.stderr[-4000:], flush=True)
    print("exit codes:", dict(sorted(codes.items())))
    return 0 if set(codes) == {0} else 1


if __name__ == "__main__":
    sys.exit(main())
