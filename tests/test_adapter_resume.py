"""Resuming LoRA and QLoRA runs through the Hydra app (``adapter=lora|qlora``), and a base-vs-
adapter mismatch said as such before launch.

An adapter run's checkpoints hold only the adapters and their optimizer state
(``adapters/checkpoint.py``); the app's pre-launch fit check compared them with every name of
the model, so no LoRA run could be resumed (``resume=last``, ``resume=PATH``, the line a
preempted run prints): exit 2, "missing from the checkpoint (21): model.lm_head.weight, ...
base_layer.weight". The same list stood for a checkpoint resumed without ``adapter=lora``, with
another ``r`` or targets, and for ``export-hf`` of an adapter checkpoint. A QLoRA model is not
built on meta, so nothing of its checkpoint was checked before launch: a mismatch reached the
ranks.

The runs: ``A`` (N steps in one go, no checkpoint), ``B1`` (K steps, ``last.ckpt`` at K) and
``B2`` (B1's checkpoint resumed to N) for LoRA (consolidated, ``resume=last``) and QLoRA
(``parallelism.checkpoint_format=sharded``, ``resume=PATH``), one process each; ``B1 + B2``
must equal ``A``: losses and final adapters. ``model.max_steps`` pins the LR schedule to N in
every part. QLoRA's NF4 base is not in its checkpoint: the resumed run rebuilds it from the
model directory, and its losses equal A's only if that base is A's. A tiny Llama directory wide
enough for NF4 (``support/qlora.py``), byte data, no downloads. Other layouts (QLoRA one
process to dp2 ZeRO-1; LoRA sharded, dp2 ZeRO-1 to one process) and a real SIGTERM's printed
``resume=`` line: ``-m slow``.
"""

from __future__ import annotations

import json
import shlex
import signal
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("torchao")

from lightning_3d.adapters import is_adapter_name  # noqa: E402
from support.qlora import WIDE  # noqa: E402
from tools.harness.apps import compose_config, start_app, wait_all  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train.py"
N, K = 4, 2
TIMEOUT = 400
SHARDED = "parallelism.checkpoint_format=sharded"


def _args(model: Path, adapter: str, *extra: str) -> list[str]:
    """One process, byte data, ``model.max_steps`` pinned to N (the LR schedule of one run)."""
    return [
        "model=hf",
        f"model.path={model}",
        *([f"adapter={adapter}"] if adapter else []),
        "data.batch_size=4",
        "data.max_bytes=100000",
        "data.block_size=32",
        "trainer.limit_val_batches=0",
        f"model.max_steps={N}",
        "trainer.devices=1",
        *extra,
    ]


def _describe(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def _run_dirs(cwd: Path) -> list[Path]:
    return sorted((cwd / "outputs").glob("*/*"))


def _losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / "summary.json").read_text())["losses"]


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model part of ``final.ckpt`` (a directory of shards under ``checkpoint_format=sharded``)."""
    from lightning_3d.checkpoint.checks import read_tensors

    return read_tensors(run_dir / "final.ckpt")[1]


def _assert_same_run(whole: Path, parts: list[Path], rel: float = 1e-6, atol: float = 1e-7):
    """The parts' losses, one after another, are the whole run's; the final adapters equal."""
    losses = [loss for part in parts for loss in _losses(part)]
    assert losses == pytest.approx(_losses(whole), rel=rel, abs=0)
    a, b = _final(whole), _final(parts[-1])
    assert a.keys() == b.keys() and len(a) == 28 and all(map(is_adapter_name, a))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=rel, atol=atol, msg=name)


def _one_error_line(proc) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, _describe(proc)
    assert "Traceback" not in output and "Initializing distributed" not in output, _describe(proc)
    lines = [line for line in output.splitlines() if "error:" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("error: "), _describe(proc)
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The model directory and a whole model's checkpoint of it (no adapter: what a full
    fine-tune saves, its weights under the module's names)."""
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    root = tmp_path_factory.mktemp("adapter_resume")
    torch.manual_seed(0)
    HFCausalLM(config=tiny_hf_config("llama", **WIDE)).model.save_pretrained(root / "model")
    full = HFCausalLM(path=str(root / "model"), deferred_init=False)
    state = {"state_dict": full.state_dict(), "global_step": K, "loops": {}}
    torch.save({**state, "optimizer_states": [], "epoch": 0}, root / "full.ckpt")
    return {"root": root, "model": root / "model", "full": root / "full.ckpt"}


# The CLI cases: id -> (overrides beside the model's, the checkpoint, substrings of the error).
CLI = {
    "lora_checkpoint_without_adapter": (
        [],
        "lora",
        [
            "this is an adapter checkpoint (method lora, r=8, targets all-linear)",
            "resume with adapter=lora model.adapter.r=8 model.adapter.target_modules=all-linear",
            "python -m lightning_3d.adapters CKPT DIR [--merged]",
        ],
    ),
    "lora_checkpoint_with_another_r": (
        ["adapter=lora", "model.adapter.r=4"],
        "lora",
        [
            "the checkpoint's adapter (method lora, r=8, targets all-linear) is not this run's "
            "(method lora, r=4, targets all-linear)",
            "model.adapter.r=8",
        ],
    ),
    "full_checkpoint_with_adapter": (
        ["adapter=lora"],
        "full",
        [
            "this is a full model's checkpoint (no adapter), but the run has adapter=lora",
            "adapter=none",
            "finetune.pretrained=CKPT",
        ],
    ),
}


@pytest.fixture(scope="module")
def runs(files):
    """A and B1 of LoRA and QLoRA at once; then both B2 and the CLI mismatch cases at once.
    Returns the working directories and the finished processes."""
    model, root = files["model"], files["root"]
    cwd = {name: root / name for name in ("lora_a", "lora_b", "qlora_a", "qlora_b", "bad")}
    for path in cwd.values():
        path.mkdir()
    whole = [f"trainer.max_steps={N}", "checkpoint.every_n_steps=null"]
    part = [f"trainer.max_steps={K}", f"checkpoint.every_n_steps={K}"]
    done = wait_all(
        {
            "lora_a": start_app(SCRIPT, _args(model, "lora", *whole), cwd["lora_a"]),
            "lora_b1": start_app(SCRIPT, _args(model, "lora", *part), cwd["lora_b"]),
            "qlora_a": start_app(SCRIPT, _args(model, "qlora", SHARDED, *whole), cwd["qlora_a"]),
            "qlora_b1": start_app(SCRIPT, _args(model, "qlora", SHARDED, *part), cwd["qlora_b"]),
        },
        timeout=TIMEOUT,
    )
    for name in ("lora_b1", "qlora_b1"):
        assert done[name].returncode == 0, _describe(done[name])
    checkpoints = {
        "lora": _run_dirs(cwd["lora_b"])[0] / "last.ckpt",
        "qlora": _run_dirs(cwd["qlora_b"])[0] / "last.ckpt",
        "full": files["full"],
    }
    resumed = [f"trainer.max_steps={N}"]
    second = {
        "lora_b2": start_app(SCRIPT, _args(model, "lora", *resumed, "resume=last"), cwd["lora_b"]),
        "qlora_b2": start_app(
            SCRIPT,
            _args(model, "qlora", SHARDED, *resumed, f"resume={checkpoints['qlora']}"),
            cwd["qlora_b"],
        ),
    }
    for case, (overrides, checkpoint, _) in CLI.items():
        args = [*_args(model, "", *overrides, *resumed), f"resume={checkpoints[checkpoint]}"]
        second[case] = start_app(SCRIPT, [*args, f"hydra.run.dir={cwd['bad'] / case}"], cwd["bad"])
    done.update(wait_all(second, timeout=TIMEOUT))
    return cwd, checkpoints, done


def test_a_lora_run_resumed_with_resume_last_continues_exactly(runs):
    """Catches: the pre-launch check refusing every LoRA checkpoint for the base weights it
    deliberately leaves out ("missing from the checkpoint (21): ... base_layer.weight")."""
    cwd, checkpoints, done = runs
    assert done["lora_b2"].returncode == 0, _describe(done["lora_b2"])
    assert done["lora_a"].returncode == 0, _describe(done["lora_a"])
    b1_dir, b2_dir = _run_dirs(cwd["lora_b"])
    output = done["lora_b2"].stdout + done["lora_b2"].stderr
    assert f"Restoring states from the checkpoint path at {checkpoints['lora']}" in output
    assert [len(_losses(d)) for d in (b1_dir, b2_dir)] == [K, N - K]
    _assert_same_run(_run_dirs(cwd["lora_a"])[0], [b1_dir, b2_dir])


def test_a_sharded_qlora_checkpoint_resumed_by_path_continues_exactly_on_the_same_base(runs):
    """Guards: a resumed run whose rebuilt NF4 base is not the first run's (its losses would
    leave A's from the first resumed step), and the pre-launch check now made for QLoRA runs
    (their adapter record against the run's) letting a matching checkpoint through. It passed
    before the fix: a QLoRA model is not built on meta, so nothing of its checkpoint was
    checked before launch."""
    cwd, checkpoints, done = runs
    assert done["qlora_b2"].returncode == 0, _describe(done["qlora_b2"])
    assert done["qlora_a"].returncode == 0, _describe(done["qlora_a"])
    assert checkpoints["qlora"].is_dir()  # sharded: a directory of shards
    b1_dir, b2_dir = _run_dirs(cwd["qlora_b"])
    assert [len(_losses(d)) for d in (b1_dir, b2_dir)] == [K, N - K]
    _assert_same_run(_run_dirs(cwd["qlora_a"])[0], [b1_dir, b2_dir])


@pytest.mark.parametrize("case", list(CLI))
def test_a_base_vs_adapter_mismatch_is_one_error_line_before_launch(case, runs):
    """Catches: each of these refused with 21 base weights listed as "missing" instead of what
    is wrong (the checkpoint's adapter and the run's, both named)."""
    cwd, checkpoints, done = runs
    line = _one_error_line(done[case])
    assert line.startswith(f"error: resume={checkpoints[CLI[case][1]]}: "), line
    for part in CLI[case][2]:
        assert part in line, line
    assert "missing from the checkpoint" not in line, line
    assert not (cwd["bad"] / case).exists()  # no run directory left behind
    assert _run_dirs(cwd["bad"]) == []


def test_every_mismatch_is_named_in_the_launching_process(runs, files):
    """validate() (in process) for what the command line shows above and the rest: other
    targets, a QLoRA checkpoint into LoRA or no adapter, a LoRA or full checkpoint into QLoRA
    (a model not built on meta: before, nothing of its checkpoint was checked before launch);
    the matching options pass."""
    from lightning_3d.app.run import validate

    _, checkpoints, _ = runs
    model = files["model"]

    def refused(checkpoint: str, *overrides: str) -> str:
        cfg = compose_config(
            "train", *_args(model, "", *overrides), f"resume={checkpoints[checkpoint]}"
        )
        with pytest.raises(ValueError) as caught:
            validate(cfg)
        assert "missing from the checkpoint" not in str(caught.value)
        return str(caught.value)

    validate(compose_config("train", *_args(model, "lora"), f"resume={checkpoints['lora']}"))
    for case, (overrides, checkpoint, named) in CLI.items():
        message = refused(checkpoint, *overrides)
        assert all(part in message for part in named), (case, message)
    message = refused("lora", "adapter=lora", "model.adapter.target_modules=[q_proj,v_proj]")
    assert (
        "(method lora, r=8, targets all-linear) is not this run's (method lora, r=8, targets "
        "[q_proj,v_proj])" in message
    ), message
    message = refused("qlora", "adapter=lora")
    assert "(method qlora, r=8, targets all-linear) is not this run's (method lora" in message
    assert "adapter=qlora" in message, message
    message = refused("qlora")
    assert "this is an adapter checkpoint (method qlora, r=8, targets all-linear)" in message
    # adapter=qlora: the model is not built on meta (its base is quantized as it is built), so
    # only the adapter records are compared before launch
    validate(compose_config("train", *_args(model, "qlora"), f"resume={checkpoints['qlora']}"))
    message = refused("lora", "adapter=qlora")
    assert "(method lora, r=8, targets all-linear) is not this run's (method qlora" in message
    message = refused("full", "adapter=qlora")
    assert (
        "this is a full model's checkpoint (no adapter), but the run has adapter=qlora" in message
    )


@pytest.mark.parametrize("checkpoint", ["lora", "qlora"])
def test_export_hf_of_an_adapter_checkpoint_names_the_adapter_export(
    runs, tmp_path, capsys, checkpoint
):
    """Catches: ``export-hf`` of a LoRA ``.ckpt`` / sharded QLoRA checkpoint failing on 21
    "missing" base weights instead of saying it is an adapter checkpoint and which command
    exports it."""
    from lightning_3d.checkpoint.__main__ import main

    _, checkpoints, _ = runs
    path = checkpoints[checkpoint]
    assert main(["export-hf", str(path), str(tmp_path / "out")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"error: {path} is an adapter checkpoint (method {checkpoint}, r=8, targets all-linear)"
    ), lines[0]
    assert f"python -m lightning_3d.adapters {path} DIR [--merged]" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ other layouts (slow)
@pytest.mark.slow
def test_a_sharded_qlora_checkpoint_of_one_process_resumes_on_dp2_zero1(runs, files, tmp_path):
    """QLoRA's B1 (one process, sharded) resumed on two data ranks with ZeRO-1, the global batch
    unchanged: A's losses and adapters up to the reduction order (each rank rebuilds the NF4
    base from the directory)."""
    cwd, checkpoints, _ = runs
    args = _args(
        files["model"], "qlora", SHARDED, f"trainer.max_steps={N}", f"resume={checkpoints['qlora']}"
    )
    args[args.index("trainer.devices=1")] = "trainer.devices=2"
    proc = wait_all(
        {"b2": start_app(SCRIPT, [*args, "parallelism.zero_stage=1"], tmp_path)}, timeout=TIMEOUT
    )["b2"]
    assert proc.returncode == 0, _describe(proc)
    (b2_dir,) = _run_dirs(tmp_path)
    assert json.loads((b2_dir / "summary.json").read_text())["layout"]["world_size"] == 2
    _assert_same_run(
        _run_dirs(cwd["qlora_a"])[0], [_run_dirs(cwd["qlora_b"])[0], b2_dir], rel=1e-5, atol=1e-6
    )


@pytest.mark.slow
def test_a_sharded_lora_checkpoint_of_dp2_zero1_resumes_in_one_process(runs, files, tmp_path):
    """LoRA's B1 on two data ranks with ZeRO-1, sharded, then ``resume=last`` in one process:
    A's losses and adapters up to the reduction order. Catches: the pre-launch check refusing
    a sharded LoRA checkpoint (its metadata names the adapters only)."""
    cwd, _, _ = runs
    model = files["model"]
    first = _args(model, "lora", SHARDED, f"trainer.max_steps={K}", f"checkpoint.every_n_steps={K}")
    first[first.index("trainer.devices=1")] = "trainer.devices=2"
    b1 = wait_all(
        {"b1": start_app(SCRIPT, [*first, "parallelism.zero_stage=1"], tmp_path)}, timeout=TIMEOUT
    )["b1"]
    assert b1.returncode == 0, _describe(b1)
    b2 = wait_all(
        {
            "b2": start_app(
                SCRIPT,
                _args(model, "lora", SHARDED, f"trainer.max_steps={N}", "resume=last"),
                tmp_path,
            )
        },
        timeout=TIMEOUT,
    )["b2"]
    assert b2.returncode == 0, _describe(b2)
    b1_dir, b2_dir = _run_dirs(tmp_path)
    assert (b1_dir / "last.ckpt").is_dir()
    _assert_same_run(_run_dirs(cwd["lora_a"])[0], [b1_dir, b2_dir], rel=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_preempted_lora_run_resumes_from_the_line_it_prints(runs, files, tmp_path):
    """SIGTERM once the run has taken a step: it saves ``preempted.ckpt`` and prints
    ``resume with: python examples/train.py ... resume=<preempted.ckpt>``; that command, as
    printed (``trainer.max_steps`` set to N), continues to A's losses and adapters. Catches: the
    printed line itself refused before launch for the adapter checkpoint it names."""
    cwd, _, _ = runs
    run_dir = tmp_path / "stopped"
    # Many steps, so the signal lands well before the end; model.max_steps keeps A's schedule.
    args = _args(files["model"], "lora", "trainer.max_steps=50", "checkpoint.every_n_steps=1")
    proc = start_app(SCRIPT, [*args, f"hydra.run.dir={run_dir}"], tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "last.ckpt").exists():  # step 1 saved: the handlers are installed
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and (run_dir / "preempted.ckpt").is_file(), stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if "resume with: " in line]
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[-1] == f"resume={run_dir / 'preempted.ckpt'}", command
    saved = torch.load(run_dir / "preempted.ckpt", map_location="cpu", weights_only=True)
    step = saved["global_step"]
    assert 1 <= step < N, f"stopped at step {step}: too late to compare with A's {N} steps"
    assert all(map(is_adapter_name, saved["state_dict"])), "the preemption saved the base"
    resumed = [
        f"trainer.max_steps={N}" if arg.startswith("trainer.max_steps=") else arg
        for arg in command[2:]  # python, the script
    ]
    (tmp_path / "resumed").mkdir()
    proc = wait_all({"b2": start_app(SCRIPT, resumed, tmp_path / "resumed")}, timeout=TIMEOUT)["b2"]
    assert proc.returncode == 0, _describe(proc)
    (b2_dir,) = _run_dirs(tmp_path / "resumed")
    a_dir = _run_dirs(cwd["lora_a"])[0]
    assert _losses(b2_dir) == pytest.approx(_losses(a_dir)[step:], rel=1e-6, abs=0)
    a, b = _final(a_dir), _final(b2_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)
