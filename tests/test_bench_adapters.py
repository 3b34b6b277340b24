"""``python -m tools.bench.adapters`` at a tiny shape: three rows whose model-state bytes
match their formulas, LoRA's well below the full fine-tune's, QLoRA's base in NF4.

Catches: a base that is not frozen (it gains gradients and Adam state: LoRA's bytes reach the full
fine-tune's), a QLoRA base left dense, a formula that drifts from what is resident."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("torchao")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--hidden", "128", "--layers", "2", "--vocab", "256", "--steps", "2"]
TINY += ["--batch", "2", "--seq", "32", "--r", "4"]


def bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench.adapters", *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,  # python -m tools.*: from the repository root
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


def test_verdicts_judge_the_two_gpu_targets_from_the_rows():
    """met / missed / not measured from the rows and settings. Catches: a verdict given for a CPU
    run or a shape that is not the 8B one, a ratio taken the wrong way round, a QLoRA peak judged
    against the reserved bytes or a GiB limit instead of 10^10 bytes."""
    from tools.bench.adapter_targets import LLAMA3_8B, verdicts

    gpu = {"accelerator": "gpu", "precision": "bf16-mixed", "layers": 4, **LLAMA3_8B}
    fast = [{"method": "full", "tokens_per_s": 1000.0}, {"method": "lora", "tokens_per_s": 1600.0}]
    assert verdicts(fast, gpu)[0].startswith("LoRA >= 1.5x full fine-tune tokens/s: met (1.60x")
    slow = [{**fast[0]}, {"method": "lora", "tokens_per_s": 1400.0}]
    assert ": missed (1.40x" in verdicts(slow, gpu)[0]
    assert "not measured (CPU run)" in verdicts(fast, {**gpu, "accelerator": "cpu"})[0]
    assert "not Llama-3-8B" in verdicts(fast, {**gpu, "hidden": 2048})[0]
    assert "precision 32-true" in verdicts(fast, {**gpu, "precision": "32-true"})[0]

    mb = 2**20
    whole = {**gpu, "layers": 32, "batch": 1, "seq": 2048, "ac": "full"}
    under = {"method": "qlora", "device_peak_mb": 9.9e9 / mb, "device_reserved_mb": 11e9 / mb}
    over = {"method": "qlora-bnb", "device_peak_mb": 10.1e9 / mb, "device_reserved_mb": 11e9 / mb}
    torchao, bnb = verdicts([under, over], whole)[1:]
    assert torchao.startswith("QLoRA (torchao) 8B under 10 GB device peak: met (allocated 9.90")
    assert bnb.startswith("QLoRA (bitsandbytes) 8B under 10 GB device peak: missed")
    assert "(allocated 10.10 GB, reserved 11.00 GB, 1 x 2048 tokens, ac full)" in bnb
    assert "4 layers, not 32" in verdicts([under], gpu)[1]
    skipped = {**whole, "skipped": {"qlora-bnb": "bitsandbytes not importable"}}
    assert verdicts([under], skipped)[2].endswith("(no row: bitsandbytes not importable)")


def test_the_8b_flags_build_llama_3_8b():
    """The GPU step's shape flags give Llama-3-8B's 8,030,261,248 parameters at 32 layers (built
    on meta), and every projection fits torchao's NF4 blocks. Catches: a flag that does not reach
    the config (heads, key/value heads, MLP width), an 8B row that is not 8B."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_3d.adapters.qlora import MULTIPLE
    from tools.bench.adapter_targets import LLAMA3_8B
    from tools.bench.adapters import llama_config

    s = LLAMA3_8B
    config = llama_config(s["hidden"], 32, s["vocab"], 2048, s["heads"], s["kv_heads"], s["mlp"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    projections = [m for n, m in model.named_modules() if n.endswith("_proj")]
    assert len(projections) == 7 * 32 and all(m.weight.numel() % MULTIPLE == 0 for m in projections)


def ci_gpu(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "WHEELS": str(tmp_path)}
    return subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )


def test_ci_gpu_adapters_dry_run_prints_both_runs_whose_flags_parse(tmp_path):
    """``bash .ci/gpu --dry-run adapters`` prints the two GPU runs (timeouts adding up to at most
    300 s) and each command's flags parse here (the accelerator set to cpu). Catches: a step not
    selectable, a misspelt flag that would fail only on the device, a step over its budget."""
    from tools.bench import adapters

    out = ci_gpu(tmp_path, "--dry-run", "adapters")
    assert out.returncode == 0, out.stderr
    runs = re.findall(r"^=== (\w+) \(timeout (\d+) s, gpu\): \S+ -m (\S+) (.*)$", out.stdout, re.M)
    assert [r[0] for r in runs] == ["adapters", "qlora8b"]
    assert sum(int(r[1]) for r in runs) <= 300
    for _, _, module, argv in runs:
        assert module == "tools.bench.adapters"
        args = adapters.parse(argv.replace("--accelerator gpu", "--accelerator cpu").split())
        assert (args.hidden, args.mlp, args.heads, args.kv_heads) == (4096, 14336, 32, 8)
        assert args.vocab == 128256 and args.precision == "bf16-mixed"
    speed, memory = (adapters.parse(r[3].replace("gpu", "cpu").split()) for r in runs)
    assert speed.methods == ["full", "lora"] and speed.layers < 32
    assert memory.methods == ["qlora", "qlora-bnb"] and memory.layers == 32 and memory.ac == "full"
    assert memory.loss_chunks == "auto"  # the fine-tune app's default, the planner's 9.24 GB
    assert adapters.method_run("qlora", memory).strategy["loss_chunks"] == "auto"
    assert "unknown argument 'adapter'" in ci_gpu(tmp_path, "--dry-run", "adapter").stderr


def test_bad_shape_flags_are_refused_in_one_line(capsys):
    from tools.bench import adapters

    with pytest.raises(SystemExit):
        adapters.parse(["--hidden", "256", "--heads", "4", "--kv-heads", "3"])
    assert "--hidden 256, --heads 4, --kv-heads 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        adapters.parse(["--mlp", "200"])
    assert "--mlp 200" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        adapters.parse(["--loss-chunks", "0"])
    assert "--loss-chunks 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke path; a GPU runs the real one")
def test_ci_gpu_adapters_runs_its_cpu_smoke_version(tmp_path):
    """Without CUDA, ``bash .ci/gpu adapters`` runs both runs at a tiny shape through the same
    options (bf16-mixed, 4/2 heads, checkpointing, built under ``torch.device``) and writes
    their tables with the targets "not measured (CPU run)". Catches: a step that works only in
    the dry run, options the bench cannot run together, tables missing from $OUT."""
    out = ci_gpu(tmp_path, "adapters")
    assert out.returncode == 0, out.stdout[-3000:]
    assert "adapters: ok" in out.stdout and "qlora8b: ok" in out.stdout
    speed = json.loads((tmp_path / "adapters" / "speed" / "adapters.json").read_text())
    memory = json.loads((tmp_path / "adapters" / "qlora8b" / "adapters.json").read_text())
    assert [r["method"] for r in speed["rows"]] == ["full", "lora"]
    bnb = importlib.util.find_spec("bitsandbytes") is not None
    assert [r["method"] for r in memory["rows"]] == ["qlora"] + ["qlora-bnb"] * bnb
    for r in memory["rows"]:  # NF4 codes of either backend: about half a byte a value
        assert r["measured_vs_formula"] == pytest.approx(1.0, abs=0.05), r["method"]
        assert r["nf4_vs_bf16"] < 0.3 and r["base_params"] == speed["rows"][0]["base_params"]
        assert r["quantized_params"] == memory["rows"][0]["quantized_params"], r["method"]
    for record in (speed, memory):
        assert len(record["targets"]) == 3
        assert all(t.endswith("not measured (CPU run)") for t in record["targets"])
    assert "Targets:" in (tmp_path / "adapters" / "qlora8b" / "adapters.md").read_text()
