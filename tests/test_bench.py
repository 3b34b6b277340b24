"""``python -m lightning_3d.bench``: bad input, the byte counter, and a two-row quick run (2 gloo ranks)."""

from __future__ import annotations

import importlib.resources
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
from lightning_3d.bench.__main__ import load_config, main
from lightning_3d.bench.comm import count_collectives
from lightning_3d.bench.compare import check_settings


def test_unknown_row_and_bad_sizes_are_refused_before_any_process():
    cfg, _ = load_config(["--quick", "--rows", "ddp", "nope", "3d_zero9"])
    with pytest.raises(ValueError, match=r"unknown rows \['nope', '3d_zero9'\]"):
        check_settings(cfg)
    cfg, _ = load_config(["--quick", "data.batch_size=5", "--rows", "3d_pp2"])
    with pytest.raises(ValueError, match=r"global batch_size \(5\).*micro_batches \(2\)"):
        check_settings(cfg)
    with pytest.raises(ValueError, match="key=value"):
        load_config(["--quick", "steps"])


def test_defaults_are_package_data_read_through_importlib_resources(tmp_path):
    packaged = importlib.resources.files("lightning_3d.bench").joinpath("bench.yaml")
    expected = OmegaConf.to_container(OmegaConf.create(packaged.read_text()))
    quick = expected.pop("quick")
    assert load_config([])[0] == expected
    assert load_config(["--quick"])[0]["steps"] == quick["steps"] != expected["steps"]
    with pytest.raises(ValueError, match="does not exist"):
        load_config(["--config", str(tmp_path / "missing.yaml")])


# In a fresh interpreter: imports only a copy of the package, records every .yaml it opens.
_LOAD_FROM_COPY = """
import json, sys
opened = []
def audit(event, args):
    if event == "open" and str(args[0]).endswith(".yaml"):
        opened.append(str(args[0]))
sys.addaudithook(audit)
import lightning_3d.bench.__main__ as bench
cfg, _ = bench.load_config(["--quick"])
print(json.dumps({"module": bench.__file__, "opened": opened, "steps": cfg["steps"]}))
"""


def test_defaults_load_from_a_copy_of_the_package_alone(tmp_path):
    """As from a wheel: the package's own files and nothing of the checkout (no conf/) around them."""
    site = tmp_path / "site"
    shutil.copytree(Path(lightning_3d.__file__).parent, site / "lightning_3d",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", _LOAD_FROM_COPY], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert Path(seen["module"]).is_relative_to(site) and seen["steps"] == 3
    assert seen["opened"] and all(Path(p).is_relative_to(site / "lightning_3d" / "bench") for p in seen["opened"])


def test_counter_patches_and_restores_every_entry_point():
    before = (dist.all_reduce, dist.isend, dist.distributed_c10d.isend, funcol.all_gather_tensor)
    with count_collectives() as counter:
        assert dist.all_reduce is not before[0] and dist.distributed_c10d.isend is dist.isend
        assert funcol.all_gather_tensor is not before[3]
    assert (dist.all_reduce, dist.isend, dist.distributed_c10d.isend, funcol.all_gather_tensor) == before
    assert counter.sent_bytes == 0


def test_quick_run_of_two_rows(tmp_path, capsys):
    records = main(["--quick", "--rows", "3d_zero1", "ddp", "--outdir", str(tmp_path)])
    by = {r["row"]: r for r in records}
    assert set(by) == {"3d_zero1", "ddp"} and not any("note" in r for r in records), records
    for r in records:
        assert r["tokens_per_s"] > 0 and r["world"] == 2
        # Model state is counted from tensors; ZeRO-1 and DDP match the paper's bytes (padding < 1%).
        assert r["state_bytes"] == pytest.approx(r["state_formula_bytes"], rel=0.01)
        # DDP's gradient all-reduce and ZeRO-1's reduce-scatter + all-gather: 2(N-1)/N * 4Ψ per step.
        assert r["sent_bytes"] == pytest.approx(r["sent_theory_bytes"], rel=0.10)
    assert by["3d_zero1"]["vs_ddp"] == pytest.approx(by["3d_zero1"]["tokens_per_s"] / by["ddp"]["tokens_per_s"])
    assert "dist.all_reduce" in by["ddp"]["ranks"][0]["comm_ops"]  # DDP's reducer went through the hook
    table = (tmp_path / "bench.md").read_text()
    assert "| 3d_zero1 | 2 |" in table and "| ddp | 2 |" in table and "MALLOC_MMAP_THRESHOLD_=1048576" in table
    assert "| 3d_zero1 | 2 |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [r["row"] for r in saved["records"]] == ["3d_zero1", "ddp"]


def test_activation_checkpointing_benchmark_writes_its_summary(tmp_path, capsys):
    from lightning_3d.bench import activation_checkpointing as bench

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
        assert f["step_cpu_s_median"] > 0 and f["step_wall_s_median"] > 0 and f["step_wall_vs_none"] > 0


def test_offload_memory_summary_rows_and_ratios(tmp_path):
    """The summary's rows from made-up worker records (the real run takes minutes)."""
    import argparse

    from lightning_3d.bench import offload_memory as bench

    def record(offload, peak, step, checkpointing="none"):
        return {"precision": "32-true", "batch": 4, "seq": 128, "offload": offload, "checkpointing": checkpointing,
                "base_rss_mb": 300.0, "peak_rss_mb": peak, "step_s": step, "cpu_s": step, "num_params": 50_048_256,
                "param_bytes": 200, "grad_bytes": 200, "optimizer_state_bytes": 400 if offload == "none" else 48,
                "activation_bytes_per_block": 1000 if checkpointing == "none" else 100}

    results = [record("none", 1300.0, 6.0), record("nvme", 975.0, 6.6), record("none", 1200.0, 8.0, "full")]
    args = argparse.Namespace(threads=1, rounds=4, path=str(tmp_path), n_layer=12, n_embd=1024)
    summary = bench.summary(results, args)
    assert summary["num_params"] == 50_048_256 and summary["benchmark"] == "offload_memory"
    assert (summary["model"]["n_layer"], summary["model"]["n_embd"], summary["model"]["n_head"]) == (12, 1024, 16)
    none, nvme, full = summary["rows"]
    assert none["peak_rss_vs_none"] == 1.0 and none["step_s_vs_none"] == 1.0
    assert nvme["peak_rss_vs_none"] == pytest.approx(0.75) and nvme["step_s_vs_none"] == pytest.approx(1.1)
    assert nvme["over_base_vs_none"] == pytest.approx(675 / 1000) and nvme["tokens_per_step"] == 512
    assert full["peak_rss_vs_none"] == 1.0  # its own reference: offload=none with checkpointing
    assert full["peak_rss_vs_fp32_none"] == pytest.approx(1200 / 1200)
    assert json.loads(json.dumps(summary)) == summary  # JSON as it is
    assert "| 32-true | nvme | none | 4x128 | 6.60 | 1.10x |" in bench.table(results)
    assert "device peak" not in bench.table(results)  # a CPU run has no device column

    # --accelerator gpu: the device's peak next to offload=none's, and the ZeRO-3 parameter-offload row.
    gpu = [{**record("none", 1300.0, 1.0), "device_peak_mb": 800.0},
           {**record("cpu", 1500.0, 1.2), "device_peak_mb": 300.0},
           {**record("cpu", 1600.0, 1.5), "device_peak_mb": 100.0, "params": True}]
    none, cpu, params = bench.rows(gpu)
    assert none["device_peak_vs_none"] == 1.0 and cpu["device_peak_vs_none"] == pytest.approx(0.375)
    assert params["device_peak_vs_none"] == pytest.approx(0.125) and params["step_s_vs_none"] == pytest.approx(1.5)
    assert "| 32-true | cpu + params (ZeRO-3) | none | 4x128 | 1.50 | 1.50x |" in bench.table(gpu)
    assert bench.table(gpu).splitlines()[2].endswith("| 800 | 1.00x |")
    groups = bench.gpu_groups(bench.default_groups(False))
    assert [(r.offload, r.params) for r in groups["32-true"]][-1] == ("cpu", True)


def test_offload_memory_refuses_gpu_without_cuda(capsys, monkeypatch):
    from lightning_3d.bench import offload_memory as bench

    monkeypatch.setattr(bench, "_cuda_available", lambda: False)  # as on this machine, anywhere
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--accelerator", "gpu"])
    assert exit_.value.code == 2 and "--accelerator gpu needs a CUDA device" in capsys.readouterr().err
