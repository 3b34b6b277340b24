"""Typed configuration for the Hydra apps, and the one function that turns it into a strategy.

The dataclasses are registered in Hydra's ``ConfigStore`` as schemas, so a typo in a key
(``parallelism.zero_stag=2``) or a wrong type (``parallelism.tensor=two``) is refused by Hydra
before anything runs; values are range-checked by :class:`~lightning_3d.layout.Layout`.

The ``model`` and ``data`` groups name any class (``_target_``), so they have no schema: their
keys are checked against the class's signature instead (:func:`check_target_keys`), and what a
model accepts (vocabulary, positions) is read without building it (:func:`model_limits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from lightning_3d.options import Plan, from_hydra, hydra_schema
from lightning_3d.strategy.three_d import ThreeDStrategy

# The apps' Hydra configs (train.yaml, finetune.yaml, plan.yaml and their groups), shipped inside
# the package so that an installed wheel's apps find them wherever they run.
CONF_DIR = Path(__file__).resolve().parent / "conf"

# The schemas are made from the one option table (lightning_3d.options.OPTIONS): every key and
# default of the parallelism and offload groups is the strategy's own.
ParallelismConfig = hydra_schema("parallelism")
OffloadConfig = hydra_schema("offload")


def register_configs(store: Optional[ConfigStore] = None) -> None:
    """Register the schemas that ``conf/parallelism/*.yaml`` and ``conf/offload/*.yaml`` extend
    (:data:`CONF_DIR`)."""
    from omegaconf import OmegaConf

    store = store or ConfigStore.instance()
    # CONF_DIR/*.yaml: hydra.run.dir / hydra.sweep.dir: ${unique_dir:outputs/${now:...}}
    OmegaConf.register_new_resolver("unique_dir", unique_dir, use_cache=True, replace=True)
    store.store(group="parallelism", name="schema", node=ParallelismConfig)
    store.store(group="offload", name="schema", node=OffloadConfig)


def unique_dir(path: str) -> str:
    """``path``, or else ``path-1``, ``path-2``, ...: the first of them that did not exist, made
    here. ``os.mkdir`` fails on an existing directory, so two runs started in the same second
    (the same ``${now:...}`` path) never share a run directory, and neither overwrites the other's
    outputs. Hydra resolves it once per invocation (cached; a sweep's jobs share the cache).

    Under torchrun or srun every process resolves it on its own, at its own second: there it is
    ``job-<id>`` next to where ``path`` would be (``outputs/<date>/job-<id>``), made if missing,
    so all ranks (and nodes) of a job share one directory; with torchrun's default rendezvous id
    ("none") it is ``path`` itself, shared by the ranks that start in the same second (give
    ``--rdzv-id`` or ``hydra.run.dir``)."""
    import os
    from itertools import count
    from pathlib import Path

    base = Path(str(path))
    job = launcher_job_id()
    # Every rank of a torchrun / srun job resolves this itself: one name for all.
    if job is not None:
        # torchrun's default id is "none".
        shared = base.parent / f"job-{job}" if job != "none" else base
        shared.mkdir(parents=True, exist_ok=True)
        return str(shared)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in count():
        candidate = base if n == 0 else base.with_name(f"{base.name}-{n}")
        try:
            os.mkdir(candidate)
        except FileExistsError:
            continue
        return str(candidate)
    raise AssertionError("unreachable")


def launcher_job_id() -> Optional[str]:
    """The job id an external launcher gave every process of this run (torchrun's rendezvous id,
    SLURM's job and step), or ``None`` when this process was not started by one. Ranks started
    by the app's own launcher get their run directory on the command line instead."""
    import os

    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return env["TORCHELASTIC_RUN_ID"]
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env:
        step = env.get("SLURM_STEP_ID")
        return env["SLURM_JOB_ID"] + (f".{step}" if step else "")
    return None


def plan_of(parallelism: Any, offload: Any = None) -> Plan:
    """The checked :class:`~lightning_3d.options.Plan` of a ``parallelism`` and an ``offload``
    config (dataclass, DictConfig or mapping); ``ValueError`` naming a bad value."""
    options = parallelism if isinstance(parallelism, dict) else _to_dict(parallelism)
    if offload is not None:
        offload = offload if isinstance(offload, dict) else _to_dict(offload)
    return from_hydra(options, offload)


def build_strategy(parallelism: Any, offload: Any = None) -> ThreeDStrategy:
    """Turn a ``parallelism`` (and ``offload``) config into a ``ThreeDStrategy``."""
    return ThreeDStrategy(plan_of(parallelism, offload))


# Keys of a config node that Hydra's ``instantiate`` reads itself (not constructor arguments).
HYDRA_KEYS = frozenset({"_target_", "_recursive_", "_convert_", "_partial_", "_args_"})


def target_of(node: Any, where: str) -> Any:
    """The class or function ``node._target_`` names; ``ValueError`` naming it if it cannot be imported."""
    from hydra.utils import get_object

    target = node.get("_target_") if node is not None else None
    if not target:
        raise ValueError(f"{where} has no _target_ (the class to build)")
    import logging

    hydra_log = logging.getLogger("hydra.utils")
    level = hydra_log.level
    hydra_log.setLevel(logging.CRITICAL)  # it logs the failure too; said once, below
    try:
        return get_object(target)
    except Exception as err:  # noqa: BLE001 -- Hydra wraps import errors in several types
        cause = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ValueError(f"{where}._target_={target!r} cannot be imported: {cause}") from None
    finally:
        hydra_log.setLevel(level)


def check_target_keys(node: Any, where: str) -> None:
    """Raise ``ValueError`` unless every key of ``node`` is a parameter of its ``_target_`` and every
    required parameter is given: checked in the launching process from the signature, so a key of
    another model (``model=hf +model.n_layer=4``) is one line instead of a ``TypeError`` per rank."""
    import inspect

    target = target_of(node, where)
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # no inspectable signature (a builtin): the ranks will tell
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) or "_args_" in node:
        return  # takes **kwargs, or positional arguments: any key may be right
    keys = {str(k) for k in node.keys()} - HYDRA_KEYS
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(keys - named)
    if unknown:
        raise ValueError(
            f"{', '.join(f'{where}.{k}' for k in unknown)}: not {'a parameter' if len(unknown) == 1 else 'parameters'} "
            f"of {where}._target_={node._target_} (its parameters: {', '.join(sorted(named))})"
        )
    missing = sorted(n for n in named - keys if params[n].default is inspect.Parameter.empty)
    if missing:
        raise ValueError(
            f"{where}._target_={node._target_} needs {', '.join(f'{where}.{k}' for k in missing)}"
        )


@dataclass
class ModelLimits:
    """What a model accepts, read before it is built: token ids below ``vocab_size`` and
    sequences of at most ``max_positions`` (``None``: unknown, not checked)."""

    vocab_size: Optional[int] = None
    max_positions: Optional[int] = None
    source: str = "model"  # where the numbers come from, for messages


def model_limits(node: Any) -> ModelLimits:
    """The limits of the model ``node`` configures: a Hugging Face model's from its config (see
    :func:`hf_model_limits`), any other's from its ``vocab_size`` / ``block_size`` keys."""
    from lightning_3d.models.hf import HFCausalLM

    target = target_of(node, "model")
    if isinstance(target, type) and issubclass(target, HFCausalLM):
        return hf_model_limits(node.get("path"), node.get("config"))
    return ModelLimits(node.get("vocab_size"), node.get("block_size"), "model")


def hf_model_limits(path: Optional[str], config: Any) -> ModelLimits:
    """Check that ``model=hf`` names one model (a directory with ``config.json`` and weights, or
    a config with a ``model_type``) and read its vocabulary and position limits from the config
    (nothing is built). ``ValueError`` names the bad value."""
    if path is not None and config is not None:
        raise ValueError(
            f"model=hf takes model.path or model.config, not both (model.path={str(path)!r})"
        )
    hf = _hf_config_from_dir(path) if path is not None else _hf_config_from_dict(config)
    positions = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", None)
    where = f"{path}/config.json" if path is not None else "model.config"
    return ModelLimits(getattr(hf, "vocab_size", None), positions, where)


def without_weights(node: Any, always: bool = False) -> Any:
    """``node`` with a Hugging Face directory's weights left out, for a model that would load
    them whole (``deferred_init=false``; ``always``: any directory model, for one whose deferred
    build was declined, as where ``transformers`` converts the files' tensors on load or QLoRA
    quantizes the base as it is built): ``model.path`` replaced by its ``config.json`` as
    ``model.config``, so the model builds on the ``meta`` device (where ``from_pretrained``
    refuses to run) with the same shapes. The safetensors files' headers are read first, so a
    truncated file is named here. Other nodes (a deferred directory model reads only the
    files' headers) are returned as they are."""
    from omegaconf import OmegaConf

    from lightning_3d.models.hf import HFCausalLM

    target = target_of(node, "model")
    if (
        not (isinstance(target, type) and issubclass(target, HFCausalLM))
        or node.get("path") is None
    ):
        return node
    if not always and node.get("deferred_init", True):
        return node  # built on meta from the files' headers: their checks run too
    _check_headers(node.path)
    config = _hf_config_from_dir(node.path).to_dict()
    return OmegaConf.merge(
        OmegaConf.to_container(node, resolve=True), {"path": None, "config": config}
    )


def _check_headers(path: str) -> None:
    """The directory's safetensors headers are readable: ``ValueError`` naming a truncated or
    damaged file (``pytorch_model*.bin`` directories are read by ``transformers`` only)."""
    from pathlib import Path

    from lightning_3d.models.hf_load import read_headers, weight_files

    directory = Path(str(path)).expanduser()
    if weight_files(directory):
        read_headers(directory)


def _hf_config_from_dir(path: str) -> Any:
    from pathlib import Path

    directory = Path(str(path)).expanduser()
    if not directory.is_dir():
        raise ValueError(f"model.path={str(path)!r} is not a directory")
    if not (directory / "config.json").is_file():
        raise ValueError(
            f"model.path={str(path)!r} has no config.json: not a Hugging Face model directory"
        )
    if not any(directory.glob("*.safetensors")) and not any(directory.glob("pytorch_model*.bin")):
        raise ValueError(
            f"model.path={str(path)!r} has no weights (*.safetensors or pytorch_model*.bin)"
        )
    transformers = _transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"model.path={str(path)!r}: cannot read config.json: {_first_line(err)}"
        ) from None


def _hf_config_from_dict(config: Any) -> Any:
    if config is None:
        raise ValueError(
            "model=hf needs model.path=DIR (pretrained weights) or model.config={model_type: ..., ...} "
            "(random init); neither is set"
        )
    options = dict(_to_dict(config))
    model_type = options.pop("model_type", None)
    if model_type is None:
        raise ValueError(
            f"model.config needs a model_type (e.g. llama, qwen2, gpt2); its keys: {sorted(options)}"
        )
    transformers = _transformers()
    try:
        return transformers.AutoConfig.for_model(model_type, **options)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"model.config (model_type={model_type!r}): {_first_line(err)}") from None


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "model=hf needs Hugging Face transformers: pip install 'lightning-3d[hf]'"
        ) from None
    return transformers


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def world_size_of(trainer_cfg: Any) -> int:
    """Processes a Trainer config asks for: ``devices * num_nodes`` (``devices`` must be a count)."""
    cfg = _to_dict(trainer_cfg)
    devices, nodes = cfg.get("devices", 1), cfg.get("num_nodes", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"trainer.devices={devices!r} must be a positive number of processes")
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"trainer.num_nodes={nodes!r} must be a positive integer")
    return devices * nodes


def _to_dict(cfg: Any) -> dict:
    from dataclasses import asdict, is_dataclass

    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    if is_dataclass(cfg):
        return asdict(cfg)
    return dict(cfg)
