"""What the launching process checks before any rank starts, through the real CLI: the data's
size against the batch size and the validation interval, and a run directory whose name Hydra's
override grammar would split.

Before: ``data.batch_size`` above the validation split's windows and an integer
``trainer.val_check_interval`` above an epoch's batches were found by every rank after launch
(exit 1, a traceback per rank); a quoted ``hydra.run.dir`` holding ``,`` or ``=`` was accepted
by the launcher and handed to the ranks unquoted, which refused it (exit 2 after Hydra had
written into the directory). Seen failing with ``app.check_data_sizes`` and ``launch.quoted``
edited out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_3d.app.launch import quoted
from tools.harness.apps import start_app, wait_all

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train.py"
SMALL = ["model=gpt_tiny", "data.max_bytes=100000", "trainer.max_steps=1"]  # 2 ranks, 5000 B val

BAD = {  # id -> (overrides, what the error line names)
    "batch_above_val_split": (
        ["data.batch_size=200"],
        ["data.batch_size=200", "validation split (156 windows"],
    ),
    "val_check_interval_above_epoch": (
        ["trainer.val_check_interval=93"],
        ["trainer.val_check_interval=93", "the 92 batches of an epoch"],
    ),
}


def test_the_data_sizes_are_checked_before_any_rank_starts(tmp_path):
    procs = {
        name: start_app(SCRIPT, [*SMALL, *overrides, f"hydra.run.dir={tmp_path / name}"], tmp_path)
        for name, (overrides, _) in BAD.items()
    }
    done = wait_all(procs, timeout=300)
    for name, (_, named) in BAD.items():
        proc = done[name]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, (
            name,
            proc.returncode,
            proc.stderr[-3000:],
        )
        assert all(words in errors[0] for words in named), errors[0]
        assert "Traceback" not in proc.stderr and "rank" not in errors[0], proc.stderr[-3000:]
        assert not (tmp_path / name).exists()  # refused before anything was written


@pytest.mark.slow  # ~32 s (dp2 training); the fast suite checks the quoting itself (below)
def test_a_quoted_run_directory_with_a_comma_and_an_equals_sign_reaches_the_ranks(tmp_path):
    run_dir = tmp_path / "a,b=c"
    app = start_app(
        SCRIPT,
        [*SMALL, "data.batch_size=4", "trainer.limit_val_batches=0", f'hydra.run.dir="{run_dir}"'],
        tmp_path,
    )
    done = wait_all({"app": app}, timeout=300)["app"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run_dir / "final.ckpt").is_file() and (run_dir / "summary.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a,b=c"]


@pytest.mark.parametrize("path", ["/runs/it's\"quoted", "/runs/back\\'slash", "/runs/ends\\"])
def test_a_run_directory_hydra_cannot_quote_is_refused(path):
    with pytest.raises(ValueError, match="cannot be handed to the ranks"):
        quoted(path)
    assert quoted("/runs/a,b=c d") == "'/runs/a,b=c d'" and quoted("/runs/it's") == '"/runs/it\'s"'
