"""The context-parallelism bench at a tiny shape: the attention's bytes per rank equal the
formulas exactly, activations per rank fall to about 1/cp, the loss is unchanged."""

import pytest

from tools.bench.context import measure, table


def test_context_bench_rows_hold_the_formulas():
    records = measure(64, 2, rows=[(1, "ring"), (2, "ring"), (2, "alltoall")])
    for record in records[1:]:
        assert record["sent_bytes"] == record["formula_bytes"] > 0, record
        ratio = record["activation_bytes"] * record["context"] / records[0]["activation_bytes"]
        assert 1.0 <= ratio < 1.2, record  # the ring's / all-to-all's own saved tensors on top
        assert record["final_loss"] == pytest.approx(records[0]["final_loss"], rel=1e-5)
    assert "| 2 | alltoall |" in table(records)


def test_the_comparison_bench_has_context_rows(tmp_path):
    """``python -m tools.bench --rows 3d_cp2_ring 3d_cp2_alltoall``: bytes sent per step
    against the gradient sync over data × context plus the scheme's attention formula."""
    from tools.bench.__main__ import main

    records = main(
        ["--quick", "--rows", "3d_cp2_ring", "3d_cp2_alltoall", "--outdir", str(tmp_path)]
    )
    for record in records:
        assert record["sent_bytes"] == pytest.approx(record["sent_theory_bytes"], rel=0.01)
        assert record["state_bytes"] == pytest.approx(record["state_formula_bytes"], rel=0.01)
