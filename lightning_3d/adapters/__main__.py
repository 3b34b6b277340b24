"""``python -m lightning_3d.adapters CKPT OUT_DIR [--merged] [--force]``: an adapter checkpoint of
``HFCausalLM`` as a PEFT adapter directory (``peft.PeftModel.from_pretrained(base, OUT_DIR)``),
or with ``--merged`` as a model directory with the adapters merged into the base
(``from_pretrained``; with the tokenizer and chat template of the model directory the run read).

As ``python -m lightning_3d.checkpoint export-hf``: the checkpoint is read weights-only (no
arbitrary unpickling) and its adapters' checksums verified; OUT_DIR must not exist or be empty
unless ``--force`` (which writes the export's files into it and keeps every other file there,
a README.md included); the export is written beside OUT_DIR under a temporary name and moved
into place at the end. Errors print one line ``error: ...`` on stderr and exit with code 2
(bad input), before anything is written, or 3 when OUT_DIR cannot be written."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

# The checkpoint tools' own error forms: argparse's errors as one line, exit 3 for these errnos.
from lightning_3d.checkpoint.__main__ import _Parser, reported

_MODEL_CARD = "README.md"  # peft's generated model card: never written over the user's own


def _say_nothing(_: str) -> None:
    pass


def check_target(checkpoint: Path, directory: Path, force: bool) -> None:
    """``directory`` may take the export: not the checkpoint or inside or around it, not a file,
    and empty (or absent) unless ``force``. ``ValueError`` / ``FileExistsError`` naming it."""
    from lightning_3d.checkpoint.files import refuse_overlap

    refuse_overlap(checkpoint, directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"output {directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        found = ", ".join(sorted(p.name for p in directory.iterdir())[:5])
        raise FileExistsError(
            f"output directory {directory} is not empty ({found}); pass --force (force=True) to "
            "write the export's files into it (files of the same names replaced, others kept)"
        )


def read_adapter_checkpoint(checkpoint: Path, merged: bool) -> dict[str, Any]:
    """The checkpoint dict (a ``.ckpt`` file or a sharded directory), read as ``resume=`` and
    ``export-hf`` read one (weights-only, its model tensors' checksums verified); ``ValueError``
    naming it when it holds no adapter or, for ``merged``, no model directory to take the base
    from."""
    from lightning_3d.adapters.checkpoint import ADAPTER_KEY
    from lightning_3d.checkpoint.checks import WEIGHTS, load_lightning_checkpoint

    # A .ckpt or a sharded directory, read whole; anything else a ValueError naming it.
    saved = load_lightning_checkpoint(checkpoint, mmap=True, verify=WEIGHTS)
    if ADAPTER_KEY not in saved:
        raise ValueError(
            f"{checkpoint} holds no adapter (a full model's checkpoint: use python -m "
            "lightning_3d.checkpoint export-hf)"
        )
    hparams = saved.get("hyper_parameters")
    if not isinstance(hparams, Mapping) or (
        hparams.get("path") is None and hparams.get("config") is None
    ):
        raise ValueError(
            f"{checkpoint} records no model (hyper_parameters path= or config=) to rebuild the "
            "base from: it was not trained with HFCausalLM(path=...) or HFCausalLM(config=...)"
        )
    if merged and hparams.get("path") is None:
        raise ValueError(
            f"{checkpoint}: the base of a config= model is a random init the checkpoint does "
            "not hold; merging needs a model built from path="
        )
    return saved


def export_checkpoint(
    checkpoint: Union[str, Path],
    directory: Union[str, Path],
    merged: bool = False,
    force: bool = False,
    tokenizer: Union[str, Path, None] = None,
    progress: Callable[[str], None] = _say_nothing,
) -> Path:
    """:func:`~lightning_3d.adapters.export.save_peft` of an adapter checkpoint of ``HFCausalLM``
    (a ``.ckpt`` file or a sharded directory, of any layout). The base is rebuilt from the module's hyper-parameters: a
    ``path=`` model reads its directory; a ``config=`` model's base is a seeded random init the
    checkpoint does not hold, so only the adapter (not the merged model) can be exported from it.
    ``merged``: the tokenizer (and chat template) of ``tokenizer``, else of the ``path=``
    directory when it holds one, goes with the model.

    Every check runs before anything is written (``FileNotFoundError``, ``FileExistsError`` or
    ``ValueError`` naming the value); the directory is written under a temporary sibling name
    and moved into place whole (``force`` into a non-empty ``directory``: file by file, keeping
    the files it does not write, and its README.md over peft's model card)."""
    from lightning_3d.adapters.export import save_peft
    from lightning_3d.checkpoint.export import output_errors_named
    from lightning_3d.checkpoint.hf_export import (
        _check_tokenizer_round_trip,
        _load_tokenizer,
        _tokenizer_dir,
        _write_dir,
    )
    from lightning_3d.models.hf import HFCausalLM

    source, out_dir = Path(checkpoint), Path(directory)
    if not source.exists():
        raise FileNotFoundError(f"checkpoint not found: {source}")
    if tokenizer is not None and not merged:
        raise ValueError(f"--tokenizer {tokenizer}: a tokenizer goes with --merged only")
    check_target(source, out_dir, force)
    saved = read_adapter_checkpoint(source, merged)
    hparams = dict(saved["hyper_parameters"])
    tok_source = _tokenizer_dir(tokenizer, hparams, progress) if merged else None
    tok = _load_tokenizer(tok_source) if tok_source is not None else None

    module = HFCausalLM(**{**hparams, "deferred_init": False})
    module.on_load_checkpoint(saved)  # the options and names checked against the model
    module.load_state_dict(saved["state_dict"], strict=False)
    if not module.adapter.enabled:
        raise ValueError(f"{source}: its model has adapter method={module.adapter.method!r}")

    def write(temp: Path) -> None:
        save_peft(module.model.config, module.state_dict(), module.adapter, temp, merged)
        if (out_dir / _MODEL_CARD).exists():  # the user's, kept (--force)
            (temp / _MODEL_CARD).unlink(missing_ok=True)
        if tok is not None:
            progress(f"writing the tokenizer of {tok_source}")
            tok.save_pretrained(temp)
            _check_tokenizer_round_trip(tok, tok_source, temp, progress)

    with output_errors_named(out_dir):  # a full or unwritable disk: out_dir named, not the temp
        _write_dir(out_dir, write, keep_others=True)
    return out_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (0, or 2 or 3 after printing ``error: ...``)."""
    parser = _Parser(
        prog="python -m lightning_3d.adapters",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "checkpoint", help="an HFCausalLM checkpoint with an adapter (.ckpt or sharded directory)"
    )
    parser.add_argument("out", help="the directory to write (must not exist or be empty)")
    parser.add_argument("--merged", action="store_true", help="merge the adapters into the base")
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty OUT (files of the same names replaced, others kept)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="with --merged: the tokenizer directory to include (default: the model's path)",
    )
    args = parser.parse_args(argv)
    code, out = reported(
        lambda: export_checkpoint(
            args.checkpoint,
            args.out,
            args.merged,
            force=args.force,
            tokenizer=args.tokenizer,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    )
    if code:
        return code
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
