"""The planner's predicted step time next to measured runs on this machine, layout by layout.

    python -m tools.calibration.memory --time [--rounds 3] [--layouts single dp2_z0 ...]

Trains :data:`TIME_MODEL` (a GPT big enough that its matmuls, not Python, take most of a step,
yet a run takes seconds on a CPU) in every layout of :data:`TIME_LAYOUTS` — world 1 (Lightning's
single device, both cores) and world 2 (gloo, one core per rank) — for :data:`STEPS` optimizer
steps and takes the median step time after the run summary's warm-up steps. A shared machine's
speed drifts from minute to minute, so the layouts are run in **rounds** (every layout once per
round, the world-2 ones in one world per round), each round first measuring the machine's
constants (:mod:`tools.calibration.machine`) under the same load; the order rotates from
round to round (:func:`rotated`). Each world also trains the tests' tiny GPT for a few steps
(:func:`tools.calibration.machine.tiny_step_seconds`): what its step takes beyond the model's
prediction is that world's fixed cost per step. A round without a 2-rank layout measures no link
and no world-of-2 figure: they print as not measured. Two tables are printed: medians over rounds of step times,
predicted with the median constants, and each layout's fastest round ("best"), predicted with
the quietest constants (a shared machine only ever adds time); the min-max over rounds is the
noise.

The verdict (:func:`verdict`): the Spearman rank correlation of predicted and measured step
times, and the measured time of the planner's first choice (the layout predicted fastest)
over the fastest measured, which the target holds within 10%.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_3d.planner.choice import PlannerOptions
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.facts import ModelFacts
from lightning_3d.planner.timing import StepTime, step_time
from tools.calibration.layouts import TIME_LAYOUTS, choice_of
from tools.calibration.machine import (
    MachineConstants,
    machine_cluster,
    measured,
    planner_options,
    tiny_step_seconds,
)

# 3.3 M parameters, ~20 GFLOP a step.
TIME_MODEL = dict(n_layer=4, n_head=4, n_embd=256, block_size=128)
TIME_DATA = dict(block_size=128, batch_size=8)
STEPS = 7  # the run summary's median skips the first 3
SIZES = (256, 1 << 20)  # fp32 elements of the all-reduces that measure the link


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values`` (smallest first), ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks; ties get mean ranks); ``ValueError``
    unless both have the same length >= 2."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(
            f"need two sequences of one length >= 2, got {len(xs)} and {len(ys)} values"
        )
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def verdict(
    measured: Mapping[str, float], predicted: Mapping[str, float], tolerance: float = 0.10
) -> dict[str, Any]:
    """Compare step times by layout name: ``first_choice`` (predicted fastest; among equal
    predictions the first in ``predicted``'s order, which :func:`calibrate` gives as
    :data:`TIME_LAYOUTS`', simplest first, the planner's own tie-break), ``fastest`` (measured
    fastest), ``gap`` (first choice's measured time / fastest's − 1), ``within`` (``gap <=
    tolerance``) and ``spearman``. ``ValueError`` when the names differ."""
    if set(measured) != set(predicted) or not measured:
        raise ValueError(
            f"measured layouts {sorted(measured)} and predicted {sorted(predicted)} must be the same, "
            "non-empty"
        )
    names = list(predicted)
    first = min(names, key=lambda n: round(predicted[n], 9))  # min keeps the first of equals
    fastest = min(names, key=lambda n: measured[n])
    gap = measured[first] / measured[fastest] - 1
    rho = (
        spearman([measured[n] for n in names], [predicted[n] for n in names])
        if len(names) > 1
        else 1.0
    )
    return {
        "first_choice": first,
        "fastest": fastest,
        "gap": gap,
        "within": gap <= tolerance,
        "spearman": rho,
        "misordered": confident_misorders(measured, predicted),
    }


def confident_misorders(
    measured: Mapping[str, float], predicted: Mapping[str, float], margin: float = 0.2
) -> list[tuple[str, str]]:
    """Pairs ``(a, b)`` the planner predicts apart by more than ``margin`` (``a`` faster:
    ``predicted[b] > (1 + margin) · predicted[a]``) but that measure the other way round. Close
    predictions are not judged: on a noisy machine their order is a coin toss."""
    if set(measured) != set(predicted):
        raise ValueError(
            f"measured layouts {sorted(measured)} and predicted {sorted(predicted)} must be the same"
        )
    return [
        (a, b)
        for a in predicted
        for b in predicted
        if predicted[b] > (1 + margin) * predicted[a] and measured[b] < measured[a]
    ]


def cluster_of(constants: MachineConstants, world: int) -> Cluster:
    """This machine as the planner's :class:`Cluster` for a ``world``-rank run
    (:func:`tools.calibration.machine.machine_cluster`; memory is not what is calibrated
    here: generous)."""
    return machine_cluster(constants, world)


def options_of(constants: MachineConstants, batch: int, seq_len: int, world: int) -> PlannerOptions:
    """Planner options with the measured constants (:func:`tools.calibration.machine.planner_options`:
    the measured block rate is the peak, ``efficiency=1``; CPU ranks' communication does not
    overlap, ``CPU_OPTIONS``; every other modelled cost as measured)."""
    return planner_options(constants, batch, seq_len, world)


def predict(facts: ModelFacts, name: str, constants: MachineConstants) -> StepTime:
    """The planner's step time of layout ``name`` of :data:`TIME_LAYOUTS` with ``constants``."""
    strategy, world = TIME_LAYOUTS[name]
    batch = TIME_DATA["batch_size"]
    return step_time(
        facts,
        choice_of(strategy, world, batch),
        cluster_of(constants, world),
        options_of(constants, batch, facts.seq_len, world),
    )


def _step_seconds(summary: Mapping[str, Any]) -> float:
    """Median step time after warm-up, from a run summary (global tokens per step / tokens/s)."""
    return TIME_DATA["batch_size"] * TIME_DATA["block_size"] / summary["tokens_per_s"]


def _run(rank: int, name: str, steps: int) -> float:
    from tools.harness.runs import Run, fit_gpt

    strategy, world = TIME_LAYOUTS[name]
    run = Run(strategy=strategy, devices=world, steps=steps, model=TIME_MODEL, data=TIME_DATA)
    return _step_seconds(fit_gpt(rank, run)["summary"])


def _world_round(rank: int, names: Sequence[str], steps: int) -> dict[str, Any]:
    """One round on a rank of the 2-process world: the constants, then each layout once."""
    from tools.calibration.machine import rank_probe

    probe = rank_probe(
        rank, TIME_MODEL["n_embd"], TIME_DATA["batch_size"] // 2, TIME_DATA["block_size"], SIZES, 15
    )
    probe["tiny_step_s"] = tiny_step_seconds(rank, 2)
    times = {name: _run(rank, name, steps) for name in names}
    probe["gflops"] = max(probe["gflops"], _block_rate_again(TIME_DATA["batch_size"] // 2, 1))
    return {"probe": probe, "times": times}


def _block_rate_again(batch: int, threads: int) -> float:
    """The block rate measured once more after a world's runs. A round keeps the higher of the
    two: another job on this shared machine, for the second or so a measurement takes, can
    starve a process of its cores (two threads in one process lost 10-20x here: each waits for
    the other at every op), a moment the layouts' median steps mostly miss."""
    from tools.calibration.machine import block_rate

    return block_rate(TIME_MODEL["n_embd"], batch, TIME_DATA["block_size"], threads)[0]


def _single_round(steps: int) -> tuple[float, float, float, float, float]:
    """(block GFLOP/s, the higher of before and after the runs (:func:`_block_rate_again`), matmul
    GFLOP/s, AdamW parameters/s with a 1-rank world's threads, the tiny GPT's step seconds, step
    seconds of ``single``), in this process."""
    import torch

    from tools.calibration.machine import (
        adam_params_per_s,
        block_rate,
        matmul_gflops,
        threads_per_rank,
    )

    threads = threads_per_rank(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch, seq = TIME_DATA["batch_size"], TIME_DATA["block_size"]
        rate = matmul_gflops(TIME_MODEL["n_embd"], batch * seq, threads)
        block, _ = block_rate(TIME_MODEL["n_embd"], batch, seq, threads)
        adam = adam_params_per_s(1 << 21, threads)
        tiny, seconds = tiny_step_seconds(0, 1), _run(0, "single", steps)
        block = max(block, _block_rate_again(batch, threads))
        return block, rate, adam, tiny, seconds
    finally:
        torch.set_num_threads(before)


def measure_round(
    names: Sequence[str], steps: int = STEPS
) -> tuple[MachineConstants, dict[str, float]]:
    """One round: every layout of ``names`` once, in that order (``single``, in this process,
    before or after the 2-process world's runs as it is named first or not), with the constants
    measured just before each world's runs. Returns (the constants, step seconds by name).
    Without a 2-rank layout named no 2-process world runs: the link and the other figures only
    a world of 2 measures are left out (``nan``, printed as not measured), and the 1-process
    world's rates stand in for its rates."""
    from tools.calibration.machine import from_probes, step_overheads, threads_per_rank
    from tools.harness.world import run_world

    unknown = [n for n in names if n not in TIME_LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout(s) {unknown}; known: {list(TIME_LAYOUTS)}")
    measured: dict[str, float] = {}
    alone = None
    if names and names[0] == "single":
        *alone, measured["single"] = _single_round(steps)
    pair = [n for n in names if TIME_LAYOUTS[n][1] == 2]
    probes: list[dict[str, Any]] = []
    if pair:
        results = run_world(_world_round, 2, pair, steps)
        probes = [r["probe"] for r in results]
        measured.update({n: statistics.median(r["times"][n] for r in results) for n in pair})
    if "single" in names and alone is None:
        *alone, measured["single"] = _single_round(steps)
    threads = {1: threads_per_rank(1), 2: threads_per_rank(2)}
    if not probes:  # one process only: no link, no world of 2
        found = _alone_constants(alone, threads)
    else:
        if alone is None:
            alone = [
                statistics.median(p[k] for p in probes)
                for k in ("gflops", "matmul_gflops", "adam_params_per_s")
            ]
        found = from_probes(probes, SIZES, 2, alone[0], alone[1], threads, alone[2])
    tiny = {} if alone is None or len(alone) < 4 else {1: alone[3]}
    if probes:
        tiny[2] = statistics.median(p["tiny_step_s"] for p in probes)
    return step_overheads(found, tiny), measured


def _alone_constants(alone: Sequence[float], threads: Mapping[int, int]) -> MachineConstants:
    """Constants of a round that ran only the 1-process world: its rates for both world sizes,
    the link and the world-of-2 figures not measured (``nan``)."""
    block, matmul, adam = alone[:3]
    nan = float("nan")
    return MachineConstants(
        {1: block, 2: block},
        nan,
        nan,
        nan,
        dict(threads),
        forward_share=nan,
        matmul_gflops={1: matmul, 2: matmul},
        adam_params_per_s={1: adam, 2: adam},
        reduce_scatter_efficiency=nan,
        all_gather_efficiency=nan,
        tp_overhead=nan,
        selective_share=nan,
    )


def combine(found: Sequence[MachineConstants], how: str = "median") -> MachineConstants:
    """One set of constants from every round's: ``"median"`` of each, or the ``"best"`` (fastest
    rates and efficiencies, least latency and overheads: the machine at its quietest, to set
    against the fastest round of each layout). Shares (forward, selective) are medians either way."""
    if how not in ("median", "best") or not found:
        raise ValueError(
            f"how={how!r} must be 'median' or 'best', with constants of >= 1 round (got {len(found)})"
        )
    fast, slow = (statistics.median, statistics.median) if how == "median" else (max, min)

    def per_world(name: str, pick: Any) -> Optional[dict[int, float]]:
        first = getattr(found[0], name)
        return (
            None if first is None else {w: pick(getattr(c, name)[w] for c in found) for w in first}
        )

    return MachineConstants(
        per_world("gflops", fast),
        fast(c.intra_node_gbps for c in found),
        slow(c.latency_us for c in found),
        slow(c.launch_overhead_us for c in found),
        dict(found[0].threads),
        forward_share=statistics.median(c.forward_share for c in found),
        matmul_gflops=per_world("matmul_gflops", fast),
        adam_params_per_s=per_world("adam_params_per_s", fast),
        reduce_scatter_efficiency=fast(c.reduce_scatter_efficiency for c in found),
        all_gather_efficiency=fast(c.all_gather_efficiency for c in found),
        tp_overhead=slow(c.tp_overhead for c in found),
        selective_share=statistics.median(c.selective_share for c in found),
        step_overhead_us=per_world("step_overhead_us", slow),
    )


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` rotated by ``round_index`` and reversed on odd rounds: each layout runs early in
    some rounds and late in others, so drift within a round and the first run of a process
    (slower: caches, allocator) do not favour one layout."""
    k = round_index % len(names) if names else 0
    out = list(names[k:]) + list(names[:k])
    return out[::-1] if round_index % 2 else out


def time_facts() -> ModelFacts:
    """Planner facts of :data:`TIME_MODEL` at its block size, fp32."""
    import torch

    from lightning_3d.models import LitGPT
    from lightning_3d.planner.facts import model_facts

    with torch.device("meta"):
        module = LitGPT(**TIME_MODEL)
    return model_facts(
        module, seq_len=TIME_DATA["block_size"], precision="32-true", tp_sizes=(1, 2), name="time"
    )


def calibrate(names: Sequence[str], rounds: int = 3) -> dict[str, Any]:
    """``rounds`` rounds of :func:`measure_round` (layouts in :func:`rotated` order); every
    round's step seconds per layout and constants (:func:`raw`), and :func:`summarise`'s
    comparison of them with the planner's prediction."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    names = [n for n in TIME_LAYOUTS if n in names]  # simplest first: the planner's tie-break
    measured: dict[str, list[float]] = {n: [] for n in names}
    found = []
    for r in range(rounds):
        constants, times = measure_round(rotated(names, r))
        found.append(constants)
        for name in names:
            measured[name].append(times[name])
    return summarise(measured, found)


def summarise(
    measured: Mapping[str, Sequence[float]], found: Sequence[MachineConstants], how: str = "median"
) -> dict[str, Any]:
    """Per layout the measured step seconds of every round and their ``how`` (``"median"`` or
    ``"best"``: the fastest round), the planner's prediction with :func:`combine`'s constants
    (``how``), and their :func:`verdict`."""
    facts = time_facts()
    constants = combine(found, how)
    names = [n for n in TIME_LAYOUTS if n in measured]
    pick = statistics.median if how == "median" else min
    predicted = {n: predict(facts, n, constants) for n in names}
    medians = {n: pick(measured[n]) for n in names}
    guesses = {n: predicted[n].total for n in names}
    return {
        "measured": {n: list(measured[n]) for n in names},
        "predicted": predicted,
        "constants": list(found),
        "combined": constants,
        "how": how,
        "verdict": verdict(medians, guesses),
        "medians": medians,
        "guesses": guesses,
    }


def _adam(c: MachineConstants) -> str:
    if not c.adam_params_per_s:
        return "not measured"
    return (
        " / ".join(f"{c.adam_params_per_s[w] / 1e6:.0f}" for w in sorted(c.adam_params_per_s))
        + " M params/s"
    )


def table(result: Mapping[str, Any]) -> str:
    """The calibration table (docs/planner.md): layouts by measured time, with prediction, parts and both ranks."""
    medians, guesses = result["medians"], result["guesses"]
    measured_rank = dict(zip(medians, ranks(list(medians.values()))))
    predicted_rank = dict(zip(guesses, ranks(list(guesses.values()))))
    lines = [
        f"| layout | measured s, {result['how']} (min-max over rounds) | predicted s | "
        "compute / comm / bubble / optimizer / step overhead | measured rank | predicted rank |",
        "|---|---|---|---|---|---|",
    ]
    for name in sorted(medians, key=medians.get):
        runs, t = result["measured"][name], result["predicted"][name]
        lines.append(
            f"| {name} | {medians[name]:.3f} ({min(runs):.3f}-{max(runs):.3f}) | {guesses[name]:.3f} | "
            f"{t.compute:.3f} / {t.comm:.3f} / {t.bubble:.3f} / {t.optimizer:.3f} / {t.overhead:.3f} | "
            f"{measured_rank[name]:g} | {predicted_rank[name]:g} |"
        )
    v = result["verdict"]
    lines.append("")
    lines.append(
        f"Spearman rank correlation {v['spearman']:.2f}; planner's first choice {v['first_choice']} "
        f"measured {100 * v['gap']:.1f}% slower than the fastest ({v['fastest']}): "
        f"{'within' if v['within'] else 'NOT within'} 10%. Predicted >20% apart yet measured the other "
        f"way: {', '.join(f'{a} < {b}' for a, b in v['misordered']) or 'none'}."
    )
    for i, c in [*enumerate(result["constants"]), (result["how"], result["combined"])]:
        lines.append(f"round {i}: {constants_line(c)}")
    return "\n".join(lines)


def constants_line(c: MachineConstants) -> str:
    """One round's constants in words; figures a round did not measure say so."""
    mm = c.matmul_gflops or {1: float("nan"), 2: float("nan")}
    line = (
        f"block {c.gflops[1]:.1f} GFLOP/s (world 1, {c.threads[1]} threads) / {c.gflops[2]:.1f} per rank "
        f"(world 2) [bare matmul {mm[1]:.1f} / {mm[2]:.1f}]; AdamW {_adam(c)}; "
    )
    if not measured(c.intra_node_gbps):
        line += (
            "no world of 2 ran: gloo link, forward share, block overhead and the rest not measured"
        )
    else:
        line += (
            f"forward share {c.forward_share:.2f}; gloo {c.intra_node_gbps:.2f} GB/s, {c.latency_us:.0f} us; "
            f"block overhead {c.launch_overhead_us:.0f} us; reduce-scatter / all-gather efficiency "
            f"{c.reduce_scatter_efficiency:.2f} / {c.all_gather_efficiency:.2f}; tensor-parallel overhead "
            f"{c.tp_overhead:.2f}; selective checkpointing +{c.selective_share:.2f}"
        )
    steps = c.step_overhead_us or {}
    return (
        line
        + "; step overhead "
        + (
            " / ".join(f"{steps[w] / 1e3:.1f} ms (world {w})" for w in sorted(steps))
            or "not measured"
        )
    )


def raw(result: Mapping[str, Any]) -> dict[str, Any]:
    """What was measured, as JSON data: per layout the step seconds of every round, and every
    round's constants (enough to predict again with another time model: :func:`repredict`)."""
    return {
        "measured": dict(result["measured"]),
        "constants": [c.as_dict() for c in result["constants"]],
    }


def repredict(data: Mapping[str, Any], how: str = "median") -> dict[str, Any]:
    """:func:`summarise` of saved :func:`raw` data, predicted with today's time model."""
    found = [
        MachineConstants(
            **{
                k: ({int(w): v for w, v in c[k].items()} if isinstance(c[k], dict) else c[k])
                for k in c
            }
        )
        for c in data["constants"]
    ]
    return summarise(data["measured"], found, how)


def main(names: Sequence[str], rounds: int, save: Optional[str] = None) -> None:
    result = calibrate(names, rounds)
    if save:
        import json

        with open(save, "w") as f:
            json.dump(raw(result), f, indent=1)
    print(table(result), flush=True)
    print(table(summarise(result["measured"], result["constants"], "best")), flush=True)
