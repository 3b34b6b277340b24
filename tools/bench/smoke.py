"""One training step of ``strategy="3d"`` per layout family on one device, one line a case.

The first GPU check (``bash .ci/gpu smoke``): a minute that says which options run at all on
this device before the long steps spend ten. Each case is :func:`~tools.harness.runs.fit_gpt`
on a world of one (``run_world``, as ``tests/test_cuda.py`` runs its cases) for one optimizer
step, and prints ``ok <name> (<seconds> s)``, ``FAIL <name>: <one line>`` or
``skip <name>: <reason>``; the exit code is 1 when any case failed::

    python -m tools.bench.smoke [--accelerator gpu|cpu] [--dry-run] [--only NAME ...]

All cases run in one child process, one after another (one start-up, one process group: a
second ``Trainer`` reuses the group), each inside its own ``try``. A case whose error looks like
the device's own (a CUDA or NCCL error, which can leave the CUDA context unusable for the rest
of the process), or after which the device no longer synchronizes, ends that child: the cases
left run in a fresh one. A child that dies outright costs only the case it was running.

Without CUDA (``--accelerator cpu``, or none visible) the same cases run on the CPU over gloo,
except those that need a GPU, which print ``skip``. Nothing here imports Hydra or OmegaConf:
the device image has neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

# The model and data are the CPU tests' tiny ones; the text is cut short because one step needs
# a few batches, not the 400 kB a parity run tokenizes.
DATA = {"max_bytes": 60_000}
# tests/support/qlora.py's shape: every adapted weight a multiple of NF4's 64 x 256 blocks.
QLORA_WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_key_value_heads": 4}
ADAPTER = {"r": 4, "lora_alpha": 8}
# What a device error says: the CUDA context may be unusable after it, so the rest start afresh.
DEVICE_ERROR = re.compile(r"CUDA|cuda|cuBLAS|CUBLAS|cuDNN|NCCL|device-side|illegal memory")


@dataclasses.dataclass(frozen=True)
class Case:
    """One smoke case: ``ThreeDStrategy`` keywords and what else its run changes.

    ``gpu_only`` says why the case cannot run on a CPU (``None``: it can); ``needs`` names
    modules it imports (missing: skipped, not failed); ``ranks`` above 1: a layout one device
    cannot hold (skipped with the options' own refusal); ``save``: a checkpoint is written after
    the step and must exist; ``cpu_strategy``: keywords changed on the CPU fall-back.
    """

    name: str
    strategy: dict[str, Any]
    precision: str = "32-true"
    arch: str = "gpt"
    model: Optional[dict[str, Any]] = None
    gpu_only: Optional[str] = None
    needs: tuple[str, ...] = ()
    ranks: int = 1
    save: bool = False
    cpu_strategy: Optional[dict[str, Any]] = None


# Layout cases at the Trainer's default precision, so each tests its layout alone; the offload
# cases at bf16-mixed, as tests/test_cuda.py runs them (the precision offload is used with).
CASES: tuple[Case, ...] = (
    Case("zero0", {"zero_stage": 0}),
    Case("zero1", {"zero_stage": 1}),
    Case("zero2", {"zero_stage": 2}),
    Case("zero3", {"zero_stage": 3}),
    Case("offload_cpu", {"offload": "cpu"}, "bf16-mixed"),
    Case("offload_nvme", {"offload": "nvme", "offload_chunk_mb": 0.01}, "bf16-mixed"),
    Case(
        "zero3_offload_params",
        {"zero_stage": 3, "offload": "cpu", "offload_params": True},
        "bf16-mixed",
    ),
    Case("bf16_mixed", {"zero_stage": 0}, "bf16-mixed"),
    Case(
        "fp16_mixed",
        {"zero_stage": 0},
        "16-mixed",
        gpu_only="16-mixed is a CUDA precision (Lightning runs bf16 on a CPU)",
    ),
    # Inductor on the device; on a CPU, aot_eager: the same compiled blocks without a C++ build
    # that would take most of a CPU run's minute.
    Case("compile", {"compile": True}, "bf16-mixed", cpu_strategy={"compile_backend": "aot_eager"}),
    Case("ac_full", {"ac_policy": "full"}),
    Case("ac_selective", {"ac_policy": "selective"}),
    Case(
        "lora",
        {"zero_stage": 0},
        "bf16-mixed",
        arch="hf_llama",
        model={"adapter": {"method": "lora", **ADAPTER}},
        needs=("transformers", "peft"),
    ),
    Case(
        "qlora",
        {"zero_stage": 0},
        "bf16-mixed",
        arch="hf_llama",
        model={"adapter": {"method": "qlora", **ADAPTER}, "hf": QLORA_WIDE},
        needs=("transformers", "peft", "torchao"),
    ),
    Case("context2", {"context": 2}, ranks=2),
    Case("checkpoint", {"zero_stage": 3}, save=True),
)
CASE_NAMES = tuple(case.name for case in CASES)


def skip_reason(case: Case, accelerator: str) -> Optional[str]:
    """Why ``case`` cannot run on one ``accelerator`` device here, or ``None``."""
    import importlib.util

    if accelerator == "cpu" and case.gpu_only:
        return case.gpu_only
    missing = [name for name in case.needs if importlib.util.find_spec(name) is None]
    if missing:
        return f"{', '.join(missing)} not importable"
    if case.ranks > 1:
        from lightning_3d import ThreeDStrategy

        try:
            ThreeDStrategy(**case.strategy).plan.resolved(1)
        except ValueError as error:
            return f"needs {case.ranks} ranks ({error})"
    return None


def case_run(case: Case, accelerator: str, scratch: Path) -> Run:
    """``case`` as a one-step :class:`Run` on one ``accelerator`` device, its files in ``scratch``."""
    strategy = dict(case.strategy)
    if accelerator == "cpu" and case.cpu_strategy:
        strategy.update(case.cpu_strategy)
    if strategy.get("offload") == "nvme":
        strategy["offload_path"] = str(scratch)
    return Run(
        strategy=strategy,
        accelerator=accelerator,
        steps=1,
        arch=case.arch,
        model=case.model,
        data=DATA,
        trainer={"precision": case.precision, "gradient_clip_val": 1.0},
        save_to=str(scratch / "smoke.ckpt") if case.save else None,
        save_every_n_steps=1 if case.save else None,
        initial_state=False,
        summary_warmup=0,
    )


def check(case: Case, result: dict[str, Any], accelerator: str, scratch: Path) -> None:
    """Raise when the step ran but did not do what it should have."""
    import math

    losses = result["losses"]
    if len(losses) != 1 or not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"expected one finite loss, got {losses}")
    rank = result["summary"]["ranks"][0]
    if accelerator == "gpu" and not rank.get("device_peak_mb", 0) > 0:
        raise RuntimeError("no device memory was used: the step ran on the CPU")
    if case.save and not list(scratch.glob("smoke-step=*")):
        raise RuntimeError(f"no checkpoint written in {scratch}")


def one_line(error: BaseException) -> str:
    """The error's type and the first line of its message, short enough for one log line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def device_broken(accelerator: str) -> bool:
    """Whether the CUDA context no longer works (a sticky error from the case before)."""
    if accelerator != "gpu":
        return False
    import torch

    try:
        torch.cuda.synchronize()
        return False
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return True


def run_cases(rank: int, cases: list[Case], accelerator: str, record: str) -> None:
    """Run ``cases`` in this process (a world of one), printing a line each and appending
    ``{"name", "status", "line"}`` to ``record``; stop early when the device looks broken."""
    for case in cases:
        start = time.monotonic()
        poisoned = False
        with tempfile.TemporaryDirectory(prefix=f"smoke-{case.name}-") as scratch:
            try:
                result = fit_gpt(rank, case_run(case, accelerator, Path(scratch)))
                check(case, result, accelerator, Path(scratch))
                line, status = f"ok {case.name} ({time.monotonic() - start:.2f} s)", "ok"
            except Exception as error:  # noqa: BLE001 - each case reports its own error
                line, status = f"FAIL {case.name}: {one_line(error)}", "failed"
                poisoned = bool(DEVICE_ERROR.search(str(error)))
        print(line, flush=True)
        with open(record, "a") as out:
            out.write(json.dumps({"name": case.name, "status": status, "line": line}) + "\n")
        if poisoned or device_broken(accelerator):
            return  # the caller starts a fresh process for the cases left


def smoke(
    cases: list[Case],
    accelerator: str,
    timeout_s: float = 300.0,
    child: Callable = run_cases,
) -> dict[str, str]:
    """Run ``cases`` on one ``accelerator`` device; ``{name: "ok" | "failed" | "skipped"}``.

    ``child(rank, cases, accelerator, record)`` runs the cases in a world of one (tests pass
    their own to plant a crash); a child that dies fails the case it was on and a fresh one
    takes the rest, until ``timeout_s`` is spent (the cases left are then skipped).
    """
    statuses: dict[str, str] = {}
    todo = []
    for case in cases:
        reason = skip_reason(case, accelerator)
        if reason is None:
            todo.append(case)
        else:
            print(f"skip {case.name}: {reason}", flush=True)
            statuses[case.name] = "skipped"
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="smoke-") as tmp:
        record = str(Path(tmp) / "record.jsonl")
        while todo:
            left = deadline - time.monotonic()
            if left <= 0:
                for case in todo:
                    print(f"skip {case.name}: out of time ({timeout_s:g} s)", flush=True)
                    statuses[case.name] = "skipped"
                break
            error: Optional[BaseException] = None
            try:
                run_world(child, 1, todo, accelerator, record, timeout=left)
            except (RuntimeError, TimeoutError) as exc:  # the child died or hung
                error = exc
            done = _read(record)
            statuses.update({name: done[name] for name in done})
            todo = [case for case in todo if case.name not in done]
            if error is not None and todo:  # the case it was running when it ended
                case, todo = todo[0], todo[1:]
                reason = "timed out" if isinstance(error, TimeoutError) else _last_line(error)
                print(f"FAIL {case.name}: the process running it ended: {reason}", flush=True)
                statuses[case.name] = "failed"
    return statuses


def _read(record: str) -> dict[str, str]:
    if not os.path.exists(record):
        return {}
    with open(record) as lines:
        return {entry["name"]: entry["status"] for entry in map(json.loads, lines)}


def _last_line(error: BaseException) -> str:
    """The innermost line of a child's traceback (``run_world`` reports the whole of it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(error).__name__


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.smoke", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--accelerator", default=None, help="gpu or cpu (default: gpu where CUDA is available)"
    )
    parser.add_argument("--dry-run", action="store_true", help="list the cases, run nothing")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="these cases")
    parser.add_argument(
        "--timeout-s", type=float, default=300.0, help="for all cases; the rest are skipped"
    )
    args = parser.parse_args(argv)
    problems = [f"unknown case {n!r}" for n in args.only or () if n not in CASE_NAMES]
    if args.accelerator not in (None, "gpu", "cpu"):
        problems.append(f"--accelerator must be gpu or cpu, got {args.accelerator!r}")
    if not args.timeout_s > 0:
        problems.append(f"--timeout-s must be positive, got {args.timeout_s:g}")
    if problems:
        print(f"error: {'; '.join(problems)} (cases: {' '.join(CASE_NAMES)})", file=sys.stderr)
        raise SystemExit(2)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    import torch

    cuda = torch.cuda.is_available()
    accelerator = args.accelerator or ("gpu" if cuda else "cpu")
    if accelerator == "gpu" and not cuda:
        print("error: --accelerator gpu, but no CUDA device is visible", file=sys.stderr)
        return 2
    cases = [case for case in CASES if args.only is None or case.name in args.only]
    if args.dry_run:
        for case in cases:
            reason = skip_reason(case, accelerator)
            options = ", ".join(
                f"{k}={v!r}" for k, v in case_run(case, accelerator, Path("TMP")).strategy.items()
            )
            print(
                f"{case.name}: {case.arch}, {case.precision}, {options}"
                + (f" (skip: {reason})" if reason else "")
            )
        return 0
    start = time.monotonic()
    statuses = smoke(cases, accelerator, args.timeout_s)
    counts = {s: sum(v == s for v in statuses.values()) for s in ("ok", "failed", "skipped")}
    print(
        f"smoke ({accelerator}): {counts['ok']} ok, {counts['failed']} failed, "
        f"{counts['skipped']} skipped in {time.monotonic() - start:.0f} s",
        flush=True,
    )
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
