"""The planner's predicted step time next to measured runs on this machine, layout by layout.

    python -m lightning_3d.planner.calibration --time [--rounds 3] [--layouts single dp2_z0 ...]

Trains :data:`TIME_MODEL` (a GPT big enough that its matmuls, not Python, take most of a step,
yet a run takes seconds on a CPU) in every layout of :data:`TIME_LAYOUTS` — world 1 (Lightning's
single device, both cores) and world 2 (gloo, one core per rank) — for :data:`STEPS` optimizer
steps and takes the median step time after the run summary's warm-up steps. A shared machine's
speed drifts from minute to minute, so the layouts are run in **rounds** (every layout once per
round, the world-2 ones in one world per round), each round first measuring the machine's
constants (:mod:`lightning_3d.planner.machine`) under the same load; the order rotates from
round to round (:func:`rotated`). Two tables are printed: medians over rounds of step times,
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

from lightning_3d.planner.auto import CPU_OPTIONS
from lightning_3d.planner.choice import PlannerOptions
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.facts import ModelFacts
from lightning_3d.planner.layouts import TIME_LAYOUTS, choice_of
from lightning_3d.planner.machine import MachineConstants
from lightning_3d.planner.timing import StepTime, step_time

TIME_MODEL = dict(n_layer=4, n_head=4, n_embd=256, block_size=128)  # 3.3 M parameters, ~20 GFLOP a step
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
        raise ValueError(f"need two sequences of one length >= 2, got {len(xs)} and {len(ys)} values")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def verdict(measured: Mapping[str, float], predicted: Mapping[str, float], tolerance: float = 0.10
            ) -> dict[str, Any]:
    """Compare step times by layout name: ``first_choice`` (predicted fastest; among equal
    predictions the first in ``predicted``'s order, which :func:`calibrate` gives as
    :data:`TIME_LAYOUTS`', simplest first, the planner's own tie-break), ``fastest`` (measured
    fastest), ``gap`` (first choice's measured time / fastest's − 1), ``within`` (``gap <=
    tolerance``) and ``spearman``. ``ValueError`` when the names differ."""
    if set(measured) != set(predicted) or not measured:
        raise ValueError(f"measured layouts {sorted(measured)} and predicted {sorted(predicted)} must be the same, "
                         "non-empty")
    names = list(predicted)
    first = min(names, key=lambda n: round(predicted[n], 9))  # min keeps the first of equals
    fastest = min(names, key=lambda n: measured[n])
    gap = measured[first] / measured[fastest] - 1
    rho = spearman([measured[n] for n in names], [predicted[n] for n in names]) if len(names) > 1 else 1.0
    return {"first_choice": first, "fastest": fastest, "gap": gap, "within": gap <= tolerance, "spearman": rho,
            "misordered": confident_misorders(measured, predicted)}


def confident_misorders(measured: Mapping[str, float], predicted: Mapping[str, float], margin: float = 0.2
                        ) -> list[tuple[str, str]]:
    """Pairs ``(a, b)`` the planner predicts apart by more than ``margin`` (``a`` faster:
    ``predicted[b] > (1 + margin) · predicted[a]``) but that measure the other way round. Close
    predictions are not judged: on a noisy machine their order is a coin toss."""
    if set(measured) != set(predicted):
        raise ValueError(f"measured layouts {sorted(measured)} and predicted {sorted(predicted)} must be the same")
    return [(a, b) for a in predicted for b in predicted
            if predicted[b] > (1 + margin) * predicted[a] and measured[b] < measured[a]]


def cluster_of(constants: MachineConstants, world: int) -> Cluster:
    """This machine as the planner's :class:`Cluster` for a ``world``-rank run (memory is not
    what is calibrated here: generous)."""
    return Cluster(nodes=1, devices_per_node=world, device_memory_gb=1e3, host_memory_gb=1e3,
                   intra_node_gbps=constants.intra_node_gbps, inter_node_gbps=constants.intra_node_gbps,
                   peak_tflops=constants.gflops[world] / 1e3, host_link_gbps=10.0)


def options_of(constants: MachineConstants, batch: int, seq_len: int, world: int) -> PlannerOptions:
    """Planner options with the measured constants: the measured block rate is the peak
    (``efficiency=1``); CPU ranks' communication does not overlap (``CPU_OPTIONS``)."""
    return PlannerOptions(batch_size=batch, seq_len=seq_len, precision="32-true", efficiency=1.0, **CPU_OPTIONS,
                          latency_us=constants.latency_us, launch_overhead_us=constants.launch_overhead_us,
                          forward_share=constants.forward_share,
                          **({"adam_params_per_s": constants.adam_params_per_s[world]}
                             if constants.adam_params_per_s else {}))


def predict(facts: ModelFacts, name: str, constants: MachineConstants) -> StepTime:
    """The planner's step time of layout ``name`` of :data:`TIME_LAYOUTS` with ``constants``."""
    strategy, world = TIME_LAYOUTS[name]
    batch = TIME_DATA["batch_size"]
    return step_time(facts, choice_of(strategy, world, batch), cluster_of(constants, world),
                     options_of(constants, batch, facts.seq_len, world))


def _step_seconds(summary: Mapping[str, Any]) -> float:
    """Median step time after warm-up, from a run summary (global tokens per step / tokens/s)."""
    return TIME_DATA["batch_size"] * TIME_DATA["block_size"] / summary["tokens_per_s"]


def _run(rank: int, name: str, steps: int) -> float:
    from lightning_3d.testing.runs import Run, fit_gpt

    strategy, world = TIME_LAYOUTS[name]
    run = Run(strategy=strategy, devices=world, steps=steps, model=TIME_MODEL, data=TIME_DATA)
    return _step_seconds(fit_gpt(rank, run)["summary"])


def _world_round(rank: int, names: Sequence[str], steps: int) -> dict[str, Any]:
    """One round on a rank of the 2-process world: the constants, then each layout once."""
    from lightning_3d.planner.machine import _rank_probe

    probe = _rank_probe(rank, TIME_MODEL["n_embd"], TIME_DATA["batch_size"] // 2, TIME_DATA["block_size"],
                        SIZES, 15)
    return {"probe": probe, "times": {name: _run(rank, name, steps) for name in names}}


def _single_round(steps: int) -> tuple[float, float, float, float]:
    """(block GFLOP/s, matmul GFLOP/s, AdamW parameters/s with a 1-rank world's threads, step
    seconds of ``single``), in this process."""
    import torch

    from lightning_3d.planner.machine import adam_params_per_s, block_rate, matmul_gflops, threads_per_rank

    threads = threads_per_rank(1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch, seq = TIME_DATA["batch_size"], TIME_DATA["block_size"]
        rate = matmul_gflops(TIME_MODEL["n_embd"], batch * seq, threads)
        block, _ = block_rate(TIME_MODEL["n_embd"], batch, seq, threads)
        adam = adam_params_per_s(1 << 21, threads)
        return block, rate, adam, _run(0, "single", steps)
    finally:
        torch.set_num_threads(before)


def measure_round(names: Sequence[str], steps: int = STEPS) -> tuple[MachineConstants, dict[str, float]]:
    """One round: every layout of ``names`` once, in that order (``single``, in this process,
    before or after the 2-process world's runs as it is named first or not), with the constants
    measured just before each world's runs. Returns (the constants, step seconds by name)."""
    from lightning_3d.planner.machine import from_probes, threads_per_rank
    from lightning_3d.testing.world import run_world

    unknown = [n for n in names if n not in TIME_LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout(s) {unknown}; known: {list(TIME_LAYOUTS)}")
    measured: dict[str, float] = {}
    alone = None
    if names and names[0] == "single":
        *alone, measured["single"] = _single_round(steps)
    pair = [n for n in names if TIME_LAYOUTS[n][1] == 2]
    probes = [{"gflops": 1.0, "matmul_gflops": 1.0, "overhead_us": 0.0, "forward_share": 1 / 3,
               "adam_params_per_s": 1e8, "allreduce_s": [1e-4, 1e-3]}]  # no world of 2 measured: not used
    if pair:
        results = run_world(_world_round, 2, pair, steps)
        probes = [r["probe"] for r in results]
        measured.update({n: statistics.median(r["times"][n] for r in results) for n in pair})
    if "single" in names and alone is None:
        *alone, measured["single"] = _single_round(steps)
    if alone is None:
        alone = [statistics.median(p[k] for p in probes) for k in ("gflops", "matmul_gflops", "adam_params_per_s")]
    found = from_probes(probes, SIZES, 2, alone[0], alone[1], {1: threads_per_rank(1), 2: threads_per_rank(2)},
                        alone[2])
    return found, measured


def combine(found: Sequence[MachineConstants], how: str = "median") -> MachineConstants:
    """One set of constants from every round's: ``"median"`` of each, or the ``"best"`` (fastest
    rates, least latency and overhead: the machine at its quietest, to set against the
    fastest round of each layout)."""
    if how not in ("median", "best") or not found:
        raise ValueError(f"how={how!r} must be 'median' or 'best', with constants of >= 1 round (got {len(found)})")
    fast, slow = (statistics.median, statistics.median) if how == "median" else (max, min)
    matmul = None if found[0].matmul_gflops is None else {w: fast(c.matmul_gflops[w] for c in found)
                                                          for w in found[0].matmul_gflops}
    adam = None if found[0].adam_params_per_s is None else {w: fast(c.adam_params_per_s[w] for c in found)
                                                            for w in found[0].adam_params_per_s}
    return MachineConstants({w: fast(c.gflops[w] for c in found) for w in found[0].gflops},
                            fast(c.intra_node_gbps for c in found), slow(c.latency_us for c in found),
                            slow(c.launch_overhead_us for c in found), dict(found[0].threads),
                            forward_share=statistics.median(c.forward_share for c in found), matmul_gflops=matmul,
                            adam_params_per_s=adam)


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
    return model_facts(module, seq_len=TIME_DATA["block_size"], precision="32-true", tp_sizes=(1, 2), name="time")


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


def summarise(measured: Mapping[str, Sequence[float]], found: Sequence[MachineConstants], how: str = "median"
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
    return {"measured": {n: list(measured[n]) for n in names}, "predicted": predicted, "constants": list(found),
            "combined": constants, "how": how, "verdict": verdict(medians, guesses), "medians": medians,
            "guesses": guesses}


def _adam(c: MachineConstants) -> str:
    if not c.adam_params_per_s:
        return "not measured"
    return " / ".join(f"{c.adam_params_per_s[w] / 1e6:.0f}" for w in sorted(c.adam_params_per_s)) + " M params/s"


def table(result: Mapping[str, Any]) -> str:
    """The README's table: layouts by measured time, with prediction, parts and both ranks."""
    medians, guesses = result["medians"], result["guesses"]
    measured_rank = dict(zip(medians, ranks(list(medians.values()))))
    predicted_rank = dict(zip(guesses, ranks(list(guesses.values()))))
    lines = [f"| layout | measured s, {result['how']} (min-max over rounds) | predicted s | "
             "compute / comm / bubble / optimizer | measured rank | predicted rank |", "|---|---|---|---|---|---|"]
    for name in sorted(medians, key=medians.get):
        runs, t = result["measured"][name], result["predicted"][name]
        lines.append(f"| {name} | {medians[name]:.3f} ({min(runs):.3f}-{max(runs):.3f}) | {guesses[name]:.3f} | "
                     f"{t.compute:.3f} / {t.comm:.3f} / {t.bubble:.3f} / {t.optimizer:.3f} | "
                     f"{measured_rank[name]:g} | {predicted_rank[name]:g} |")
    v = result["verdict"]
    lines.append("")
    lines.append(f"Spearman rank correlation {v['spearman']:.2f}; planner's first choice {v['first_choice']} "
                 f"measured {100 * v['gap']:.1f}% slower than the fastest ({v['fastest']}): "
                 f"{'within' if v['within'] else 'NOT within'} 10%. Predicted >20% apart yet measured the other "
                 f"way: {', '.join(f'{a} < {b}' for a, b in v['misordered']) or 'none'}.")
    for i, c in [*enumerate(result["constants"]), (result["how"], result["combined"])]:
        mm = c.matmul_gflops or {1: float("nan"), 2: float("nan")}
        lines.append(f"round {i}: block {c.gflops[1]:.1f} GFLOP/s (world 1, {c.threads[1]} threads) / "
                     f"{c.gflops[2]:.1f} per rank (world 2) [bare matmul {mm[1]:.1f} / {mm[2]:.1f}]; forward share "
                     f"{c.forward_share:.2f}; AdamW {_adam(c)}; gloo {c.intra_node_gbps:.2f} GB/s, "
                     f"{c.latency_us:.0f} us; block overhead {c.launch_overhead_us:.0f} us")
    return "\n".join(lines)


def raw(result: Mapping[str, Any]) -> dict[str, Any]:
    """What was measured, as JSON data: per layout the step seconds of every round, and every
    round's constants (enough to predict again with another time model: :func:`repredict`)."""
    return {"measured": dict(result["measured"]), "constants": [c.as_dict() for c in result["constants"]]}


def repredict(data: Mapping[str, Any], how: str = "median") -> dict[str, Any]:
    """:func:`summarise` of saved :func:`raw` data, predicted with today's time model."""
    found = [MachineConstants(**{k: ({int(w): v for w, v in c[k].items()} if isinstance(c[k], dict) else c[k])
                                 for k in c}) for c in data["constants"]]
    return summarise(data["measured"], found, how)


def main(names: Sequence[str], rounds: int, save: Optional[str] = None) -> None:
    result = calibrate(names, rounds)
    if save:
        import json

        with open(save, "w") as f:
            json.dump(raw(result), f, indent=1)
    print(table(result), flush=True)
    print(table(summarise(result["measured"], result["constants"], "best")), flush=True)
