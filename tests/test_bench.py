"""``python -m tools.bench``: bad input, the byte counter, and a two-row quick run (2 gloo ranks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from omegaconf import OmegaConf

import lightning_3d
import tools
from tools.bench.__main__ import DEFAULT_CONFIG, load_config, main
from tools.bench.comm import count_collectives
from tools.bench.compare import check_settings


def test_unknown_row_and_bad_sizes_are_refused_before_any_process():
    cfg, _ = load_config(["--quick", "--rows", "ddp", "nope", "3d_zero9"])
    with pytest.raises(ValueError, match=r"unknown rows \['nope', '3d_zero9'\]"):
        check_settings(cfg)
    cfg, _ = load_config(["--quick", "data.batch_size=5", "--rows", "3d_pp2"])
    with pytest.raises(ValueError, match=r"global batch_size \(5\).*micro_batches \(2\)"):
        check_settings(cfg)
    with pytest.raises(ValueError, match="key=value"):
        load_config(["--quick", "steps"])


def test_defaults_are_the_yaml_beside_the_module(tmp_path):
    assert DEFAULT_CONFIG == Path(tools.__file__).parent / "bench" / "bench.yaml"
    expected = OmegaConf.to_container(OmegaConf.create(DEFAULT_CONFIG.read_text()))
    quick = expected.pop("quick")
    assert load_config([])[0] == expected
    assert load_config(["--quick"])[0]["steps"] == quick["steps"] != expected["steps"]
    with pytest.raises(ValueError, match="does not exist"):
        load_config(["--config", str(tmp_path / "missing.yaml")])


# In a fresh interpreter: imports only a copy of the package and tools/, records every .yaml it opens.
_LOAD_FROM_COPY = """
import json, sys
opened = []
def audit(event, args):
    if event == "open" and str(args[0]).endswith(".yaml"):
        opened.append(str(args[0]))
sys.addaudithook(audit)
import tools.bench.__main__ as bench
cfg, _ = bench.load_config(["--quick"])
print(json.dumps({"module": bench.__file__, "opened": opened, "steps": cfg["steps"]}))
"""


def test_defaults_load_from_a_copy_of_the_package_and_tools_alone(tmp_path):
    """The package's and tools/' own files and nothing else of the checkout (no conf/) around them."""
    site = tmp_path / "site"
    for package in (lightning_3d, tools):
        root = Path(package.__file__).parent
        shutil.copytree(root, site / root.name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_FROM_COPY],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert Path(seen["module"]).is_relative_to(site) and seen["steps"] == 3
    assert seen["opened"] and all(
        Path(p).is_relative_to(site / "tools" / "bench") for p in seen["opened"]
    )


def test_counter_patches_and_restores_every_entry_point():
    before = (dist.all_reduce, dist.isend, dist.distributed_c10d.isend, funcol.all_gather_tensor)
    with count_collectives() as counter:
        assert dist.all_reduce is not before[0] and dist.distributed_c10d.isend is dist.isend
        assert funcol.all_gather_tensor is not before[3]
    assert (
        dist.all_reduce,
        dist.isend,
        dist.distributed_c10d.isend,
        funcol.all_gather_tensor,
    ) == before
    assert counter.sent_bytes == 0


def test_quick_run_of_two_rows(tmp_path, capsys):
    from tools.bench.page import BEGIN, END

    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Benchmarks\n\n{BEGIN}\nold figures\n{END}\n\nprose kept\n")
    argv = ["--quick", "--rows", "3d_zero1", "ddp", "--outdir", str(tmp_path)]
    records = main([*argv, "--repeats", "2", "--write-docs", str(page)])
    by = {r["row"]: r for r in records}
    assert set(by) == {"3d_zero1", "ddp"} and not any("note" in r for r in records), records
    for r in records:
        assert r["tokens_per_s"] > 0 and r["world"] == 2
        # Model state is counted from tensors; ZeRO-1 and DDP match the paper's bytes (padding < 1%).
        assert r["state_bytes"] == pytest.approx(r["state_formula_bytes"], rel=0.01)
        # DDP's gradient all-reduce and ZeRO-1's reduce-scatter + all-gather: 2(N-1)/N * 4Ψ per step.
        assert r["sent_bytes"] == pytest.approx(r["sent_theory_bytes"], rel=0.10)
    assert by["3d_zero1"]["vs_ddp"] == pytest.approx(
        by["3d_zero1"]["tokens_per_s"] / by["ddp"]["tokens_per_s"]
    )
    # DDP's reducer went through the hook.
    assert "dist.all_reduce" in by["ddp"]["ranks"][0]["comm_ops"]
    table = (tmp_path / "bench.md").read_text()
    assert (
        "| 3d_zero1 | 2 |" in table
        and "| ddp | 2 |" in table
        and "MALLOC_MMAP_THRESHOLD_=1048576" in table
    )
    assert "| 3d_zero1 | 2 |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [r["row"] for r in saved["records"]] == ["3d_zero1", "ddp"]
    # The page's block is the table, with its command, date and each row's spread over repeats.
    written = page.read_text()
    assert "old figures" not in written and written.endswith(f"{END}\n\nprose kept\n")
    assert table.strip() in written and "--write-docs" in written and "- date: " in written
    runs = by["3d_zero1"]["tokens_per_s_runs"]
    assert len(runs) == 2 and f"({min(runs):.0f}–{max(runs):.0f})" in written


def test_write_docs_refuses_a_page_without_its_block_before_any_run(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    with pytest.raises(ValueError, match="has no generated block"):
        main(["--quick", "--rows", "ddp", "--outdir", str(tmp_path), "--write-docs", str(page)])
    assert not (tmp_path / "bench.md").exists()


def test_activation_checkpointing_benchmark_writes_its_summary(tmp_path, capsys):
    from tools.bench import activation_checkpointing as bench

    bench.main(["--quick", "--out", str(tmp_path)])
    assert "| full | 4/4 | 1,048,576 |" in capsys.readouterr().out  # the printed table stays
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["benchmark"] == "activation_checkpointing" and saved["model"]["n_layer"] == 4
    policies = saved["policies"]
    assert list(policies) == ["none", "full", "every_n", "selective"]
    none, full = policies["none"], policies["full"]
    # A fully checkpointed block keeps its input only: batch 8 x 128 tokens x 256 x 4 bytes.
    assert set(full["saved_bytes_per_block"].values()) == {8 * 128 * 256 * 4}
    assert none["saved_bytes_vs_none"] == 1.0 and none["step_cpu_vs_none"] == 1.0
    assert full["saved_bytes_vs_none"] < policies["selective"]["saved_bytes_vs_none"] < 1.0
    for f in policies.values():
        assert f["saved_bytes_per_block_mean"] * f["blocks"] == f["saved_bytes_all_blocks"]
        assert (
            f["step_cpu_s_median"] > 0
            and f["step_wall_s_median"] > 0
            and f["step_wall_vs_none"] > 0
        )


def test_offload_memory_summary_rows_and_ratios(tmp_path):
    """The summary's rows from made-up worker records (the real run takes minutes)."""
    import argparse

    from tools.bench import offload_memory as bench

    def record(offload, peak, step, checkpointing="none"):
        return {
            "precision": "32-true",
            "batch": 4,
            "seq": 128,
            "offload": offload,
            "checkpointing": checkpointing,
            "base_rss_mb": 300.0,
            "peak_rss_mb": peak,
            "step_s": step,
            "cpu_s": step,
            "num_params": 50_048_256,
            "param_bytes": 200,
            "grad_bytes": 200,
            "optimizer_state_bytes": 400 if offload == "none" else 48,
            "activation_bytes_per_block": 1000 if checkpointing == "none" else 100,
        }

    results = [
        record("none", 1300.0, 6.0),
        record("nvme", 975.0, 6.6),
        record("none", 1200.0, 8.0, "full"),
    ]
    args = argparse.Namespace(threads=1, rounds=4, path=str(tmp_path), n_layer=12, n_embd=1024)
    summary = bench.summary(results, args)
    assert summary["num_params"] == 50_048_256 and summary["benchmark"] == "offload_memory"
    assert (
        summary["model"]["n_layer"],
        summary["model"]["n_embd"],
        summary["model"]["n_head"],
    ) == (12, 1024, 16)
    none, nvme, full = summary["rows"]
    assert none["peak_rss_vs_none"] == 1.0 and none["step_s_vs_none"] == 1.0
    assert nvme["peak_rss_vs_none"] == pytest.approx(0.75) and nvme[
        "step_s_vs_none"
    ] == pytest.approx(1.1)
    assert nvme["over_base_vs_none"] == pytest.approx(675 / 1000) and nvme["tokens_per_step"] == 512
    assert full["peak_rss_vs_none"] == 1.0  # its own reference: offload=none with checkpointing
    assert full["peak_rss_vs_fp32_none"] == pytest.approx(1200 / 1200)
    assert json.loads(json.dumps(summary)) == summary  # JSON as it is
    assert "| 32-true | nvme | none | 4x128 | 6.60 | 1.10x |" in bench.table(results)
    assert "device peak" not in bench.table(results)  # a CPU run has no device column

    # --accelerator gpu: the device's peak next to offload=none's, and the ZeRO-3 parameter-offload row.
    gpu = [
        {**record("none", 1300.0, 1.0), "device_peak_mb": 800.0},
        {**record("cpu", 1500.0, 1.2), "device_peak_mb": 300.0},
        {**record("cpu", 1600.0, 1.5), "device_peak_mb": 100.0, "params": True},
    ]
    none, cpu, params = bench.rows(gpu)
    assert none["device_peak_vs_none"] == 1.0 and cpu["device_peak_vs_none"] == pytest.approx(0.375)
    assert params["device_peak_vs_none"] == pytest.approx(0.125) and params[
        "step_s_vs_none"
    ] == pytest.approx(1.5)
    assert "| 32-true | cpu + params (ZeRO-3) | none | 4x128 | 1.50 | 1.50x |" in bench.table(gpu)
    assert bench.table(gpu).splitlines()[2].endswith("| 800 | 1.00x |")
    groups = bench.gpu_groups(bench.default_groups(False))
    assert [(r.offload, r.params) for r in groups["32-true"]][-1] == ("cpu", True)


def test_offload_memory_refuses_gpu_without_cuda(capsys, monkeypatch):
    from tools.bench import offload_memory as bench

    monkeypatch.setattr(bench, "_cuda_available", lambda: False)  # as on this machine, anywhere
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--accelerator", "gpu"])
    assert (
        exit_.value.code == 2 and "--accelerator gpu needs a CUDA device" in capsys.readouterr().err
    )


# --- one device (``python -m tools.bench --accelerator gpu``) and the offload ladder ---------


def test_flops_per_token_reproduces_issue_15s_tflops():
    """6 Ψ + 12 L C T at 12 x 768, T = 1024, vocab 256: 478,673 tokens/s is the table's 302 TFLOP/s."""
    from lightning_3d.observe.flops import named_device_peak, transformer_flops_per_token
    from tools.bench.compare import full_param_count
    from tools.bench.one_device import MODEL

    psi = full_param_count({k: v for k, v in MODEL.items()})
    assert psi == 86_133_504
    per_token = transformer_flops_per_token(
        psi, MODEL["n_layer"], MODEL["n_embd"], MODEL["block_size"]
    )
    assert per_token == 6 * psi + 12 * 12 * 768 * 1024
    assert round(478_673 * per_token / 1e12) == 302
    assert named_device_peak("NVIDIA H200", "bf16-mixed").tflops == 989.4
    assert named_device_peak("Tesla T4", "bf16-mixed").tflops is None


def test_one_device_bad_settings_are_refused_before_any_process(monkeypatch):
    from tools.bench import one_device
    from tools.bench.__main__ import accelerator_of

    with pytest.raises(ValueError, match=r"unknown rows \['ddp'\]"):
        one_device.parse(["--accelerator", "cpu", "--rows", "torch", "ddp"])
    with pytest.raises(ValueError, match=r"warmup \(4\) must be in \[0, steps=4\)"):
        one_device.parse(["--accelerator", "cpu", "--quick", "--warmup", "4"])
    with pytest.raises(ValueError, match=r"precision must be one of .* got '16-mixed'"):
        one_device.parse(["--accelerator", "cpu", "--precision", "16-mixed"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert accelerator_of(["--rows", "auto", "--accelerator=gpu"]) == ("gpu", ["--rows", "auto"])
    with pytest.raises(ValueError, match="--accelerator gpu needs a CUDA device"):
        main(["--accelerator", "gpu", "--quick"])  # python -m tools.bench goes to one_device


def test_one_device_rows_and_figures_on_cpu():
    """The raw loop and Lightning ``auto`` train the same model on the same batches (in this
    process: no process group); the summary turns their step times into the table's figures."""
    from tools.bench import one_device

    cfg = one_device.parse(
        ["--accelerator", "cpu", "--quick", "--precision", "32-true", "--rows", "torch", "auto"]
    )
    spec = {
        k: cfg[k]
        for k in ("model", "batch", "steps", "warmup", "precision", "clip", "seed", "accelerator")
    }
    raw = {
        "runs": {
            name: [one_device.fit_row(0, {**spec, "engine": name, "options": {}})]
            for name in ("torch", "auto")
        },
        "notes": {},
    }
    torch_run, auto_run = raw["runs"]["torch"][0], raw["runs"]["auto"][0]
    assert len(torch_run["step_s"]) == len(auto_run["step_s"]) == cfg["steps"]
    # LitGPT 2 x 64, T = 32, vocab 256.
    assert torch_run["num_params"] == auto_run["num_params"] == 133_440
    records = one_device.summarize(cfg, raw)
    by = {r["row"]: r for r in records}
    tokens = cfg["batch"] * cfg["model"]["block_size"]
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"])
        assert r["tflops"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / 1e12)
        assert r["mfu"] is None and r["device_peak_mb"] is None  # a CPU: no peak, no device memory
    assert by["auto"]["vs_torch"] == pytest.approx(
        by["auto"]["tokens_per_s"] / by["torch"]["tokens_per_s"]
    )
    # RunSummary's meter.
    assert by["auto"]["vs_auto"] == 1.0 and by["auto"]["activation_bytes_per_block"] > 0
    failed = one_device.summarize(cfg, {"runs": raw["runs"], "notes": {"3d": "failed: boom"}})
    assert "| 3d | failed: boom |" in one_device.table(
        [*failed, {"row": "3d", "note": "failed: boom"}]
    )
    assert one_device.target_misses([{"row": "3d", "note": "failed: boom"}]) == [
        "3d: not measured (failed: boom)"
    ]


def _ladder_args(tmp_path, **kw):
    import argparse

    defaults = dict(
        sizes=["1x64"],
        modes=["cpu"],
        rounds=1,
        batch_size=1,
        seq_len=160,
        row_timeout_s=120.0,
        budget_s=120.0,
        accelerator="cpu",
        threads=1,
        vocab=256,
        device_memory_gb=None,
        path=str(tmp_path),
        out=str(tmp_path / "out"),
    )
    return argparse.Namespace(**{**defaults, **kw})


def test_offload_ladder_sizes_and_bad_input(tmp_path, capsys):
    from tools.bench import offload_ladder as ladder
    from tools.bench import offload_memory

    assert ladder.parse_size("1.3B") == (24, 2048) and ladder.parse_size("3x128") == (3, 128)
    for bad in ("1.3b", "3x100", "x64"):
        with pytest.raises(ValueError, match=repr(bad)):
            ladder.parse_size(bad)
    with pytest.raises(ValueError, match=r"unknown offload modes \['gpu'\]"):
        ladder.check(_ladder_args(tmp_path, modes=["cpu", "gpu"]))
    args = _ladder_args(tmp_path, sizes=["6.7B", "0.35B", "2x64"], modes=None)
    assert [s[0] for s in ladder.check(args)] == ["2x64", "0.35B", "6.7B"] and args.modes == [
        "none",
        "cpu",
        "params",
    ]
    # Each mode: the strategy options it runs.
    rows = {mode: ladder.row_of(mode, args) for mode in ladder.MODES}
    assert {m: (r.offload, r.params, r.overlap, r.delay) for m, r in rows.items()} == {
        "none": ("none", False, True, False),
        "cpu": ("cpu", False, True, False),
        "nvme": ("nvme", False, True, False),
        "params": ("cpu", True, True, False),
        "cpu-blocking": ("cpu", False, False, False),
        "cpu-delayed": ("cpu", False, True, True),
    }
    with pytest.raises(SystemExit):  # a device cap means nothing on a CPU
        offload_memory.main(["--sizes", "1x64", "--device-memory-gb", "24"])
    assert "--device-memory-gb needs --accelerator gpu" in capsys.readouterr().err


def test_offload_ladder_table_counts_rows_that_do_not_fit():
    from tools.bench import offload_ladder as ladder

    def rec(size, mode, outcome, params, **kw):
        layers, width = ladder.SIZES[size]
        return ladder.figures(
            {
                "size": size,
                "mode": mode,
                "outcome": outcome,
                "n_layer": layers,
                "n_embd": width,
                "batch": 8,
                "seq": 1024,
                "num_params": params,
                **kw,
            },
            32_000,
        )

    fit = dict(
        step_s=2.0,
        build_s=10.0,
        fwd_bwd_s=0.5,
        optimizer_s=1.5,
        device_peak_mb=6 * 1024.0,
        peak_rss_mb=20480.0,
    )
    records = [
        rec("0.35B", "none", "fits", 350_000_000, **fit),
        rec("1.3B", "none", "does not fit", 0, phase="step 1 of 3"),
        rec("0.35B", "cpu", "fits", 350_000_000, **fit),
        rec("1.3B", "cpu", "fits", 1_300_000_000, **fit, cpu_step_s=1.0),
        rec("2.7B", "params", "did not finish within 90 s", 0, phase="building"),
    ]
    assert records[0]["tflops"] == pytest.approx(
        8 * 1024 * (6 * 350e6 + 12 * 24 * 1024 * 1024) / 2.0 / 1e12
    )
    assert records[1]["num_params"] == 12 * 24 * 2048**2 + (32_000 + 1024) * 2048  # from the shape
    assert ladder.largest_fitting(records) == {"none": "0.35B", "cpu": "1.3B", "params": None}
    text = ladder.table(records)
    assert "| 1.3B | 1.28 B | none | does not fit (step 1 of 3) | - | - |" in text
    assert (
        "| 1.3B | 1.30 B | cpu | fits | 10.0 | 2.00 | 0.50 | 1.50 | 1.00 | 1.33 |" in text
        and "| 6.0 | 20.0 |" in text
    )
    # No CPU step measured.
    assert "| 0.35B | 0.35 B | cpu | fits | 10.0 | 2.00 | 0.50 | 1.50 | - | - |" in text


def test_offload_ladder_runs_a_row_and_reports_one_that_does_not_finish(tmp_path):
    """A real worker on CPU (tiny model), then a deadline too short to build: a row, not a crash,
    and the larger size of that mode is not tried."""
    from tools.bench import offload_ladder as ladder
    from tools.bench.compare import full_param_count
    from tools.bench.offload_memory import model_config

    (row,) = ladder.run_ladder(_ladder_args(tmp_path), log=lambda line: None)
    assert row["outcome"] == "fits" and row["mode"] == "cpu" and row["offload"] == "cpu"
    # sequences of 160 tokens: the positional table grew past the default 128
    assert (
        row["num_params"]
        == full_param_count(model_config(1, 64, 256, 160))
        > full_param_count(model_config(1, 64))
    )
    assert 0 < row["build_s"] and 0 < row["fwd_bwd_s"] < row["step_s"] and row["optimizer_s"] > 0
    # The fused CPU Adam alone, inside the optimizer's part.
    assert 0 < row["cpu_step_s"] <= row["optimizer_s"]
    assert row["peak_rss_mb"] >= row["base_rss_mb"] > 0 and row["tflops"] > 0
    late = ladder.run_ladder(
        _ladder_args(tmp_path, sizes=["1x64", "2x64"], row_timeout_s=0.5), log=lambda line: None
    )
    assert [r["outcome"] for r in late] == [
        "did not finish within 0.5 s",
        "not run: 1x64 did not finish within 0.5 s",
    ]
    assert late[0]["phase"] == "building"
