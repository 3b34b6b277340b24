"""Checkpoint tools on the command line.

``python -m lightning_3d.checkpoint consolidate CKPT OUT.safetensors [--prefix model.] [--force]``
writes the full model weights of a consolidated Lightning checkpoint as one plain safetensors
file (see :mod:`lightning_3d.checkpoint.export`). Errors print one line ``error: ...`` on
stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from lightning_3d.checkpoint.export import export_safetensors

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, or 2 after printing ``error: ...``)."""
    args = build_parser().parse_args(argv)
    try:
        result = export_safetensors(args.checkpoint, args.output, prefix=args.prefix, force=args.force)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR
    stripped = f", prefix {result.prefix!r} stripped" if result.prefix else ""
    print(
        f"wrote {result.num_tensors} tensors ({result.num_params:,} parameters, {result.num_bytes:,} bytes"
        f"{stripped}) to {result.path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
