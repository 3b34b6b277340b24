"""The whole family matrix: every decoder family of the installed ``transformers`` that ships
a plan (and GPT-2, StableLM) under every layout of ``lightning_3d.testing.hf_matrix``: none may
differ from one process or crash; what a layout cannot run is refused. About 20 minutes on 2
cores: ``pytest -m slow tests/test_hf_matrix.py``, or ``python -m lightning_3d.testing.hf_matrix``
for the table (docs/hugging-face.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_no_family_differs_from_one_process_under_any_layout(capsys):
    from lightning_3d.testing.hf_matrix import main

    code = main([])
    table = capsys.readouterr().out
    assert code == 0, table
    assert "| `qwen3` | ok | ok | ok | ok | ok | ok |" in table


def test_matrix_cells_name_what_is_wrong():
    from lightning_3d.testing.hf_matrix import Cell, table

    rows = {"a": (None, {"tp2": Cell("ok"), "pp2_eager": Cell("refused", "why")}),
            "b": ("tiny config not buildable (x)", {})}
    text = table(rows, ["tp2", "pp2_eager"])
    assert "| `a` | ok | refused |" in text and "- `a` pp2_eager: refused: why" in text
    assert "- `b`: tiny config not buildable (x)" in text
