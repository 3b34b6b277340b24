"""Export a checkpoint of :class:`~lightning_3d.models.hf.HFCausalLM` as a Hugging Face model directory.

The result loads with nothing but ``transformers``::

    model = AutoModelForCausalLM.from_pretrained("out/")
    tokenizer = AutoTokenizer.from_pretrained("out/")   # when a tokenizer was available

A checkpoint of any layout works (a consolidated ``.ckpt`` or a sharded directory): both are
read in this process as full tensors. The model is rebuilt from the ``transformers`` config that
``HFCausalLM`` writes into every checkpoint (``hf_config``) on the ``meta`` device, so no random
initialisation is paid for; the checkpoint's tensors are put in place as they are (no copy, no
cast unless asked) and ``transformers``' own ``save_pretrained`` writes the directory: tied
weights once, its own file names and sharding, ``config.json`` and ``generation_config.json``.

Everything is checked before anything is written, and the directory is written under a
temporary sibling name and renamed at the end: an export is complete or absent.

Command line: ``python -m lightning_3d.checkpoint export-hf last.ckpt out/ [--tokenizer DIR]``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_3d.checkpoint import sharded_files
from lightning_3d.checkpoint.checks import (
    SHARDED,
    WEIGHTS,
    PathLike,
    check_against,
    detect_format,
    load_lightning_checkpoint,
    shapes_of,
)
from lightning_3d.checkpoint.export import output_errors_named
from lightning_3d.checkpoint.files import (
    finish_file,
    fsync_dir,
    publish,
    publish_into,
    refuse_overlap,
    remove_stale_temps,
    temp_path_for,
)
from lightning_3d.parallel.tied import find_tied

MODEL_PREFIX = "model."  # HFCausalLM keeps the transformers model at self.model
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Any of these in a model directory means AutoTokenizer can load a tokenizer from it.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)


@dataclass(frozen=True)
class HFExportResult:
    """What :func:`export_hf` wrote."""

    path: Path
    architecture: str  # the transformers class, e.g. "Qwen2ForCausalLM"
    num_params: int  # a tied weight counted once
    dtypes: tuple[str, ...]  # of the weights written
    tied: tuple[tuple[str, ...], ...]  # groups of names sharing one weight (written once)
    tokenizer: Optional[Path]  # where the tokenizer came from; None when none was written
    files: tuple[str, ...]


def _say_nothing(_: str) -> None:
    pass


def export_hf(
    checkpoint: PathLike,
    out_dir: PathLike,
    tokenizer: Optional[PathLike] = None,
    dtype: Union[str, torch.dtype, None] = None,
    force: bool = False,
    progress: Callable[[str], None] = _say_nothing,
) -> HFExportResult:
    """Write an ``HFCausalLM`` checkpoint as a directory ``AutoModelForCausalLM.from_pretrained`` loads.

    Args:
        checkpoint: a consolidated ``.ckpt`` file or a sharded checkpoint directory of an
            ``HFCausalLM`` run (any layout).
        out_dir: the directory to write; it must not exist or be empty unless ``force``.
        tokenizer: a directory ``AutoTokenizer`` loads; ``None`` takes the checkpoint's
            ``path`` hyper-parameter when that directory holds tokenizer files, else writes none.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` to cast floating weights to;
            ``None`` keeps the checkpoint's dtypes (the weights are then bit-equal to it).
        force: replace a non-empty ``out_dir`` (atomically, once the new one is complete).
        progress: called with one line per stage (the CLI prints them on stderr).

    Raises ``FileNotFoundError``, ``FileExistsError`` or ``ValueError`` naming the value (no
    checkpoint, a non-empty ``out_dir``, ``out_dir`` inside the checkpoint, a checkpoint not
    trained with ``HFCausalLM``, ...) before anything is written.

    Example::

        >>> export_hf("outputs/last.ckpt", "qwen2-finetuned").files  # doctest: +SKIP
        ('config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json')
    """
    # HFCausalLM's module (with the models and data it loads) only when an export runs:
    # import lightning_3d needs none of it.
    from lightning_3d.models.hf import HF_CONFIG_KEY

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    cast = _dtype(dtype)
    _check_paths(checkpoint, out_dir, force)
    entries, read_state = _entries(checkpoint)
    source = _tokenizer_dir(tokenizer, entries.get("hyper_parameters"), progress)
    tok = _load_tokenizer(source) if source is not None else None
    progress(f"reading the weights of {checkpoint}")
    model, tied = hf_model_from_state(
        entries[HF_CONFIG_KEY], _strip(read_state(), checkpoint), cast, str(checkpoint)
    )
    unique = {id(p): p for p in model.parameters()}.values()
    progress(
        f"rebuilt {type(model).__name__} ({sum(p.numel() for p in unique):,} parameters); writing {out_dir}"
    )

    def write(temp: Path) -> None:
        model.save_pretrained(temp)
        if tok is not None:
            progress(f"writing the tokenizer of {source}")
            tok.save_pretrained(temp)
            _check_tokenizer_round_trip(tok, source, temp, progress)

    with output_errors_named(out_dir):  # a full or unwritable disk: out_dir named, not the temp
        _write_dir(out_dir, write)
    progress(f"wrote {out_dir}")
    return HFExportResult(
        path=out_dir,
        architecture=type(model).__name__,
        num_params=sum(p.numel() for p in unique),
        dtypes=tuple(sorted({str(p.dtype).removeprefix("torch.") for p in unique})),
        tied=tuple(tied),
        tokenizer=source,
        files=tuple(sorted(f.name for f in out_dir.iterdir())),
    )


# ------------------------------------------------------------------------------ checks
def _dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(
        f"dtype must be one of {sorted(DTYPES)} (or None: keep the checkpoint's), got {dtype!r}"
    )


def _check_paths(checkpoint: Path, out_dir: Path, force: bool) -> None:
    """The checkpoint exists; ``out_dir`` may be (re)written without touching the checkpoint."""
    if not checkpoint.exists():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    refuse_overlap(checkpoint, out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"output {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(
            f"output directory {out_dir} is not empty; pass --force (force=True) to replace it"
        )


def _entries(checkpoint: Path) -> tuple[Mapping[str, Any], Callable[[], Mapping[str, Tensor]]]:
    """(the checkpoint's entries, a function reading its model state), its ``hf_config`` checked
    first: a sharded checkpoint's ``meta.pt`` before any tensor is read, then the checksums of
    its model tensors (not the optimizer's); a ``.ckpt`` memory-mapped, its tensors read on first
    use."""
    if detect_format(checkpoint) == SHARDED:
        meta = sharded_files.read_meta(checkpoint)
        _check_not_adapters(meta, checkpoint)
        _check_hf_config(meta, checkpoint)
        # The model's checksums before anything is said or read: damage is the one error line.
        sharded_files.verify_shards(
            checkpoint, sharded_files.read_metadata(checkpoint), meta, sharded_files.MODEL
        )
        return meta, lambda: sharded_files.read_tensors(checkpoint, verify=False)
    whole = load_lightning_checkpoint(checkpoint, mmap=True, verify=WEIGHTS)
    _check_not_adapters(whole, checkpoint)
    _check_hf_config(whole, checkpoint)
    return whole, lambda: whole["state_dict"]


def _check_not_adapters(entries: Mapping[str, Any], checkpoint: Path) -> None:
    """An adapter checkpoint (``adapter=lora`` / ``qlora``) holds no base to export as a model:
    said as such, with the command that exports it, instead of every base weight named missing."""
    from lightning_3d.adapters.checkpoint import EXPORT_COMMAND, describe, saved_adapter

    options = saved_adapter(entries)
    if options is not None:
        raise ValueError(
            f"{checkpoint} is an adapter checkpoint ({describe(options)}): it holds only the "
            f"adapters, not the base model; export it with {EXPORT_COMMAND} {checkpoint} DIR "
            "[--merged] (a PEFT adapter directory; --merged: the base with the adapters merged in)"
        )


def _check_hf_config(entries: Mapping[str, Any], checkpoint: Path) -> None:
    from lightning_3d.models.hf import HF_CONFIG_KEY

    config = entries.get(HF_CONFIG_KEY)
    if config is None:
        found = ", ".join(sorted(map(str, entries))[:12])
        raise ValueError(
            f"{checkpoint} has no {HF_CONFIG_KEY!r} entry: it was not trained with HFCausalLM "
            f"(lightning_3d.models.hf), so there is no transformers config to rebuild the model from "
            f"(entries: {found}); for its weights as one safetensors file use the 'consolidate' command"
        )
    if not isinstance(config, Mapping) or not config.get("model_type"):
        raise ValueError(
            f"{checkpoint}: its {HF_CONFIG_KEY!r} entry is not a transformers config dict with a "
            f"model_type (got {type(config).__name__})"
        )


def _strip(state: Mapping[str, Tensor], checkpoint: Path) -> dict[str, Tensor]:
    """The transformers model's own names: HFCausalLM's ``model.`` prefix removed."""
    foreign = sorted(name for name in state if not name.startswith(MODEL_PREFIX))
    if foreign:
        raise ValueError(
            f"{checkpoint}: {len(foreign)} state_dict names lack HFCausalLM's {MODEL_PREFIX!r} prefix "
            f"(e.g. {', '.join(foreign[:5])})"
        )
    return {name[len(MODEL_PREFIX) :]: tensor for name, tensor in state.items()}


# ------------------------------------------------------------------------------ model
def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "export-hf needs Hugging Face transformers: pip install 'lightning-3d[hf]'"
        ) from error
    return transformers


def _config(hf_config: Mapping[str, Any], source: str) -> Any:
    transformers = _transformers()
    model_type = hf_config["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"{source}: model_type {model_type!r} is unknown to transformers "
            f"{transformers.__version__}"
        )
    config = transformers.CONFIG_MAPPING[model_type].from_dict(dict(hf_config))
    config.use_cache = True  # HFCausalLM turns the cache off for training; generation wants it
    return config


def _bit_equal(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _fill_ties(
    state: dict[str, Tensor], groups: list[tuple[str, ...]], source: str
) -> dict[str, Tensor]:
    """Every name of a tie group under the one tensor the checkpoint holds (a checkpoint may
    hold one name of the group, as ThreeDStrategy saves, or all, as plain Lightning does)."""
    state = dict(state)
    for group in groups:
        present = [name for name in group if name in state]
        if not present:
            continue  # reported as missing by the name check
        first = state[present[0]]
        differing = [name for name in present[1:] if not _bit_equal(state[name], first)]
        if differing:
            raise ValueError(
                f"{source}: the config ties {', '.join(group)}, but the checkpoint's "
                f"{', '.join(differing)} differ from its {present[0]}"
            )
        state.update({name: first for name in group})
    return state


def hf_model_from_state(
    hf_config: Mapping[str, Any],
    state: Mapping[str, Tensor],
    dtype: Optional[torch.dtype] = None,
    source: str = "checkpoint",
) -> tuple[nn.Module, list[tuple[str, ...]]]:
    """The ``transformers`` causal LM of ``hf_config`` holding exactly ``state``'s tensors (its own
    names), and its tie groups. Built on ``meta`` and assigned, so nothing is initialised or copied;
    ``ValueError`` naming every missing, unexpected or mis-shaped name."""
    config = _config(hf_config, source)
    with torch.device("meta"):
        model = _transformers().AutoModelForCausalLM.from_config(config)
    groups = find_tied(model)
    state = _fill_ties(state, groups, source)
    check_against(shapes_of(model.state_dict()), shapes_of(state), source=source)
    if dtype is not None:
        cast = {
            id(t): t.to(dtype) for t in state.values() if t.is_floating_point()
        }  # tied tensors once
        state = {name: cast.get(id(t), t) for name, t in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True gave each module its own Parameter: one shared object again
    if find_tied(model) != groups:
        raise ValueError(
            f"{source}: tied weights {groups} came apart when loaded into {type(model).__name__}"
        )
    return model.eval(), groups


# ------------------------------------------------------------------------------ tokenizer
def _tokenizer_dir(
    tokenizer: Optional[PathLike], hparams: Any, progress: Callable[[str], None]
) -> Optional[Path]:
    """``tokenizer``, else the model's ``path`` hyper-parameter (where ``HFCausalLM(path=...)``
    loaded it from) when that directory holds tokenizer files here, else ``None``."""
    if tokenizer is not None:
        if not Path(tokenizer).is_dir():
            raise ValueError(
                f"--tokenizer {tokenizer} is not a directory (give one AutoTokenizer loads)"
            )
        return Path(tokenizer)
    path = hparams.get("path") if isinstance(hparams, Mapping) else None
    if path is None:
        progress(
            "no tokenizer written (the model was built from a config): pass --tokenizer DIR to add one"
        )
        return None
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        progress(
            f"no tokenizer written: the model's path {path} holds no tokenizer files here; pass --tokenizer DIR"
        )
        return None
    return Path(path)


def _load_tokenizer(source: Path) -> Any:
    try:
        return _transformers().AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = " ".join(str(error).split())[:300]
        raise ValueError(
            f"tokenizer directory {source} does not load with AutoTokenizer ({reason})"
        ) from error


_PROBE = "The quick brown fox jumps over the lazy dog. 0123456789 the cat sat on the mat"


def _check_tokenizer_round_trip(
    tok: Any, source: Path, directory: Path, progress: Callable[[str], None]
) -> None:
    """Warn when ``AutoTokenizer`` reads the written tokenizer back as another one: transformers
    picks the tokenizer class of some model types (e.g. ``qwen2``) whatever the files declare."""
    try:
        loaded = _transformers().AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = " ".join(str(error).split())[:300]
        progress(
            f"warning: AutoTokenizer cannot load the exported tokenizer ({reason}); load it with "
            f"{type(tok).__name__}.from_pretrained"
        )
        return
    if loaded(_PROBE)["input_ids"] != tok(_PROBE)["input_ids"]:
        progress(
            f"warning: AutoTokenizer loads the exported tokenizer as {type(loaded).__name__}, which encodes "
            f"differently from the {type(tok).__name__} of {source}; load it with {type(tok).__name__}"
            ".from_pretrained instead"
        )


# ------------------------------------------------------------------------------ writing
def _write_dir(out_dir: Path, write: Callable[[Path], None], keep_others: bool = False) -> None:
    """``write(temp)`` into a temporary sibling directory, fsync it, then put it at ``out_dir``:
    the whole directory swapped in, or with ``keep_others`` its files moved into ``out_dir``
    one by one, the other files there kept (:func:`~lightning_3d.checkpoint.files.publish_into`)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir.parent)
    temp = temp_path_for(out_dir)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        write(temp)
        for file in (f for f in temp.rglob("*") if f.is_file()):
            finish_file(file)
        fsync_dir(temp)
        if keep_others:
            publish_into(temp, out_dir)
        else:
            publish(temp, out_dir)  # atomic exchange with what is there
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
