"""``python -m lightning_3d.bench.adapters`` at a tiny shape: three rows whose model-state bytes
match their formulas, LoRA's well below the full fine-tune's, QLoRA's base in NF4.

Catches: a base that is not frozen (it gains gradients and Adam state: LoRA's bytes reach the full
fine-tune's), a QLoRA base left dense, a formula that drifts from what is resident."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("peft")
pytest.importorskip("torchao")

TINY = ["--hidden", "128", "--layers", "2", "--vocab", "256", "--steps", "2"]
TINY += ["--batch", "2", "--seq", "32", "--r", "4"]


def bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "lightning_3d.bench.adapters", *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_bench_prints_three_rows_whose_bytes_match_the_formulas(tmp_path):
    out = bench(tmp_path, *TINY)
    table = [line for line in out.stdout.splitlines() if line.startswith("| ")][1:]
    assert [line.split("|")[1].strip() for line in table] == ["full", "lora", "qlora"]
    assert (tmp_path / "adapters.md").read_text().count("\n| ") == 4  # header + three rows
    rows = {r["method"]: r for r in json.loads((tmp_path / "adapters.json").read_text())["rows"]}
    full, lora, qlora = rows["full"], rows["lora"], rows["qlora"]

    assert full["base_params"] == lora["base_params"] == qlora["base_params"] > 500_000
    assert full["adapter_params"] == 0 < lora["adapter_params"] == qlora["adapter_params"]
    for r in rows.values():
        assert r["measured_vs_formula"] == pytest.approx(1.0, abs=0.02), r["method"]
        assert r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0
        if r["method"] != "full":  # timed by hooks: a part of the step, not nothing
            assert 0 < r["adapters_share"] < 1 and r["modules_timed"] == 3 * 7 * 2  # dropout, A, B
    # Only the adapters hold gradients and Adam state (fp32: 4 + 8 bytes a value).
    for r in (lora, qlora):
        assert r["grad_bytes"] == 4 * r["adapter_params"], r["method"]
        assert r["optimizer_state_bytes"] < 8 * r["adapter_params"] + 4096, r["method"]
    assert lora["model_state_bytes"] < 0.4 * full["model_state_bytes"]
    assert qlora["nf4_bytes"] < 0.3 * 2 * qlora["quantized_params"]  # vs the same weights in bf16
    assert qlora["base_bytes"] < 0.6 * lora["base_bytes"]


def test_bench_at_dp2_zero3_holds_half_of_each_methods_bytes_on_every_rank(tmp_path):
    """Two gloo ranks, ZeRO-3: every rank holds half of the weights (NF4 codes included),
    gradients and Adam moments. Catches: a frozen base left whole under ZeRO-3, the NF4 base
    kept whole on every rank, one rank holding more than its half (the worst-rank column)."""
    wide = ["--hidden", "256", "--data", "2", "--zero-stage", "3", "--methods", "lora", "qlora"]
    bench(tmp_path, *TINY, *wide)
    rows = json.loads((tmp_path / "adapters.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["lora", "qlora"]
    for r in rows:
        assert r["measured_vs_formula"] == pytest.approx(1.0, abs=0.02), r["method"]
        assert r["max_rank_vs_formula"] == pytest.approx(1.0, abs=0.02), r["method"]
        assert r["formula"].endswith("/ 2")
    assert rows[1]["nf4_vs_bf16"] < 0.3
