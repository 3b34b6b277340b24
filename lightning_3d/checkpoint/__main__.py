"""Checkpoint tools on the command line.

``python -m lightning_3d.checkpoint consolidate CKPT OUT.safetensors [--prefix model.] [--force]``
(alias ``export``) writes the full model weights of a Lightning checkpoint (a ``.ckpt`` file or a
sharded directory) as one plain safetensors file (see :mod:`lightning_3d.checkpoint.export`).

``python -m lightning_3d.checkpoint inspect CKPT`` prints what a checkpoint holds after reading
every tensor and verifying the checksums recorded when it was written.

``python -m lightning_3d.checkpoint export-hf CKPT OUT_DIR [--tokenizer DIR] [--dtype bfloat16] [--force]``
writes a checkpoint of ``HFCausalLM`` (any layout: a ``.ckpt`` file or a sharded directory) as a
directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads (see
:mod:`lightning_3d.checkpoint.hf_export`); progress goes to stderr.

Every command verifies the checksums of what it reads, and no command writes onto its input (the
same path, inside a sharded input, or a directory holding it), ``--force`` or not. Errors print
one line ``error: ...`` on stderr and exit with code 2 (bad input), before anything is written,
or 3 when the output cannot be written (no space left, a read-only file system, no permission:
the line names the output and the cause; no partial file is left)
(:mod:`lightning_3d.runtime.exit_codes`).
"""

from __future__ import annotations

import argparse
import errno
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from lightning_3d.checkpoint.checks import inspect_checkpoint
from lightning_3d.checkpoint.export import export_safetensors
from lightning_3d.checkpoint.hf_export import DTYPES, export_hf
from lightning_3d.runtime.exit_codes import BAD_INPUT, IO_ERROR
from lightning_3d.runtime.failures import io_error_words

USAGE_ERROR = BAD_INPUT
# What makes an output unwritable, as opposed to a wrong path given (a missing input: exit 2).
_CANNOT_WRITE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in the same one-line form as the tool's own."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m lightning_3d.checkpoint`` argument parser."""
    parser = _Parser(prog="python -m lightning_3d.checkpoint", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    consolidate = commands.add_parser(
        "consolidate",
        aliases=["export"],
        help="export the model weights of a Lightning checkpoint as one safetensors file",
    )
    consolidate.set_defaults(run=_consolidate)
    consolidate.add_argument(
        "checkpoint", help="Lightning checkpoint (.ckpt file or sharded directory)"
    )
    consolidate.add_argument("output", help="safetensors file to write (written atomically)")
    consolidate.add_argument(
        "--prefix",
        default=None,
        help="LightningModule attribute prefix to strip from every name (default: the first dotted "
        "component when all names share it, e.g. 'model.'; '' keeps names unchanged)",
    )
    consolidate.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    _add_export_hf(commands)
    inspect = commands.add_parser(
        "inspect", help="verify a checkpoint's checksums and print what it holds"
    )
    inspect.set_defaults(run=_inspect)
    inspect.add_argument(
        "checkpoint", help=".ckpt file, sharded checkpoint directory or .safetensors file"
    )
    return parser


def _add_export_hf(commands: Any) -> None:
    export = commands.add_parser(
        "export-hf",
        help="write an HFCausalLM checkpoint as a Hugging Face model directory (from_pretrained)",
    )
    export.add_argument(
        "checkpoint", help="HFCausalLM checkpoint: a .ckpt file or a sharded checkpoint directory"
    )
    export.add_argument(
        "out_dir", help="directory to write (written under a temporary name, then renamed)"
    )
    export.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="tokenizer directory to include (default: the model's `path` hyper-parameter when it has one)",
    )
    export.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast floating weights (default: keep the checkpoint's dtypes, bit for bit)",
    )
    export.add_argument("--force", action="store_true", help="replace OUT_DIR if it is not empty")
    export.set_defaults(run=_export_hf)


def _consolidate(args: argparse.Namespace) -> None:
    result = export_safetensors(args.checkpoint, args.output, prefix=args.prefix, force=args.force)
    stripped = f", prefix {result.prefix!r} stripped" if result.prefix else ""
    print(
        f"wrote {result.num_tensors} tensors ({result.num_params:,} parameters, {result.num_bytes:,} bytes"
        f"{stripped}) to {result.path}"
    )


def _export_hf(args: argparse.Namespace) -> None:
    result = export_hf(
        args.checkpoint,
        args.out_dir,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        force=args.force,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    tokenizer = f", tokenizer from {result.tokenizer}" if result.tokenizer else ", no tokenizer"
    print(
        f"wrote {result.architecture} ({result.num_params:,} parameters, {'/'.join(result.dtypes)}{tokenizer}) "
        f"to {result.path}: {', '.join(result.files)}"
    )


def _inspect(args: argparse.Namespace) -> None:
    info = inspect_checkpoint(args.checkpoint)
    checked = {None: "none (safetensors)", -1: "none recorded (not verified)"}.get(
        info["verified"], f"{info['verified']} verified"
    )
    print(
        f"{info['path']}: {info['format']}, {info['bytes']:,} bytes, {len(info['shapes'])} tensors "
        f"({info['num_params']:,} parameters), step {info['global_step']}, epoch {info['epoch']}, "
        f"optimizer state {'yes' if info['has_optimizer_states'] else 'no'}; checksums: {checked}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, or 2 or 3 after printing ``error: ...``)."""
    args = build_parser().parse_args(argv)
    code, _ = reported(lambda: args.run(args))
    return code


def reported(action: Callable[[], Any]) -> tuple[int, Any]:
    """Run ``action`` as a command does: bad input becomes one ``error:`` line on stderr and
    exit code 2, an output it cannot write (a full or read-only disk) one line and 3, and each
    warning one ``warning:`` line after it succeeded. Returns the exit code and what ``action``
    returned (``None`` after an error)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = action()
    except OSError as error:
        if error.errno in _CANNOT_WRITE:
            print(f"error: {_one_line(io_error_words(error))}", file=sys.stderr)
            return IO_ERROR, None
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return USAGE_ERROR, None
    except (ValueError, ImportError) as error:
        # The error alone, without the warnings before it.
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return USAGE_ERROR, None
    for warning in caught:  # e.g. a checkpoint without checksums: one line each
        if issubclass(warning.category, UserWarning):
            print(f"warning: {_one_line(warning.message)}", file=sys.stderr)
    return 0, result


def _one_line(message: object) -> str:
    return " ".join(str(message).split())  # whatever the library's message looked like


if __name__ == "__main__":
    sys.exit(main())
