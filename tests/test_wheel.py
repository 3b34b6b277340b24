"""The wheel, installed in a fresh venv outside the checkout, runs the apps from any directory.

The wheel is built from a copy of the checkout (``pip wheel --no-index --no-build-isolation``:
offline, nothing written into the checkout), installed with ``--no-deps`` into a new venv that
sees this venv's dependencies through a folder of links to them, the editable install of
``lightning_3d`` (its finder ``.pth``, its ``dist-info``) left out, so the only ``lightning_3d`` it
can import is the wheel's. Every command runs in a temporary directory, never the checkout.
Before: the wheel's planner exited 2 with "Primary config directory not found" (the configs were
``conf/`` at the repository root) and the Hydra apps existed only as ``examples/*.py``.

Fast (~25 s on 2 CPU cores): the wheel's files, the console scripts, and the planner with
``validate=true``. Slow (~95 s on 2 CPU cores): the main job (the README's first command, 2 steps), the fine-tune
from its ``final.ckpt``, ``export-hf`` of a tiny Hugging Face model's run, and
``python -m lightning_3d.adapters`` on a tiny LoRA fine-tune's checkpoint.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the copy the wheel is built from leaves out: run outputs, caches, this venv.
NOT_SOURCE = (".venv", ".git", "outputs", "multirun", "bench_out", "build", "*.egg-info")
CACHES = ("__pycache__", ".ruff_cache", ".benchmarks", "lightning_logs", ".pytest_cache")
# This venv's entries the new one must not see: the checkout's editable install of lightning_3d.
EDITABLE = ("__editable__", "lightning_3d", "lightning-3d")


def _describe(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SOURCE, *CACHES))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps"]
        + ["--no-build-isolation", "-w", str(root / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, _describe(done)
    (found,) = (root / "dist").glob("lightning_3d-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; this venv's dependencies seen through links."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    deps = root / "deps"
    deps.mkdir()
    paths = sysconfig.get_paths()
    for site in dict.fromkeys([paths["purelib"], paths["platlib"]]):
        for entry in Path(site).iterdir():
            if entry.name.startswith(EDITABLE) or entry.suffix == ".pth":
                continue
            if not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    python = root / "venv" / "bin" / "python"
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root
    )
    # A path line in a .pth adds that folder only: its own .pth files (the editable finder) are not run.
    (Path(purelib.stdout.strip()) / "deps.pth").write_text(f"{deps}\n")
    _run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)], root)
    return root / "venv"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in (
        "PYTHONPATH",
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "SLURM_PROCID",
        "HYDRA_FULL_ERROR",
    ):
        env.pop(key, None)
    return env


def _run(command, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{' '.join(map(str, command))}: {_describe(done)}"
    return done


def _start(command, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(c) for c in command],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert done.returncode == 0, f"{' '.join(proc.args)}: {_describe(done)}"
    return done


def test_the_wheel_holds_the_package_and_its_configs_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"lightning_3d", "lightning_3d-0.1.0.dist-info"}  # no tools/, tests/, examples/
    configs = {n.removeprefix("lightning_3d/app/conf/") for n in names if n.endswith(".yaml")}
    shipped = {
        str(p.relative_to(REPO / "lightning_3d/app/conf"))
        for p in (REPO / "lightning_3d/app/conf").rglob("*.yaml")
    }
    assert (
        configs == shipped
        and {"train.yaml", "finetune.yaml", "plan.yaml", "model/hf.yaml"} <= configs
    )
    entry_points = (
        zipfile.ZipFile(wheel).read("lightning_3d-0.1.0.dist-info/entry_points.txt").decode()
    )
    for script in ("lightning3d-train", "lightning3d-finetune", "lightning3d-plan"):
        assert f"{script} = " in entry_points


def test_the_venv_imports_the_wheel_not_the_checkout(venv, tmp_path):
    done = _run(
        [venv / "bin/python", "-c", "import lightning_3d; print(lightning_3d.__file__)"], tmp_path
    )
    assert Path(done.stdout.strip()).is_relative_to(venv), done.stdout
    for script in ("lightning3d-train", "lightning3d-finetune", "lightning3d-plan"):
        assert (venv / "bin" / script).is_file()


def test_the_planner_validates_from_the_wheel(venv, tmp_path):
    """``validate=true`` on a tiny model, by the console script and the ``python -m`` door."""
    plan = ["model=gpt_tiny", "cluster=workstation_24gb", "validate=true"]
    for command in (
        [venv / "bin/lightning3d-plan"],
        [venv / "bin/python", "-m", "lightning_3d.planner"],
    ):
        done = _run([*command, *plan], tmp_path)
        assert "validation: every rank kind matches the prediction" in done.stdout, done.stdout


# ---------------------------------------------------------------- the apps, end to end (slow)

WORDS = "the quick brown fox jumps over a lazy dog while seven small cats watch".split()
ONE_PROCESS = [
    "trainer.devices=1",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "data.block_size=16",
    "data.batch_size=4",
]


def _hf_model(directory: Path) -> None:
    """A tiny random Llama with a word-level tokenizer: a model directory, no download."""
    pytest.importorskip("peft")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    HFCausalLM(config=tiny_hf_config("llama", vocab_size=32)).model.save_pretrained(directory)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"])
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(directory)


@pytest.mark.slow
def test_the_apps_and_exports_run_from_the_wheel(venv, tmp_path):
    """The main job (2 ranks, ``python -m``), the fine-tune of its ``final.ckpt`` (console
    script), a Hugging Face run (2 ranks, console script) exported with ``export-hf``, a LoRA fine-tune exported with
    ``python -m lightning_3d.adapters``: each exits 0 and writes what it names."""
    pytest.importorskip("transformers")
    python = venv / "bin/python"
    model, corpus = tmp_path / "model", tmp_path / "corpus"
    model.mkdir()
    corpus.mkdir()
    _hf_model(model)
    text = [" ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(12)) for i in range(200)]
    (corpus / "a.txt").write_text("\n".join(text) + "\n")
    hf = ["model=hf", f"model.path={model}", "data=text", f"data.path={corpus}", *ONE_PROCESS]
    # The console script starts its second rank by running itself again (app/launch.py).
    two_ranks = [a.replace("trainer.devices=1", "trainer.devices=2") for a in hf]
    runs = tmp_path / "runs"
    # The main job: the README's first command (python examples/train.py), 2 steps.
    main_job = _start([python, "-m", "lightning_3d.app.train", "trainer.max_steps=2"], tmp_path)
    hf_train = _start(
        [venv / "bin/lightning3d-train", *two_ranks, f"hydra.run.dir={runs / 'hf'}"], tmp_path
    )
    lora = [*hf, "adapter=lora", "offload=none", f"hydra.run.dir={runs / 'lora'}"]
    lora_run = _start([venv / "bin/lightning3d-finetune", *lora], tmp_path)
    _wait(main_job)
    (pretrained,) = (tmp_path / "outputs").glob("*/*/final.ckpt")
    # The fine-tune: finetune.pretrained=latest finds the main job's final.ckpt under ./outputs.
    finetune = [
        venv / "bin/lightning3d-finetune",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
    ]
    done = _run(
        [*finetune, "trainer.limit_val_batches=1", f"hydra.run.dir={runs / 'finetune'}"],
        tmp_path,
        600,
    )
    assert f"fine-tuning from {pretrained}" in done.stdout, done.stdout
    assert (runs / "finetune" / "final.ckpt").is_file()
    _wait(hf_train)
    export = [python, "-m", "lightning_3d.checkpoint", "export-hf", runs / "hf" / "final.ckpt"]
    _run([*export, tmp_path / "hf_out", "--tokenizer", model], tmp_path)
    assert (tmp_path / "hf_out" / "config.json").is_file()
    assert (tmp_path / "hf_out" / "model.safetensors").is_file()
    assert (tmp_path / "hf_out" / "tokenizer.json").is_file()
    _wait(lora_run)
    _run(
        [python, "-m", "lightning_3d.adapters", runs / "lora" / "final.ckpt", tmp_path / "adapter"],
        tmp_path,
    )
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
