"""Checkpoint tools on the command line.

``python -m lightning_3d.checkpoint consolidate CKPT OUT.safetensors [--prefix model.] [--force]``
writes the full model weights of a consolidated Lightning checkpoint as one plain safetensors
file (see :mod:`lightning_3d.checkpoint.export`).

``python -m lightning_3d.checkpoint export-hf CKPT OUT_DIR [--tokenizer DIR] [--dtype bfloat16] [--force]``
writes a checkpoint of ``HFCausalLM`` (any layout: a ``.ckpt`` file or a sharded directory) as a
directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads (see
:mod:`lightning_3d.checkpoint.hf_export`); progress goes to stderr.

Errors print one line ``error: ...`` on stderr and exit with code 2, before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from lightning_3d.checkpoint.export import export_safetensors
from lightning_3d.checkpoint.hf_export import DTYPES, export_hf

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in the same one-line form as the tool's own."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m lightning_3d.checkpoint`` argument parser."""
    parser = _Parser(prog="python -m lightning_3d.checkpoint", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    consolidate = commands.add_parser(
        "consolidate", help="export the model weights of a Lightning checkpoint as one safetensors file"
    )
    consolidate.add_argument("checkpoint", help="consolidated Lightning checkpoint (.ckpt)")
    consolidate.add_argument("output", help="safetensors file to write (written atomically)")
    consolidate.add_argument(
        "--prefix", default=None,
        help="LightningModule attribute prefix to strip from every name (default: the first dotted "
             "component when all names share it, e.g. 'model.'; '' keeps names unchanged)",
    )
    consolidate.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    _add_export_hf(commands)
    return parser


def _add_export_hf(commands: Any) -> None:
    export = commands.add_parser(
        "export-hf", help="write an HFCausalLM checkpoint as a Hugging Face model directory (from_pretrained)"
    )
    export.add_argument("checkpoint", help="HFCausalLM checkpoint: a .ckpt file or a sharded checkpoint directory")
    export.add_argument("out_dir", help="directory to write (written under a temporary name, then renamed)")
    export.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="tokenizer directory to include (default: the model's `path` hyper-parameter when it has one)",
    )
    export.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="cast floating weights (default: keep the checkpoint's dtypes, bit for bit)")
    export.add_argument("--force", action="store_true", help="replace OUT_DIR if it is not empty")


def _consolidate(args: argparse.Namespace) -> None:
    result = export_safetensors(args.checkpoint, args.output, prefix=args.prefix, force=args.force)
    stripped = f", prefix {result.prefix!r} stripped" if result.prefix else ""
    print(
        f"wrote {result.num_tensors} tensors ({result.num_params:,} parameters, {result.num_bytes:,} bytes"
        f"{stripped}) to {result.path}"
    )


def _export_hf(args: argparse.Namespace) -> None:
    result = export_hf(args.checkpoint, args.out_dir, tokenizer=args.tokenizer, dtype=args.dtype, force=args.force,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    tokenizer = f", tokenizer from {result.tokenizer}" if result.tokenizer else ", no tokenizer"
    print(f"wrote {result.architecture} ({result.num_params:,} parameters, {'/'.join(result.dtypes)}{tokenizer}) "
          f"to {result.path}: {', '.join(result.files)}")


COMMANDS = {"consolidate": _consolidate, "export-hf": _export_hf}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, or 2 after printing ``error: ...``)."""
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (ValueError, OSError, ImportError) as error:
        message = " ".join(str(error).split())  # one line, whatever the library's message looked like
        print(f"error: {message}", file=sys.stderr)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
