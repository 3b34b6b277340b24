"""``python -m tools.bench.offload`` runs and reports the step against fused AdamW."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # four worker processes importing torch: a minute or more on two busy cores
def test_bench_reports_params_per_second_against_fused_adamw(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench.offload",
            "--numel",
            "48000",
            "--rounds",
            "2",
            "--chunk-mb",
            "1",
            "--threads",
            "1",
            "--path",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=Path(__file__).resolve().parents[1],  # python -m tools.*: from the repository root
    ).stdout
    table = [line for line in out.splitlines() if re.match(r"\| (none|fused|cpu|nvme) \|", line)]
    rows = {line.split("|")[1].strip(): line for line in table}
    assert list(rows) == ["none", "fused", "cpu", "nvme"]
    assert rows["fused"].split("|")[5].strip() == "1.00x"  # the yardstick against itself
    ratio = re.search(r"AdamW\(fused=True\): (\d+\.\d+)x params/s", out)
    assert ratio and float(ratio.group(1)) > 0
    assert "1 intra-op thread(s)" in out and "median of 2" in out
    assert list(tmp_path.iterdir()) == []  # the nvme worker removed its files
