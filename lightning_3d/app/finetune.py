"""The fine-tune app (``lightning3d-finetune``, ``python -m lightning_3d.app.finetune``, from a
checkout ``python examples/finetune.py``): train from pretrained weights on one workstation.

The preset (``conf/finetune.yaml`` in this package) is the main job's, with one process, NVMe offload,
activation checkpointing and bf16; what this module adds is *where the weights come from*:

1. :func:`resolve_pretrained` turns ``finetune.pretrained`` (a path, or ``"latest"``) into a file
   (a model that brings its own weights, ``model=hf model.path=DIR``, starts from those instead,
   see :func:`prepare`);
2. :func:`check_pretrained` compares that file with the configured model, built on ``meta``
   (nothing is allocated), so a wrong file ends the app with one ``error:`` line before any work;
3. :func:`finetune` (every rank) runs :func:`lightning_3d.app.run.train` with the model built and the
   weights loaded *before* ``trainer.fit`` — the strategy then shards and offloads them like any
   others — and records the file in ``summary.json``.

Example::

    lightning3d-train trainer.devices=1         # pretrain: writes outputs/<date>/<time>/final.ckpt
    lightning3d-finetune                        # newest final.ckpt, offload=nvme under $TMPDIR
    lightning3d-finetune offload=cpu finetune.pretrained=gpt.safetensors
    lightning3d-finetune offload.path=/mnt/nvme trainer.max_steps=500
    lightning3d-finetune model=hf model.path=/models/qwen2-0.5b data=text data.path=notes/ offload=cpu
    lightning3d-finetune model=hf model.path=DIR data=chat data.path=chats.jsonl
    lightning3d-finetune resume=last            # continue the newest fine-tune run (outputs/finetune/)

Writes summary.json (as the training app, plus the pretrained file), last.ckpt and final.ckpt to
the run directory, outputs/finetune/<date>/<time>. A Hugging Face model directory (``model=hf
model.path=DIR``) brings its own weights and tokenizer (``data=text``: local .txt / .jsonl
files). A missing or mismatched pretrained file, model directory, tokenizer or text ends the app
with one ``error:`` line and exit code 2, before any work (so does a bad command line, see
:mod:`lightning_3d.app.cli`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_3d.app.spec import RunSpec
from lightning_3d.checkpoint.resume import FINETUNE_RUNS
from lightning_3d.options import hydra_group_values

LATEST = "latest"
# This module's importable name, also where ``python -m`` runs it as ``__main__``: Hydra's
# ``_target_`` imports it by this name.
_MODULE = "lightning_3d.app.finetune"


def resolve_pretrained(value: str, project_dir: str | Path) -> Path:
    """The pretrained file ``value`` names: a path (relative to ``project_dir``), or ``"latest"``:
    the newest ``outputs/**/final.ckpt`` under ``project_dir`` written by the training app
    (fine-tune runs, under ``outputs/finetune/``, are skipped: fine-tuning never silently chains).

    ``ValueError`` when ``"latest"`` finds nothing; the file itself is checked by :func:`check_pretrained`.
    """
    if value != LATEST:
        path = Path(value).expanduser()
        return path if path.is_absolute() else Path(project_dir) / path
    outputs = Path(project_dir) / "outputs"
    found = [
        p for p in outputs.glob("**/final.ckpt") if p.relative_to(outputs).parts[0] != FINETUNE_RUNS
    ]
    if not found:
        raise ValueError(
            f"finetune.pretrained=latest: no final.ckpt under {outputs}; run the training app "
            "(lightning3d-train) first or pass finetune.pretrained=PATH (a .ckpt or .safetensors file)"
        )
    return max(found, key=lambda p: p.stat().st_mtime)


def check_pretrained(model_cfg: DictConfig, path: Path, module: Any = None) -> None:
    """Raise ``ValueError`` (or ``FileNotFoundError``) unless ``path`` is a checkpoint that
    :func:`~lightning_3d.checkpoint.pretrained.load_pretrained` can load into ``model_cfg``'s
    model: the same names and shapes. Reads only the file's header / weights index. ``module``:
    that model built on ``meta`` already (else it is built here)."""
    import torch
    from hydra.utils import instantiate

    from lightning_3d.checkpoint.checks import (
        check_against,
        inspect_checkpoint,
        shapes_of,
    )
    from lightning_3d.checkpoint.names import map_names, matched_view, without_stored_ties
    from lightning_3d.models.hf_load import tied_partners

    info = inspect_checkpoint(path)  # missing, a directory, not a checkpoint, truncated
    if module is None:
        try:
            with torch.device("meta"):
                module = instantiate(model_cfg)
        except Exception:  # noqa: BLE001 -- not buildable on meta: load_pretrained checks it on the rank
            return
    own = shapes_of(module.state_dict())
    view = matched_view(list(own), list(info["shapes"]), path)  # LoRA: the base, or its adapters
    names = map_names(list(info["shapes"]), list(view), info["format"])
    stored = {names[n]: shape for n, shape in info["shapes"].items()}
    expected = without_stored_ties(view, list(stored), tied_partners(module))
    check_against({n: own[m] for n, m in expected.items()}, stored, source=str(path))


def own_weights(model_cfg: DictConfig) -> Optional[Path]:
    """The directory the configured model loads its own pretrained weights from when it is built
    (``model=hf model.path=DIR``), else ``None``."""
    from lightning_3d.app.config import target_of
    from lightning_3d.models.hf import HFCausalLM

    target = target_of(model_cfg, "model")
    path = (
        model_cfg.get("path")
        if isinstance(target, type) and issubclass(target, HFCausalLM)
        else None
    )
    return Path(str(path)).expanduser().resolve() if path is not None else None


def prepare(cfg: DictConfig, project_dir: str | Path, module: Any = None) -> Optional[Path]:
    """Resolve and check ``cfg.finetune.pretrained``, then pin it in ``cfg`` as an absolute path
    (so every rank loads the same file); return where the starting weights come from.

    A model that brings its own weights (``model=hf model.path=DIR``) starts from them under the
    default ``"latest"``; ``null`` loads nothing either (a random init, or the model's own).
    Then ``cfg.finetune.pretrained`` becomes ``None``. ``module``: the model built on ``meta``
    already, if it was. ``ValueError`` / ``FileNotFoundError`` on bad input."""
    own = own_weights(cfg.model)
    value = cfg.finetune.pretrained
    if value is None or (value == LATEST and own is not None):
        cfg.finetune.pretrained = None
        return own
    path = resolve_pretrained(str(value), project_dir).resolve()
    check_pretrained(cfg.model, path, module)
    cfg.finetune.pretrained = str(path)
    return path


def pretrained_module(module: Any, path: str) -> Any:
    """Hydra target wrapping ``cfg.model``: the built module with ``path``'s weights loaded."""
    from lightning_3d.checkpoint.pretrained import load_pretrained

    load_pretrained(module, path)
    return module


def finetune(spec: RunSpec, output_dir: str) -> dict[str, Any]:
    """Per-rank body for :func:`lightning_3d.app.run`: :func:`~lightning_3d.app.run.train` with the
    model's weights loaded from ``spec.pretrained`` before ``trainer.fit``.

    Returns the run summary with ``"pretrained"`` (the file's absolute path) and ``"offload"``
    (the offload config) added, also written to ``output_dir/summary.json``.
    """
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_3d.app.run import train

    source = spec.pretrained or own_weights(spec.model)  # None: a random init
    if spec.pretrained is not None:
        # app.train builds spec.model with hydra's instantiate, which builds the nested module
        # first and hands it to pretrained_module: the weights are in before trainer.fit.
        # (Resolved first: its ${...} references stay with the config it came from.)
        module = OmegaConf.to_container(spec.model, resolve=True)
        wrapped = {"_target_": f"{_MODULE}.pretrained_module", "module": module}
        spec = replace(spec, model=OmegaConf.create({**wrapped, "path": str(spec.pretrained)}))
    summary = {
        **train(spec, output_dir),
        "pretrained": str(source) if source is not None else None,
        "offload": hydra_group_values(spec.plan, "offload"),
    }
    if rank_zero_only.rank == 0:
        (Path(output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def task(cfg: DictConfig) -> int:
    """One Hydra job of the fine-tune app: :func:`lightning_3d.app.run.run` with :func:`finetune`
    on every rank and, once the configuration (model, data, layout) is checked, the pretrained
    file checked against the model (:func:`prepare`); returns the exit code (2: bad input)."""
    from hydra.utils import get_original_cwd

    from lightning_3d.app.run import run

    def pinned(spec: RunSpec, module: Any) -> RunSpec:
        # After validate: a wrong model is named as such, not as a checkpoint that does not fit it.
        try:
            path = prepare(cfg, get_original_cwd(), module)
        except OSError as err:  # one error: line, as a bad value
            raise ValueError(str(err)) from None
        print(
            f"fine-tuning from {path if path is not None else 'a random init (finetune.pretrained=null)'}"
        )
        pretrained = cfg.finetune.pretrained
        return replace(spec, pretrained=Path(pretrained) if pretrained is not None else None)

    return run(cfg, body=finetune, prepare=pinned)


def main() -> NoReturn:
    """The ``lightning3d-finetune`` console script: Hydra's command line over the package's configs."""
    from lightning_3d.app.cli import hydra_app
    from lightning_3d.app.config import CONF_DIR, register_configs

    register_configs()
    hydra_app(task, config_path=str(CONF_DIR), config_name="finetune")


if __name__ == "__main__":
    main()
