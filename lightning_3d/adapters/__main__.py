"""``python -m lightning_3d.adapters CKPT OUT_DIR [--merged]``: an adapter checkpoint of
``HFCausalLM`` as a PEFT adapter directory (``peft.PeftModel.from_pretrained(base, OUT_DIR)``),
or with ``--merged`` as a model directory with the adapters merged into the base
(``from_pretrained``). Bad input: one line ``error: ...`` on stderr, exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

import torch

from lightning_3d.runtime.exit_codes import BAD_INPUT


def export_checkpoint(
    checkpoint: Union[str, Path], directory: Union[str, Path], merged: bool = False
) -> Path:
    """:func:`export_adapter` of a consolidated adapter checkpoint (a ``.ckpt`` file) of
    ``HFCausalLM``. The base is rebuilt from the module's hyper-parameters: a ``path=`` model
    reads its directory; a ``config=`` model's base is a seeded random init the checkpoint does
    not hold, so only the adapter (not the merged model) can be exported from it."""
    from lightning_3d.adapters.export import export_adapter
    from lightning_3d.models.hf import HFCausalLM

    source = Path(checkpoint)
    if not source.is_file():
        raise ValueError(
            f"{str(source)!r} is not a checkpoint file (adapter export reads a "
            "consolidated .ckpt; consolidate a sharded one first)"
        )
    saved = torch.load(source, map_location="cpu", weights_only=False)
    hparams = saved.get("hyper_parameters") or {}
    if "adapter" not in saved:
        raise ValueError(
            f"{str(source)!r} holds no adapter (a full model's checkpoint: use "
            "python -m lightning_3d.checkpoint export-hf)"
        )
    if merged and hparams.get("path") is None:
        raise ValueError(
            f"{str(source)!r}: the base of a config= model is a random init the "
            "checkpoint does not hold; merging needs a model built from path="
        )
    module = HFCausalLM(**{**hparams, "deferred_init": False})
    module.on_load_checkpoint(saved)
    module.load_state_dict(saved["state_dict"], strict=False)
    return export_adapter(module, directory, merged)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_3d.adapters", description=__doc__)
    parser.add_argument("checkpoint", help="a consolidated .ckpt of HFCausalLM with an adapter")
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--merged", action="store_true", help="merge the adapters into the base")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.merged)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
