"""The benchmark harness: rows, interleaved repeats, theory next to measurement, the table.

A row is one engine and layout training the same GPT for the same steps on the same global
batch. Repeats are interleaved (A B C A B C ...) so that a slow minute on a shared machine hits
every row alike, and each row reports the median of its repeats' tokens/s.

Theory per row (E = 4 bytes per fp32 element, Ψ parameters, N data-parallel ranks):

- model state per rank: :func:`lightning_3d.observe.memory.zero_formula_bytes` at the row's ZeRO stage,
  with Ψ_rank (the rank's pipeline stage or tensor slice) for pipeline and tensor rows;
- bytes sent per rank per step (ring algorithm): data-parallel all-reduce, or ZeRO-1/2
  reduce-scatter + all-gather: 2(N-1)/N·EΨ; ZeRO-3 (gather for forward, again for backward,
  reduce-scatter): 3(N-1)/N·EΨ; tensor parallel (Megatron: per block two all-reduces forward and
  two backward, plus the vocab-parallel embedding forward and the head's input gradient):
  (4L+2)·2(t-1)/t·E·B·T·C; pipeline (each micro-batch's activation or its gradient crosses one
  stage boundary): E·B·T·C per rank, plus the data-parallel term over Ψ_rank; context (c ranks,
  n = B·T·C/c elements of each of q, k, v per layer): the data-parallel term over N = data × c,
  plus per layer 2n(3c-2)·E (ring) or 8n(c-1)/c·E (all-to-all);
- pipeline bubble: (p-1)/(m+p-1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lightning_3d.observe.memory import zero_formula_bytes
from tools.bench import cell
from tools.bench.moe import moe_formula, moe_kwargs, moe_theory

E = 4  # bytes per fp32 element


@dataclass(frozen=True)
class Row:
    """One benchmark row: which engine, which layout, how many processes."""

    engine: str  # "lightning" or "deepspeed"
    kind: str  # lightning: 3d / ddp / fsdp / mp; deepspeed: zero / pipe
    world: int
    options: dict[str, Any] = field(default_factory=dict)
    zero_stage: int = 0  # for the formulas
    arch: str = "gpt"  # "moe": the MoE GPT (tools/bench/moe.py), its own theory

    @property
    def pipeline(self) -> int:
        return self.options.get("pipeline", 1)

    @property
    def tensor(self) -> int:
        return self.options.get("tensor", 1)

    @property
    def context(self) -> int:
        return self.options.get("context", 1)

    @property
    def dp(self) -> int:
        return self.world // (self.pipeline * self.tensor * self.context)


ROWS: dict[str, Row] = {
    "ddp": Row("lightning", "ddp", 2),
    "ddp_w4": Row("lightning", "ddp", 4),
    **{f"3d_zero{s}": Row("lightning", "3d", 2, {"zero_stage": s}, s) for s in range(4)},
    "3d_tp2": Row("lightning", "3d", 2, {"tensor": 2}),
    "3d_pp2": Row("lightning", "3d", 2, {"pipeline": 2, "schedule": "1f1b"}),
    "3d_pp2_dp2": Row("lightning", "3d", 4, {"pipeline": 2, "schedule": "1f1b"}),
    **{
        f"3d_cp2_{scheme}": Row("lightning", "3d", 2, {"context": 2, "context_scheme": scheme})
        for scheme in ("ring", "alltoall")
    },
    "lightning_fsdp": Row("lightning", "fsdp", 2, {}, 3),
    "lightning_mp": Row("lightning", "mp", 2, {}, 3),
    **{f"ds_zero{s}": Row("deepspeed", "zero", 2, {"zero_stage": s}, s) for s in (1, 2, 3)},
    "ds_zero2_offload": Row("deepspeed", "zero", 2, {"zero_stage": 2, "offload": True}, 2),
    "ds_pipe2": Row("deepspeed", "pipe", 2, {"pipeline": 2}),
    **{
        name: Row("lightning", "3d", world, {"expert": ep, "zero_stage": s}, s, arch="moe")
        for name, world, ep, s in (
            ("3d_moe_ep1", 2, 1, 1),
            ("3d_moe_ep2", 2, 2, 1),
            ("3d_moe_ep1_zero3", 2, 1, 3),
            ("3d_moe_ep1_w4_zero3", 4, 1, 3),
            ("3d_moe_ep2_dp2_zero3", 4, 2, 3),
        )
    },
}
BASELINE = {2: "ddp", 4: "ddp_w4"}
SPEED_TARGETS = {"3d_zero0": 0.98, "3d_zero1": 0.98, "3d_zero2": 0.95}  # x ddp, medians
ZERO3_TARGET = 1.05  # x Lightning's FSDP (and ModelParallel), median of paired repeats


def check_settings(cfg: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming every bad value, before any process starts."""
    unknown = [r for r in cfg["rows"] if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known rows: {sorted(ROWS)}")
    for key in ("steps", "repeats", "micro_batches"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    if not 0 <= int(cfg["comm_skip"]) < int(cfg["steps"]):
        raise ValueError(f"comm_skip ({cfg['comm_skip']}) must be in [0, steps={cfg['steps']})")
    batch, m, model = cfg["data"]["batch_size"], cfg["micro_batches"], cfg["model"]
    for name in cfg["rows"]:
        row = ROWS[name]
        per_dp = batch // row.dp
        if batch % row.dp or (row.pipeline > 1 and per_dp % m):
            raise ValueError(
                f"row {name}: global batch_size ({batch}) must split over data ({row.dp})"
                + (f" and then micro_batches ({m})" if row.pipeline > 1 else "")
            )
        if row.pipeline > model["n_layer"]:
            raise ValueError(
                f"row {name}: pipeline ({row.pipeline}) exceeds n_layer ({model['n_layer']})"
            )
        if model["block_size"] % (2 * row.context) or (
            row.options.get("context_scheme") == "alltoall" and model["n_head"] % row.context
        ):
            raise ValueError(
                f"row {name}: context ({row.context}) needs block_size ({model['block_size']}) "
                f"divisible by {2 * row.context} (all-to-all: n_head ({model['n_head']}) by it)"
            )
        experts = moe_kwargs(cfg)["n_experts"]
        if row.arch == "moe" and experts % row.options["expert"]:
            raise ValueError(
                f"row {name}: expert ({row.options['expert']}) must divide moe.n_experts "
                f"({experts})"
            )
        if model["n_head"] % row.tensor or model["n_embd"] % row.tensor:
            raise ValueError(
                f"row {name}: tensor ({row.tensor}) must divide n_head ({model['n_head']}) "
                f"and n_embd ({model['n_embd']})"
            )


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


@contextlib.contextmanager
def rank_environment(variables: dict[str, str]) -> Iterator[None]:
    """Set variables the spawned ranks inherit (malloc reads its own at process start); restore after."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def row_spec(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The picklable description a rank process trains from."""
    row = ROWS[name]
    options = dict(row.options)
    if row.pipeline > 1 and row.engine == "lightning":
        options["micro_batches"] = cfg["micro_batches"]
    # windows as long as the model's T.
    data = {**cfg["data"], "block_size": cfg["model"]["block_size"]}
    keys = ("steps", "warmup_steps", "comm_skip", "micro_batches", "seed")
    return {
        "arch": row.arch,
        "moe": moe_kwargs(cfg) if row.arch == "moe" else {},
        "kind": row.kind,
        "options": options,
        "world": row.world,
        "model": dict(cfg["model"]),
        "data": data,
        **{k: cfg[k] for k in keys},
    }


def run_row(name: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One run of a row on fresh processes; the per-rank results."""
    from tools.bench.peers import fit_deepspeed, fit_lightning
    from tools.harness.world import run_world

    row = ROWS[name]
    fn: Callable = fit_lightning if row.engine == "lightning" else fit_deepspeed
    # Spawned, never forked from a warm server: the rows compare peak RSS, which a fork would inherit.
    return run_world(
        fn,
        row.world,
        row_spec(name, cfg),
        timeout=float(cfg.get("timeout_s", 900)),
        start_method="spawn",
    )


def run_all(cfg: dict[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every selected row ``repeats`` times, interleaved; return raw results and skip notes."""
    check_settings(cfg)
    rows = list(cfg["rows"])
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    if not deepspeed_available():
        for name in rows:
            if ROWS[name].engine == "deepspeed":
                skipped[name] = "skipped: `import deepspeed` fails (pip install deepspeed)"
    active = [r for r in rows if r not in skipped]
    runs: dict[str, list[list[dict[str, Any]]]] = {r: [] for r in active}
    env = {
        "MALLOC_MMAP_THRESHOLD_": str(cfg["malloc_mmap_threshold"]),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    with rank_environment(env):
        for repeat in range(cfg["repeats"]):
            for name in active:
                if name in skipped:
                    continue
                try:
                    runs[name].append(run_row(name, cfg))
                except (RuntimeError, TimeoutError) as error:
                    errors[name] = str(error)
                    skipped[name] = f"failed: {errors[name].strip().splitlines()[-1][:200]}"
                    log(f"[repeat {repeat + 1}] {name}: {skipped[name]}")
                    continue
                tps = runs[name][-1][0]["summary"]["tokens_per_s"]
                log(f"[repeat {repeat + 1}/{cfg['repeats']}] {name}: {tps:.0f} tokens/s")
    return {
        "runs": {k: v for k, v in runs.items() if k not in skipped},
        "skipped": skipped,
        "errors": errors,
    }


def _rank_info(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: RSS, model-state bytes, bubble, Ψ_rank, bytes sent per step."""
    out = []
    for i, res in enumerate(results):
        ranks = res["summary"]["ranks"]
        mine = ranks[i] if len(ranks) == len(results) else ranks[0]
        state = mine.get(
            "state_bytes",
            mine.get("param_bytes", 0)
            + mine.get("grad_bytes", 0)
            + mine.get("optimizer_state_bytes", 0),
        )
        out.append(
            {
                "peak_rss_mb": mine["peak_rss_mb"],
                "state_bytes": state,
                "psi_rank": res["psi_rank"],
                "bubble_fraction": mine.get("bubble_fraction"),
                "sent_bytes": res["comm"]["sent_bytes"],
                "comm_ops": res["comm"]["ops"],
            }
        )
    return out


def theory(name: str, cfg: dict[str, Any], psi: int, psi_rank: int) -> dict[str, float]:
    """Model-state bytes and bytes sent per step for one rank of a row, from the formulas above."""
    row, model = ROWS[name], cfg["model"]
    if row.arch == "moe":
        return moe_theory(cfg, row.world, row.options)
    n, t = row.dp * row.context, row.tensor  # gradients are averaged over data × context
    uses_rank_psi = row.pipeline > 1 or t > 1
    memory = zero_formula_bytes(psi_rank if uses_rank_psi else psi, row.zero_stage, n)
    dp_psi = psi_rank if uses_rank_psi else psi
    dp_factor = 3 if row.zero_stage == 3 else 2
    sent = dp_factor * (n - 1) / n * E * dp_psi
    btc = (cfg["data"]["batch_size"] // row.dp) * model["block_size"] * model["n_embd"] * E
    if row.context > 1:  # attention's exchanges: n = B·T/cp·C elements of each of q, k, v
        c, qkv = row.context, btc / row.context
        ring = row.options.get("context_scheme", "ring") == "ring"
        sent += model["n_layer"] * (2 * qkv * (3 * c - 2) if ring else 8 * qkv * (c - 1) / c)
    if t > 1:
        sent += (4 * model["n_layer"] + 2) * 2 * (t - 1) / t * btc
    if row.pipeline > 1:
        sent += btc
    return {"state_bytes": memory, "sent_bytes": sent}


def full_param_count(model: dict[str, Any]) -> int:
    """Ψ of the whole model, built on ``meta`` (engines that shard report only their local numel)."""
    import torch

    from lightning_3d.models import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(**model)).num_params()


def summarize(cfg: dict[str, Any], raw: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per row: medians, theory and ratios (the JSON and the table are made from these)."""
    records, psi = [], full_param_count(cfg["model"])
    for name in cfg["rows"]:
        if name not in raw["runs"]:
            records.append({"row": name, "note": raw["skipped"].get(name, "not run")})
            continue
        repeats = raw["runs"][name]
        row, first = ROWS[name], repeats[0]
        ranks = _rank_info(first)
        per_rank = [theory(name, cfg, psi, r["psi_rank"]) for r in ranks]
        row_psi = per_rank[0].get("num_params", psi)
        worst = max(range(len(ranks)), key=lambda i: ranks[i]["state_bytes"])
        bubbles = [r["bubble_fraction"] for r in ranks if r["bubble_fraction"] is not None]
        m, p = cfg["micro_batches"], row.pipeline
        records.append(
            {
                "row": name,
                "engine": row.engine,
                "world": row.world,
                "num_params": row_psi,
                "tokens_per_s_runs": [rep[0]["summary"]["tokens_per_s"] for rep in repeats],
                "tokens_per_s": statistics.median(
                    rep[0]["summary"]["tokens_per_s"] for rep in repeats
                ),
                "peak_rss_mb": statistics.median(
                    max(x["peak_rss_mb"] for x in _rank_info(rep)) for rep in repeats
                ),
                "state_bytes": ranks[worst]["state_bytes"],
                "state_formula_bytes": per_rank[worst]["state_bytes"],
                "sent_bytes": statistics.mean(r["sent_bytes"] for r in ranks),
                "sent_theory_bytes": statistics.mean(t["sent_bytes"] for t in per_rank),
                "bubble_fraction": statistics.mean(bubbles) if bubbles else None,
                "bubble_ideal": (p - 1) / (m + p - 1)
                if p > 1 and row.engine == "lightning"
                else None,
                "ranks": ranks,
            }
        )
    by_name = {r["row"]: r for r in records}
    for rec in records:
        base = by_name.get(BASELINE.get(rec.get("world", 0), ""), {})
        if "tokens_per_s" in rec and base.get("tokens_per_s"):
            rec["vs_ddp"] = rec["tokens_per_s"] / base["tokens_per_s"]
            # Repeat i of a row ran next to repeat i of ddp: their ratios show the spread.
            paired = zip(rec["tokens_per_s_runs"], base["tokens_per_s_runs"])
            rec["vs_ddp_runs"] = [mine / theirs for mine, theirs in paired]
    return records


def spread(values: list[float], spec: str) -> str:
    """`` (min–max)`` of ``values`` formatted by ``spec``; empty for fewer than two values."""
    if len(values) < 2:
        return ""
    return f" ({min(values):{spec}}–{max(values):{spec}})"


def paired_ratio(records: list[dict[str, Any]], row: str, peer: str) -> Optional[list[float]]:
    """Per repeat, ``row``'s tokens/s over ``peer``'s (adjacent runs); ``None`` if either is
    missing."""
    by = {r["row"]: r for r in records if "note" not in r}
    if row not in by or peer not in by:
        return None
    pairs = zip(by[row]["tokens_per_s_runs"], by[peer]["tokens_per_s_runs"])
    return [mine / theirs for mine, theirs in pairs]


def formula(name: str) -> str:
    """The formulas behind a row's theory columns, in words (state; bytes sent)."""
    row = ROWS[name]
    if row.arch == "moe":
        return moe_formula(row.options, row.world)
    psi = "Ψ_rank" if row.pipeline > 1 or row.tensor > 1 else "Ψ"
    state = f"ZeRO-{row.zero_stage}({psi}, N={row.dp * row.context})"
    dp = {0: "AR 2(N-1)/N", 3: "AG+AG+RS 3(N-1)/N"}.get(
        row.zero_stage, "RS+AG 2(N-1)/N"
    ) + f"·E{psi}"
    if row.context > 1:
        scheme = row.options.get("context_scheme", "ring")
        attention = "2n(3c-2)" if scheme == "ring" else "8n(c-1)/c"
        return f"{state}; {dp} + L·{attention}·E, n=B·T·C/c"
    if row.tensor > 1:
        return f"{state}; (4L+2)·2(t-1)/t·E·BTC"
    if row.pipeline > 1:
        return f"{state}; E·BTC" + (f" + {dp}" if row.dp > 1 else "")
    return f"{state}; {dp}"


def table(records: list[dict[str, Any]]) -> str:
    """The markdown table: one line per row, skipped rows with their note."""
    mb = 2**20
    lines = [
        "| row | world | tokens/s (min–max) | x ddp (min–max) | peak RSS MB | state MB/rank | "
        "formula MB | state/formula | sent MB/rank/step | theory MB | sent/theory | bubble | "
        "ideal bubble | formulas |",
        "|---" * 14 + "|",
    ]
    for r in records:
        if "note" in r:
            lines.append(f"| {r['row']} | {r['note']} |" + " |" * 12)
            continue
        lines.append(
            f"| {r['row']} | {r['world']} | "
            f"{r['tokens_per_s']:.0f}{spread(r['tokens_per_s_runs'], '.0f')} | "
            f"{cell(r.get('vs_ddp'), '.2f')}{spread(r.get('vs_ddp_runs', []), '.2f')} | "
            f"{r['peak_rss_mb']:.0f} | {r['state_bytes'] / mb:.2f} | {r['state_formula_bytes'] / mb:.2f} | "
            f"{r['state_bytes'] / r['state_formula_bytes']:.3f} | {r['sent_bytes'] / mb:.2f} | "
            f"{r['sent_theory_bytes'] / mb:.2f} | {r['sent_bytes'] / max(r['sent_theory_bytes'], 1):.3f} | "
            f"{cell(r['bubble_fraction'], '.3f')} | {cell(r['bubble_ideal'], '.3f')} | {formula(r['row'])} |"
        )
    return "\n".join(lines)


def target_misses(records: list[dict[str, Any]]) -> list[str]:
    """The issue's targets that this run misses, one sentence each."""
    by = {r["row"]: r for r in records if "note" not in r}
    misses = [f"{r['row']}: not measured ({r['note']})" for r in records if "note" in r]
    for row, target in SPEED_TARGETS.items():
        if row in by and by[row].get("vs_ddp", target) < target:
            misses.append(f"{row} at {by[row]['vs_ddp']:.2f}x ddp tokens/s (target >= {target})")
    for peer in ("lightning_fsdp", "lightning_mp"):
        ratios = paired_ratio(records, "3d_zero3", peer)
        if ratios and statistics.median(ratios) < ZERO3_TARGET:
            misses.append(
                f"3d_zero3 at {statistics.median(ratios):.2f}x {peer} tokens/s "
                f"(median of paired repeats; target >= {ZERO3_TARGET})"
            )
    for r in by.values():
        memory = r["state_bytes"] / r["state_formula_bytes"]
        if abs(memory - 1) > 0.10:
            misses.append(
                f"{r['row']}: model state {memory:.3f}x the ZeRO formula (target within 10%)"
            )
        if r["sent_theory_bytes"] > 0 and abs(r["sent_bytes"] / r["sent_theory_bytes"] - 1) > 0.10:
            misses.append(
                f"{r['row']}: bytes sent {r['sent_bytes'] / r['sent_theory_bytes']:.3f}x theory "
                "(target within 10%)"
            )
    return misses
