"""The GPU smoke step (``python -m tools.bench.smoke``, the first step of ``.ci/gpu``):
every case listed, its CPU fall-back runs them and says ``ok`` each, one failing or crashing
case is one ``FAIL`` line and the others still run, and it runs without Hydra / OmegaConf (the
device image has neither)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tools.bench import smoke

ROOT = Path(__file__).resolve().parents[1]
PIDS_ENV = "LIGHTNING3D_SMOKE_TEST_PIDS"  # where planted_child notes its process


# A sitecustomize for the commands below: hydra, omegaconf and antlr4 absent as on the device
# image, where ``find_spec`` says so too (Lightning imports omegaconf when find_spec finds it).
ABSENT = """import sys


class Absent:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf", "antlr4"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Absent)
"""


def blocked_imports(tmp_path: Path) -> dict[str, str]:
    """An environment in which hydra, omegaconf and antlr4 cannot be imported or found, in every
    process the command starts (a ``sys.modules`` entry would not reach the spawned rank)."""
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "sitecustomize.py").write_text(ABSENT)
    path = os.pathsep.join([str(tmp_path / "blocked"), str(ROOT)])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def test_dry_run_lists_every_case_and_runs_nothing(capsys):
    assert smoke.main(["--dry-run", "--accelerator", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(smoke.CASE_NAMES)
    listed = dict(line.split(": ", 1) for line in lines)
    assert "(skip: 16-mixed is a CUDA precision" in listed["fp16_mixed"]
    assert "(skip: needs 2 ranks (" in listed["context2"]
    assert "offload='nvme'" in listed["offload_nvme"] and "offload_path=" in listed["offload_nvme"]
    # the families the issue names, each present
    for name in ("zero0", "zero1", "zero2", "zero3", "offload_cpu", "zero3_offload_params"):
        assert name in smoke.CASE_NAMES
    for name in ("bf16_mixed", "compile", "ac_full", "lora", "qlora", "checkpoint"):
        assert name in smoke.CASE_NAMES


def test_bad_arguments_are_one_error_line(capsys):
    for argv, words in (
        (["--only", "zero9"], "unknown case 'zero9'"),
        (["--accelerator", "tpu"], "--accelerator must be gpu or cpu, got 'tpu'"),
    ):
        try:
            smoke.parse(argv)
        except SystemExit as exit:
            assert exit.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_cpu_fallback_runs_every_case_without_hydra(tmp_path):
    """All cases on the CPU in one command, with ``hydra`` and ``omegaconf`` unimportable in the
    command and in its rank: an ``ok`` line for each case a CPU can run, ``skip`` for the rest,
    exit 0. Catches: a case that breaks on its own, a Hydra import on the smoke's path."""
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench.smoke", "--accelerator", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        env=blocked_imports(tmp_path),
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    status = {m[1]: m[0] for m in re.findall(r"^(ok|FAIL|skip) (\w+)", out.stdout, re.M)}
    assert status == {
        name: "skip" if name in ("fp16_mixed", "context2") else "ok" for name in smoke.CASE_NAMES
    }, out.stdout
    assert re.search(r"^ok zero3 \(\d+\.\d\d s\)$", out.stdout, re.M)
    assert re.search(r"^smoke \(cpu\): 14 ok, 0 failed, 2 skipped in \d+ s$", out.stdout, re.M)


def test_the_module_imports_with_hydra_and_omegaconf_blocked():
    code = (
        "import sys; sys.modules['hydra'] = None; sys.modules['omegaconf'] = None\n"
        "from tools.bench import smoke\n"
        "import lightning_3d.models.hf, lightning_3d.data, lightning_3d.observe.summary\n"
        "sys.exit(smoke.main(['--dry-run', '--accelerator', 'cpu']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("zero0: ")


def planted_child(rank, cases, accelerator, record):
    """``smoke.run_cases`` with two planted faults: a case whose model holds ``plant="cuda"``
    raises a CUDA-like error (the context counts as poisoned), ``plant="exit"`` ends the process
    without a word. Notes this process's id in the file ``PIDS_ENV`` names."""
    with open(os.environ[PIDS_ENV], "a") as pids:
        pids.write(f"{os.getpid()}\n")
    real = smoke.fit_gpt

    def fit(rank, run):
        plant = (run.model or {}).get("plant")
        if plant == "cuda":
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore text")
        if plant == "exit":
            os._exit(3)
        return real(rank, run)

    smoke.fit_gpt = fit  # this child process only
    smoke.run_cases(rank, cases, accelerator, record)


def test_a_failing_or_crashing_case_is_one_line_and_the_others_run(tmp_path, capfd, monkeypatch):
    """Catches: one case's exception hiding the rest, a multi-line error, a CUDA error leaving the
    next cases in a poisoned process, a dead process taking the cases after it with it."""
    monkeypatch.setenv(PIDS_ENV, str(tmp_path / "pids"))
    cases = [
        smoke.Case("zero0", {"zero_stage": 0}),
        smoke.Case("sticky", {}, model={"plant": "cuda"}),
        smoke.Case("zero1", {"zero_stage": 1}),
        smoke.Case("dies", {}, model={"plant": "exit"}),
        smoke.Case("broken", {"zero_stage": 7}),
        smoke.Case("zero2", {"zero_stage": 2}),
    ]
    statuses = smoke.smoke(cases, "cpu", timeout_s=240, child=planted_child)
    assert statuses == {
        "zero0": "ok",
        "sticky": "failed",
        "zero1": "ok",
        "dies": "failed",
        "broken": "failed",
        "zero2": "ok",
    }
    lines = [
        line for line in capfd.readouterr().out.splitlines() if re.match(r"(ok|FAIL|skip) ", line)
    ]
    assert [line.split(":")[0].split(" (")[0] for line in lines] == [
        "ok zero0",
        "FAIL sticky",
        "ok zero1",
        "FAIL dies",
        "FAIL broken",
        "ok zero2",
    ]
    assert lines[1] == (
        "FAIL sticky: RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert lines[3].startswith("FAIL dies: the process running it ended: ")
    assert lines[4] == (
        "FAIL broken: ValueError: invalid parallel layout: zero_stage=7 must be one of [0, 1, 2, 3]"
    )
    # a fresh process after the CUDA-like error and after the death: three in all
    assert len(set((tmp_path / "pids").read_text().split())) == 3


def test_ci_gpu_dry_run_runs_the_smoke_step_first(tmp_path):
    """``bash .ci/gpu --dry-run``: smoke, then tests, bench, planner, ladder, largest, their
    limits within the 600 s a device command may run; ``smoke`` alone runs only it, and its
    command's flags parse here. Catches: the smoke step left out, run late, or over budget."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "WHEELS": str(tmp_path)}

    def dry(*args):
        out = subprocess.run(
            ["bash", str(ROOT / ".ci" / "gpu"), "--dry-run", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr
        return re.findall(r"^=== (\w+) \(timeout (\d+) s, gpu\): (.*)$", out.stdout, re.M)

    steps = dry()
    assert [s[0] for s in steps] == ["smoke", "tests", "bench", "planner", "ladder", "largest"]
    assert sum(int(s[1]) for s in steps) <= 600
    name, limit, command = steps[0]
    assert int(limit) <= 60 and "-m tools.bench.smoke --accelerator gpu" in command
    argv = command.split("-m tools.bench.smoke ", 1)[1].split()
    assert smoke.parse(argv).timeout_s < int(limit)  # its summary prints before the step's limit
    assert [s[0] for s in dry("smoke")] == ["smoke"]
