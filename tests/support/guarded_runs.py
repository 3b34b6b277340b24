"""Reference runs under the device guard (run_world imports these by name)."""

from __future__ import annotations

from typing import Any

from tools.harness.runs import Run, fit_gpt


def guarded_fit(rank: int, run: Run, then: tuple = ()) -> dict[str, Any]:
    """``fit_gpt`` of ``run`` (then of each run of ``then``, e.g. a resume from its
    checkpoint) under :class:`~support.device_guard.DeviceGuard`; the result gains
    ``violations`` (strings, every site once) and ``collectives`` (the c10d ops
    it checked, by name)."""
    from support.device_guard import DeviceGuard

    with DeviceGuard() as guard:
        result = fit_gpt(rank, run)
        for later in then:
            result = fit_gpt(rank, later)
    result["violations"] = [str(v) for v in guard.violations]
    result["collectives"] = dict(guard.collectives)
    return result


def counted_fit(rank: int, run: Run) -> dict[str, Any]:
    """``fit_gpt`` of ``run`` under the guard, counting host reads of device values from the
    second step on (the first one sets up) to the end of training; the result gains ``reads`` (by call site),
    ``violations`` and ``collectives``."""
    from lightning_3d.observe.summary import RunSummary
    from support.device_guard import DeviceGuard

    guard = DeviceGuard()
    start = RunSummary.on_train_batch_start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        guard.counting = batch_idx >= 1
        return start(self, trainer, pl_module, batch, batch_idx)

    end = RunSummary.on_train_end

    def on_train_end(self, trainer, pl_module):
        guard.counting = False  # the summary's end-of-run reads are not a step's
        return end(self, trainer, pl_module)

    RunSummary.on_train_batch_start = on_train_batch_start  # this process is the test's own
    RunSummary.on_train_end = on_train_end
    with guard:
        result = fit_gpt(rank, run)
    result["reads"] = dict(guard.reads)
    result["violations"] = [str(v) for v in guard.violations]
    result["collectives"] = dict(guard.collectives)
    return result


def check_moe_reads(run: Run, world: int, layers: int) -> None:
    """Run ``run`` (a mixture-of-experts model with ``layers`` MoE layers) on ``world`` ranks
    under the guard: every collective takes device tensors, and from the second step on
    lightning_3d reads one device value per MoE layer and forward (the all-to-all's split sizes)
    besides the step agreement's verdict, nowhere else."""
    from tools.harness.world import run_world

    for result in run_world(counted_fit, world, run):
        assert not result["violations"], result["violations"]
        ours = {site: n for site, n in result["reads"].items() if site.startswith("lightning_3d/")}
        assert sum(ours.values()) == (run.steps - 1) * (1 + layers), ours
        assert all("agreement.py" in site or "expert.py" in site for site in ours), ours


def guarded_preemption(rank: int, root: str) -> dict[str, Any]:
    """SIGTERM to rank 1 during step 2 of a dp2 ZeRO-2 run (``support.faults``) under the guard:
    the signal's agreement, the stop on every rank and the preemption checkpoint."""
    import signal

    from support.device_guard import DeviceGuard
    from support.faults import fit_until_killed

    with DeviceGuard() as guard:
        result = fit_until_killed(rank, root, 4, 2, 1, 30.0, False, signal.SIGTERM)
    result["violations"] = [str(v) for v in guard.violations]
    return result


def guarded_replica_check(rank: int) -> dict[str, Any]:
    """:class:`~lightning_3d.parallel.replicas.ReplicaCheck` over the world, under the guard:
    replicas alike with one tensor missing (a parameter with no gradient), then replicas that
    differ on rank 1 only. Returns the violations and what each comparison raised."""
    import torch
    import torch.distributed as dist

    from lightning_3d.parallel.replicas import ReplicaCheck, ReplicaMismatch
    from support.device_guard import DeviceGuard

    dist.init_process_group("gloo")
    device = torch.device("cpu")
    raised = []
    try:
        with DeviceGuard() as guard:
            check = ReplicaCheck(device)
            alike = torch.arange(6.0, device=device)
            check.compare(
                "gradient", [("tensor ranks", dist.group.WORLD, [("a", alike), ("b", None)])]
            )
            apart = alike + (rank == 1)
            try:
                check.compare("value", [("tensor ranks", dist.group.WORLD, [("a", apart)])])
            except ReplicaMismatch as error:
                raised.append(str(error))
        return {"violations": [str(v) for v in guard.violations], "raised": raised}
    finally:
        dist.destroy_process_group()
