"""The planner's report: a ranked table of the layouts that fit and a summary of the rejected."""

from __future__ import annotations

from collections import Counter, defaultdict

from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.memory import GB, human
from lightning_3d.planner.search import Candidate, least_memory

HEADER = (
    "| # | method | dp×tp×pp | ZeRO | micro-batches | AC | offload | params | grads | optim | activ | buffers | "
    "total GB | compute | comm | bubble | optim step | offload | fixed | step | tokens/s | MFU |"
)


def _gb(value: float) -> str:
    return f"{value / GB:.2f}"


def _ms(value: float) -> str:
    ms = value * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def ranked_table(candidates: list[Candidate], top: int = 10) -> str:
    """Markdown rows of the ``top`` fitting layouts (memory in GB per rank, times in ms)."""
    rows = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    fitting = [c for c in candidates if c.fits][:top]
    for i, c in enumerate(fitting, 1):
        ch, m, t = c.choice, c.memory, c.time
        micro = (
            f"{ch.schedule} {ch.micro_batches}×{ch.micro_batch_size}"
            if ch.pipeline > 1
            else f"accum {ch.micro_batches}×{ch.micro_batch_size}"
        )
        micro += f" v{ch.virtual_stages}" if ch.virtual_stages > 1 else ""
        # ZeRO-3's units kept gathered through the accumulated step (zero3_keep_gathered).
        micro += " keep" if ch.zero3_keep_gathered else ""
        sp = " sp" if ch.sequence_parallel else ""
        cp = f" cp{ch.context} {ch.context_scheme}" if ch.context > 1 else ""  # data × context
        cp += f" ep{ch.expert}" if ch.expert > 1 else ""  # experts split over data ranks
        # The memory savings it runs with (the run's own and the rungs the search turned on).
        kit = f" + {ch.kit_label()}" if ch.kit_label() else ""
        rows.append(
            f"| {i} | {ch.adapter} | {ch.data}{cp}×{ch.tensor}{sp}×{ch.pipeline} | "
            f"{ch.zero_stage}{ch.masters_label()} | "
            f"{micro} | {ch.ac_policy} | "
            f"{ch.offload}{kit} | "
            f"{_gb(m.params)} | {_gb(m.grads)} | {_gb(m.optimizer)} | {_gb(m.activations)} | {_gb(m.buffers)} | "
            f"{_gb(m.total)} | {_ms(t.compute)} | {_ms(t.comm)} | {_ms(t.bubble)} | {_ms(t.optimizer)} | "
            f"{_ms(t.offload)} | {_ms(t.overhead)} | "
            f"{_ms(t.total)} | {c.tokens_per_s:,.0f} | {100 * c.mfu:.1f}% |"
        )
    return "\n".join(rows)


def method_summary(candidates: list[Candidate], methods: tuple[str, ...]) -> str:
    """One line per fine-tune method: its fastest fitting layout, or the least memory it needs."""
    lines = ["per method:"]
    for method in methods:
        mine = [c for c in candidates if c.choice.adapter == method]
        fitting = [c for c in mine if c.fits]
        if fitting:
            c = fitting[0]
            lines.append(
                f"  {method}: fits, {_gb(c.memory.total)} GB per rank, {c.tokens_per_s:,.0f} tokens/s "
                f"({c.choice.label()})"
            )
            continue
        least = least_memory(mine)
        lines.append(
            f"  {method}: nothing fits"
            + (
                f"; the least it needs is {human(least.memory.total)} per rank ({least.choice.label()})"
                if least is not None
                else ""
            )
        )
    return "\n".join(lines)


def rejected_summary(candidates: list[Candidate], examples: int = 2) -> str:
    """Counts of rejected layouts by reason, with a few examples each."""
    rejected = [c for c in candidates if not c.fits]
    if not rejected:
        return "rejected: none"
    counts = Counter(c.kind for c in rejected)
    by_kind: dict[str, list[Candidate]] = defaultdict(list)
    for c in rejected:
        by_kind[c.kind].append(c)
    lines = [f"rejected: {len(rejected)} layout(s)"]
    for kind, count in counts.most_common():
        lines.append(f"  {count} x {kind}")
        shown = sorted(by_kind[kind], key=lambda c: c.memory.total if c.memory else 0)[:examples]
        for c in shown:
            lines.append(f"      {c.choice.label()}: {c.reason}")
    return "\n".join(lines)


def nothing_fits(
    candidates: list[Candidate], cluster: Cluster, reserve_gb: float, offloads: tuple = ()
) -> str:
    """The ``error:`` sentence when no layout fits: what would."""
    best = least_memory(candidates)
    if best is None:
        reasons = sorted({c.reason for c in candidates if c.reason})[:3]
        return f"no layout fits {cluster.describe()}: " + "; ".join(reasons)
    need = best.memory.total / GB + reserve_gb
    return (
        f"no layout fits {cluster.device_memory_gb:g} GB per device: the least memory any layout needs is "
        f"{human(best.memory.total)} per rank ({best.choice.label()}); give cluster.device_memory_gb >= "
        f"{need:.3g} (with planner.reserve_gb={reserve_gb:g}), more devices, or a smaller planner.batch_size"
        + (
            ""
            if "cpu+params" in offloads
            else ", or try planner.offloads=[none,cpu,cpu+params,nvme,nvme+params] (ZeRO-3 parameter shards in "
            "host memory, Adam's state on NVMe)"
        )
    )
