"""End to end through the Hydra CLI (``python examples/train.py ...``), as a user runs it."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "examples/train.py"
# Small and fast: tiny model, a 300 kB corpus, a global batch of 8.
SMALL = [
    "model=gpt_tiny",
    "data.batch_size=8",
    "data.max_bytes=300000",
    "trainer.limit_val_batches=2",
]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A stray launcher variable would make the app think it is a rank already; a set
    # HYDRA_FULL_ERROR would turn Hydra's one-paragraph errors into tracebacks.
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_PROCID", "HYDRA_FULL_ERROR"):
        env.pop(key, None)
    return env


def _start(args):
    return subprocess.Popen(
        [sys.executable, SCRIPT, *args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(args, timeout):
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _describe(proc):
    return f"exit {proc.returncode}\n--- stdout (tail)\n{proc.stdout[-3000:]}\n--- stderr (tail)\n{proc.stderr[-3000:]}"


# ------------------------------------------------------------------ bad input
# (overrides, exit code, substrings the error must contain)
BAD = {
    "tensor_does_not_divide_world": (
        ["parallelism.tensor=2", "trainer.devices=3"],
        2,
        ["tensor(2)", "world size 3"],
    ),
    "zero_stage_out_of_range": (["parallelism.zero_stage=7"], 2, ["zero_stage=7", "[0, 1, 2, 3]"]),
    "batch_not_divisible": (["data.batch_size=30", "trainer.devices=4"], 2, ["(30)", "(4)"]),
    "data_zero": (["parallelism.data=0"], 2, ["data=0"]),
    "tensor_does_not_divide_heads": (
        [
            "model=gpt_tiny",
            "model.n_head=3",
            "model.n_embd=48",
            "parallelism.tensor=2",
            "trainer.devices=2",
        ],
        2,
        ["heads 3", "tensor=2"],
    ),
    "unknown_key": (
        ["parallelism.foo=1"],
        2,
        ["parallelism.foo"],
    ),  # Hydra's own error, also one line
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Run every bad-input case at once (each is ~8 s of imports, nothing else)."""
    started = {}
    for name, (overrides, _, _) in BAD.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"  # does not exist yet: Hydra makes it
        started[name] = (run_dir, _start([*overrides, f"hydra.run.dir={run_dir}"]))
    finished = {}
    try:
        for name, (run_dir, proc) in started.items():
            stdout, stderr = proc.communicate(timeout=180)
            finished[name] = (
                run_dir,
                subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
            )
    finally:
        for _, proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return finished


@pytest.mark.parametrize("case", list(BAD))
def test_cli_bad_input(case, bad_runs):
    _, expected_code, named = BAD[case]
    run_dir, proc = bad_runs[case]
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, _describe(proc)
    if expected_code is not None:
        assert proc.returncode == expected_code, _describe(proc)
    assert "Traceback" not in output, _describe(proc)
    if expected_code == 2:  # our validation: the run directory Hydra made is removed again
        assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    assert not (run_dir / "summary.json").exists()
    assert not (run_dir / "lightning_logs").exists()  # no rank ever started
    error_lines = [line for line in output.splitlines() if "error:" in line]
    assert len(error_lines) == 1, _describe(proc)
    assert error_lines[0].startswith("error: ")
    assert error_lines[0] in proc.stderr
    for part in named:
        assert part in error_lines[0], _describe(proc)


# ------------------------------------------------------------------ a real run
@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory):
    """Two ranks, ZeRO-2, no activation checkpointing (the default): the run and its directory."""
    run_dir = tmp_path_factory.mktemp("zero2")
    proc = _run(
        [
            *SMALL,
            "trainer.max_steps=12",
            "trainer.devices=2",
            "parallelism.zero_stage=2",
            "trainer.val_check_interval=6",
            f"hydra.run.dir={run_dir}",
        ],
        timeout=300,
    )
    return run_dir, proc


def test_cli_real_run_zero2(zero2_run):
    tmp_path, proc = zero2_run
    assert proc.returncode == 0, _describe(proc)
    assert "Traceback" not in proc.stderr, _describe(proc)
    assert "done:" in proc.stdout, _describe(proc)
    summary_path = tmp_path / "summary.json"
    assert f"summary: {summary_path}" in proc.stdout
    summary = json.loads(summary_path.read_text())

    layout = summary["layout"]
    assert layout["world_size"] == 2
    assert layout["data"] == 2
    assert layout["tensor"] == 1 and layout["pipeline"] == 1
    assert layout["zero_stage"] == 2
    assert layout["strategy"] == "ThreeDStrategy"

    losses = summary["losses"]
    assert len(losses) == 12
    assert summary["steps"] == 12
    assert all(isinstance(x, float) and math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert summary["tokens_per_s"] > 0

    ranks = summary["ranks"]
    assert len(ranks) == 2
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for rank in ranks:
        for key in (
            "peak_rss_mb",
            "param_bytes",
            "grad_bytes",
            "optimizer_state_bytes",
            "activation_bytes_per_block",
        ):
            assert rank[key] > 0, (key, rank)
        # gpt_tiny: 2 blocks.
        assert rank["blocks_on_rank"] == 2 and rank["checkpointed_blocks"] == 0, rank
    # One summary per job: the ranks write into the job directory, rank 0 only.
    assert sorted(p.name for p in tmp_path.glob("**/summary.json")) == ["summary.json"]


def test_cli_full_activation_checkpointing_saves_less_per_block(zero2_run, tmp_path):
    """One process with the zero2 run's per-rank batch (4 x 32 tokens), every block checkpointed:
    each block keeps only its input (4 x 32 x n_embd 32 x 4 bytes), far less than without."""
    proc = _run(
        [
            *SMALL,
            "data.batch_size=4",
            "trainer.devices=1",
            "trainer.max_steps=1",
            "trainer.limit_val_batches=0",
            "parallelism.ac_policy=full",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=180,
    )
    assert proc.returncode == 0, _describe(proc)
    (full,) = json.loads((tmp_path / "summary.json").read_text())["ranks"]
    none = json.loads((zero2_run[0] / "summary.json").read_text())["ranks"][0]
    assert full["checkpointed_blocks"] == full["blocks_on_rank"] == 2, full
    assert full["activation_bytes_per_block"] == 4 * 32 * 32 * 4, full
    assert full["activation_bytes_per_block"] * 5 < none["activation_bytes_per_block"], (full, none)


# ------------------------------------------------------------------ a -m sweep
def test_cli_sweep_zero_stages(tmp_path):
    proc = _run(
        [
            "-m",
            "parallelism.zero_stage=0,3",
            *SMALL,
            "trainer.max_steps=3",
            "trainer.devices=2",
            "trainer.val_check_interval=3",
            f"hydra.sweep.dir={tmp_path}",
        ],
        timeout=400,
    )
    assert proc.returncode == 0, _describe(proc)
    assert proc.stdout.count("done:") == 2, _describe(proc)
    for job, stage in ((0, 0), (1, 3)):
        summary = json.loads((tmp_path / str(job) / "summary.json").read_text())
        assert summary["layout"]["zero_stage"] == stage
        assert summary["layout"]["world_size"] == 2
        assert summary["steps"] == 3
        assert all(math.isfinite(x) for x in summary["losses"])
    # Each job ran only its own overrides: no nested sweep directories, no third job.
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0", "1"]
