"""Every decoder family of the installed ``transformers`` under every layout, against one process.

    python -m tools.harness.hf_matrix [--families qwen3 gemma2 ...] [--layouts tp2 pp2_eager ...]
                                             [--out table.md] [--rows rows.json]

(``--rows``: rows kept in a JSON file after each family, so a rerun of a few families updates
the whole table, and an interrupted run keeps what it measured.)

For each family whose config ships a tensor or pipeline plan (``registry_families``), plus GPT-2
and StableLM (no plan): a tiny random config (``tiny_config``: 4 layers, 4 heads over 2 k/v heads,
vocabulary 256, no dropout), 3 fp32 steps on the byte corpus, each layout compared with one
process on the losses (1e-5) and on every tensor's update (1e-3 relative). A cell reads:

* ``ok`` — the layout reproduces one process;
* ``ok (fp64)`` — it does not in fp32, and the same gradients do in fp64 with SGD (losses 1e-9,
  updates 1e-5 relative or 1e-12 absolute per element, :data:`FP64`): the same model, rounded
  differently. A layout sums in another order (a split matmul, a reduction over ranks), and
  where a gradient is small or mathematically zero (a key bias the softmax ignores, a router
  whose choice cannot change, a decay rate of a linear-attention head) Adam divides that
  rounding by the gradient's own size, an update of up to ``lr`` in a random direction. SGD's
  update is linear in the gradient, so in fp64 it differs only where the gradients do: a missing
  reduction or a wrong split still differs by O(1), rounding by 1e-12. (Adam's own state under
  each layout is what the fp32 stage checks on every other tensor, and the ZeRO parity tests.)
  Measured on ``lara_mini`` dp2 × tp2: fp64 with Adam still 6e-5 on a decay rate, and one
  process against itself with the batch in two accumulated halves 1.3e-6 on the same tensor;
  fp64 with SGD 1.4e-7;
* ``packed_chat`` (a column, not a layout: one process, no training) — ``ok`` where every
  conversation of a packed row (positions restarting at 0, as ``data=chat`` packs) gives the
  logits of the same conversation alone, within :data:`PACKED_TOLERANCE`; ``refused`` where
  ``data.packing=true`` is refused for the family (``lightning_3d.families.mixers``);
  ``DIFFERS`` where it leaks and nothing refuses it. ``cp2`` is a layout like the others;
* ``refused`` — refused before launch (the launcher's check on a ``meta`` model) or at the first
  forward (a pipeline split the model's forward does not allow), with the reason;
* ``DIFFERS`` / ``CRASH`` — a bug: a silently different model, or a failure that is not a refusal;
* a family whose tiny config cannot be built (sizes it derives that the generic ones do not fit)
  is listed with the reason instead of a row of cells.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

LAYOUTS: dict[str, tuple[int, dict, Optional[str]]] = {
    "tp2": (2, {"tensor": 2}, None),
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}, None),
    "pp2_sdpa": (2, {"pipeline": 2}, "sdpa"),
    "pp2_eager": (2, {"pipeline": 2}, "eager"),
    "dp2_zero3": (2, {"data": 2, "zero_stage": 3}, None),
    "dp2_tp2": (4, {"data": 2, "tensor": 2, "zero_stage": 1}, None),
    "cp2": (2, {"context": 2}, None),
}
# Not a layout: one process, each conversation of a packed row against the same one alone.
PACKED = "packed_chat"
COLUMNS = [*LAYOUTS, PACKED]
EXTRA_FAMILIES = ("gpt2", "stablelm")  # ship no plan: recognised by their module names
MAX_PARAMS = 5_000_000  # a "tiny" config that the generic sizes leave larger is not built
STEPS, SEED = 3, 1234
# The largest relative loss difference, relative update error and absolute update error per
# element of an ok cell. fp32 (AdamW): no absolute floor (a wrong reduction can be small). fp64
# (SGD): 1e-12 per element is a millionth of a typical SGD update of these runs (1e-6 per element
# at lr 3e-3) and ten thousand times the noise a mathematically-zero gradient leaves.
FP32 = (1e-5, 1e-3, 0.0)
FP64 = (1e-9, 1e-5, 1e-12)
PACKED_TOLERANCE = 1e-4  # fp32 logits, packed or alone: 1e-7 where the mask keeps them apart
FP64_OPTIMIZER = "sgd"  # linear in the gradient (momentum 0.9): see the module docstring
TIMEOUT_S = (
    240  # per world: a family whose tiny forward is slow (reference kernels in Python) is cut off
)


@dataclass
class Cell:
    state: str  # ok, refused, DIFFERS, CRASH, skipped
    detail: str = ""
    figures: Optional[tuple[float, float]] = (
        None  # ok: the worst relative loss difference and update error
    )

    def markdown(self) -> str:
        return self.state if not self.detail else f"{self.state}: {self.detail}"


def _first_line(text: str, limit: int = 160) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    for marks in (("ValueError:", "ReplicaMismatch:"), ("Error:",)):  # a refusal's own words first
        wanted = [
            line
            for line in lines
            if any(m in line for m in marks) and "Connection closed" not in line
        ]
        if wanted:
            return wanted[-1][:limit]
    return (lines or [""])[-1][:limit]


def _config(family: str, attn: Optional[str], precision: str = "32-true") -> dict:
    from tools.harness.hf_configs import tiny_config

    hf = tiny_config(family)
    if (
        precision == "64-true"
    ):  # torch's grouped_mm has no fp64 kernel: transformers' loop over experts
        return {
            "hf": {**hf, "experts_implementation": "eager"},
            "attn_implementation": attn,
            "optimizer": FP64_OPTIMIZER,
        }
    return {"hf": hf, "attn_implementation": attn}


def _run(
    family: str,
    attn: Optional[str],
    strategy: Optional[dict] = None,
    world: int = 1,
    precision: str = "32-true",
) -> dict:
    """The run in processes of its own (one process too: a family's memory or time stays there),
    given at most :data:`TIMEOUT_S`."""
    from tools.harness.runs import Run, fit_gpt
    from tools.harness.world import run_world

    run = Run(
        strategy=strategy,
        devices=world,
        steps=STEPS,
        seed=SEED,
        arch="hf",
        model=_config(family, attn, precision),
        trainer={"precision": precision},
    )
    return run_world(fit_gpt, world, run, timeout=TIMEOUT_S)[0]


def buildable(family: str) -> Optional[str]:
    """``None``, or why the family's tiny config cannot be built here."""
    import torch
    import transformers

    from tools.harness.hf_configs import tiny_config

    try:
        options = dict(tiny_config(family))
        config = transformers.AutoConfig.for_model(options.pop("model_type"), **options)
        with torch.device("meta"):
            count = sum(
                p.numel()
                for p in transformers.AutoModelForCausalLM.from_config(config).parameters()
            )
    except Exception as err:  # noqa: BLE001 - any failure of a family's own constructor
        return f"tiny config not buildable ({type(err).__name__}: {_first_line(str(err), 100)})"
    if count > MAX_PARAMS:
        return f"tiny config not buildable ({count / 1e6:.0f} M parameters: the family derives sizes of its own)"
    return None


def packed_cell(family: str) -> Cell:
    """The packed-chat cell: ``refused`` where ``data.packing=true`` is refused for the family
    (the app's check on a ``meta`` model), else two conversations packed in one row of the
    family's tiny model against each alone: ``ok`` within :data:`PACKED_TOLERANCE`, or
    ``DIFFERS`` (a leak between conversations that nothing refused)."""
    import torch

    from lightning_3d.families.mixers import check_packing
    from lightning_3d.models.hf import HFCausalLM

    config = _config(family, None)["hf"]
    try:
        with torch.device("meta"):
            module = HFCausalLM(config=config)
        check_packing(module)
    except ValueError as err:
        return Cell("refused", _first_line(str(err)))
    leak = packed_leak(config)
    if leak > PACKED_TOLERANCE:
        return Cell("DIFFERS", f"a packed conversation's logits differ from it alone by {leak:.1e}")
    return Cell("ok", figures=(leak, 0.0))


def packed_leak(config: dict, lengths: tuple[int, ...] = (9, 7, 16)) -> float:
    """The largest logit difference between conversations of ``lengths`` tokens packed in one
    row (positions restarting at 0, as ``data=chat`` packs them) and each one alone, on the
    model of ``config`` (seeded random init, fp32)."""
    import torch

    from lightning_3d.models.hf import HFCausalLM

    torch.manual_seed(SEED)
    model = HFCausalLM(config=config).eval()
    generator = torch.Generator().manual_seed(SEED)
    conversations = [torch.randint(3, 250, (1, n), generator=generator) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, sum(lengths))
    with torch.no_grad():
        packed = model(torch.cat(conversations, 1), position_ids=positions)
        worst, start = 0.0, 0
        for ids in conversations:
            alone = model(ids)
            part = packed[:, start : start + ids.shape[1]]
            worst = max(worst, (part - alone).abs().max().item())
            start += ids.shape[1]
    return worst


def refused_before_launch(family: str, layout: str) -> Optional[str]:
    """The launcher's check on a ``meta`` model: ``None``, or its ``ValueError``."""
    import torch

    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.options import Plan
    from lightning_3d.options.model_check import check

    world, strategy, attn = LAYOUTS[layout]
    config = _config(family, attn)
    try:
        with torch.device("meta"):
            module = HFCausalLM(config=config["hf"], attn_implementation=attn)
        check(module, Plan.from_options(**strategy), world)
    except ValueError as err:
        return _first_line(str(err))
    return None


def mismatches(run: dict, reference: dict, tolerances: tuple[float, float, float]) -> list[str]:
    from tools.harness.parity import loss_mismatches, update_mismatches

    loss_rtol, update_rtol, update_atol = tolerances
    return loss_mismatches(run["losses"], reference["losses"], rtol=loss_rtol) + update_mismatches(
        run["state"],
        reference["state"],
        reference["initial_state"],
        rtol=update_rtol,
        atol=update_atol,
    )


def cell(family: str, layout: str, reference: dict, fp64_references: Optional[dict] = None) -> Cell:
    """The layout's cell; a layout that differs in fp32 is run again, with its reference, in fp64
    (``fp64_references``: attention implementation -> the fp64 one-process run, filled here)."""
    fp64_references = {} if fp64_references is None else fp64_references
    reason = refused_before_launch(family, layout)
    if reason is not None:
        return Cell("refused", reason)
    world, strategy, attn = LAYOUTS[layout]
    try:
        run = _run(family, attn, strategy, world)
    except TimeoutError:
        return Cell("skipped", f"over {TIMEOUT_S} s on this machine")
    except Exception as err:  # noqa: BLE001 - a rank's failure, reported in the table
        text = str(err)
        if "cannot be split into pipeline stages" in text or "ReplicaMismatch" in text:
            return Cell("refused", _first_line(text))
        return Cell("CRASH", _first_line(text))
    problems = mismatches(run, reference, FP32)
    if not problems:
        return Cell(
            "ok",
            figures=(worst_loss_difference(run, reference), worst_update_error(run, reference)),
        )
    try:
        if attn not in fp64_references:
            fp64_references[attn] = _run(family, attn, precision="64-true")
        exact = _run(family, attn, strategy, world, precision="64-true")
    except Exception as err:  # noqa: BLE001 - no fp64 run to tell rounding from a bug
        return Cell(
            "DIFFERS", f"{'; '.join(problems[:2])} (no fp64 run: {_first_line(str(err), 100)})"
        )
    exact_problems = mismatches(exact, fp64_references[attn], FP64)
    if exact_problems:
        return Cell("DIFFERS", "; ".join(exact_problems[:2]) + " (in fp64)")
    return Cell(
        "ok (fp64)",
        f"fp32: {'; '.join(problems[:2])}; fp64 SGD: losses within "
        f"{worst_loss_difference(exact, fp64_references[attn]):.0e}, updates within "
        f"{worst_update_error(exact, fp64_references[attn], FP64[2]):.0e} relative (tensors whose "
        f"update differs by under {FP64[2]:.0e} per element left out)",
    )


def worst_loss_difference(run: dict, reference: dict) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))


def worst_update_error(run: dict, reference: dict, atol: float = 0.0) -> float:
    """The largest relative error of a tensor's update (``parity.update_mismatches``' measure),
    over the tensors whose update differs by more than ``atol`` per element."""
    worst = 0.0
    for name, got in run["state"].items():
        start = reference["initial_state"].get(name)
        if start is None:
            continue
        want = reference["state"][name].double() - start.double()
        diff = (got.double() - start.double() - want).norm()
        if atol and diff.item() <= atol * want.numel() ** 0.5:
            continue
        worst = max(worst, (diff / want.norm().clamp_min(1e-30)).item())
    return worst


def family_row(family: str, layouts: list[str]) -> tuple[Optional[str], dict[str, Cell]]:
    """(why the family was not run, or ``None``; its cells)."""
    reason = buildable(family)
    if reason is not None:
        return reason, {}
    references: dict[Optional[str], Any] = {}
    fp64_references: dict[Optional[str], Any] = {}
    cells = {}
    for layout in layouts:
        if layout == PACKED:
            cells[layout] = packed_cell(family)
            continue
        reason = refused_before_launch(family, layout)
        if reason is not None:  # no one-process reference needed
            cells[layout] = Cell("refused", reason)
            continue
        attn = LAYOUTS[layout][2]
        try:
            if attn not in references:
                references[attn] = _run(family, attn)
        except TimeoutError:
            cells[layout] = Cell("skipped", f"one process takes over {TIMEOUT_S} s on this machine")
            continue
        except Exception as err:  # noqa: BLE001 - one process fails: nothing to compare with
            cells[layout] = Cell("skipped", f"one process fails ({_first_line(str(err), 100)})")
            continue
        cells[layout] = cell(family, layout, references[attn], fp64_references)
    return None, cells


def table(rows: dict[str, tuple[Optional[str], dict[str, Cell]]], layouts: list[str]) -> str:
    lines = ["| family | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
    skipped = []
    for family, (reason, cells) in rows.items():
        if reason is not None:
            skipped.append(f"- `{family}`: {reason}")
            continue
        lines.append(
            f"| `{family}` | " + " | ".join(cells[layout].state for layout in layouts) + " |"
        )
    notes = sorted(
        {
            f"- `{family}` {layout}: {c.markdown()}"
            for family, (_, cells) in rows.items()
            for layout, c in cells.items()
            if c.state != "ok"
        }
    )
    figures = {
        layout: [
            c.figures
            for _, cells in rows.values()
            for lay, c in cells.items()
            if lay == layout and c.figures
        ]
        for layout in layouts
    }
    worst = [
        f"{max(f[0] for f in figures[lay]):.1e} / {max(f[1] for f in figures[lay]):.1e}"
        if figures[lay]
        else "—"
        for lay in layouts
    ]
    lines.append(
        "| largest loss / update difference of the `ok` cells | " + " | ".join(worst) + " |"
    )
    out = "\n".join(lines)
    if notes:
        out += "\n\nWhy each cell that is not `ok`:\n\n" + "\n".join(notes)
    if skipped:
        out += "\n\nNot run:\n\n" + "\n".join(skipped)
    return out


def save_rows(path: str, rows: dict[str, tuple[Optional[str], dict[str, Cell]]]) -> None:
    """``rows`` as JSON at ``path``, written whole to a temporary file first."""
    import json
    import os
    from dataclasses import asdict

    data = {
        family: {"reason": reason, "cells": {k: asdict(c) for k, c in cells.items()}}
        for family, (reason, cells) in rows.items()
    }
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def load_rows(path: str) -> dict[str, tuple[Optional[str], dict[str, Cell]]]:
    """The rows :func:`save_rows` wrote (none if ``path`` does not exist yet)."""
    import json
    import os

    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return {
        family: (
            row["reason"],
            {
                k: Cell(c["state"], c["detail"], tuple(c["figures"]) if c["figures"] else None)
                for k, c in row["cells"].items()
            },
        )
        for family, row in data.items()
    }


def main(argv: Optional[list[str]] = None) -> int:
    import os

    from tools.harness.hf_configs import registry_families

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+")
    parser.add_argument("--layouts", nargs="+", default=COLUMNS, choices=COLUMNS)
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument(
        "--rows",
        help="a JSON file of rows: read first (rows of an earlier run), the families "
        "run now replace theirs, rewritten after each family; the table shows them all",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("LIGHTNING3D_WORLD_START", "forkserver")
    order = [*registry_families(), *EXTRA_FAMILIES]
    families = args.families or order
    rows = load_rows(args.rows) if args.rows else {}
    start = time.monotonic()
    for index, family in enumerate(families, 1):
        rows[family] = family_row(family, args.layouts)
        if args.rows:
            save_rows(args.rows, rows)
        states = " ".join(f"{k}={c.state}" for k, c in rows[family][1].items()) or rows[family][0]
        print(
            f"[{index}/{len(families)} {time.monotonic() - start:.0f}s] {family}: {states}",
            file=sys.stderr,
            flush=True,
        )
    rows = {
        f: rows[f] for f in sorted(rows, key=lambda f: order.index(f) if f in order else len(order))
    }
    text = table(rows, args.layouts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    bad = [
        f
        for f, (_, cells) in rows.items()
        for c in cells.values()
        if c.state in ("DIFFERS", "CRASH")
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
