"""``python -m lightning_3d.bench``: bad input, the byte counter, and a two-row quick run (2 gloo ranks)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

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
