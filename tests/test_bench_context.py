"""The context-parallelism bench at a tiny shape: the attention's bytes per rank equal the
formulas exactly, activations per rank fall to about 1/cp, the loss is unchanged."""

import pytest

from lightning_3d.bench.context import measure, table


def test_context_bench_rows_hold_the_formulas():
    records = measure(64, 2, rows=[(1, "ring"), (2, "ring"), (2, "alltoall")])
    for record in records[1:]:
        assert record["sent_bytes"] == record["formula_bytes"] > 0, record
        ratio = record["activation_bytes"] * record["context"] / records[0]["activation_bytes"]
        assert 1.0 <= ratio < 1.2, record  # the ring's / all-to-all's own saved tensors on top
        assert record["final_loss"] == pytest.approx(records[0]["final_loss"], rel=1e-5)
    assert "| 2 | alltoall |" in table(records)
