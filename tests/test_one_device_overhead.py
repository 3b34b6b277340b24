"""``strategy="3d"`` on one device adds nothing over Lightning's ``auto`` when there is nothing
to shard: the same numbers, no collectives and no more host reads per step.

On a GPU every read of a device value (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``) or
copy of a host number to the device waits for the device to finish its queue, so the count of
them per step is what a CPU can check of the GPU's overhead; timings belong to
``python -m tools.bench.one_device``.
"""

import collections

from tools.harness.parity import assert_same_run
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

STEPS = 6
TRAINER = {"gradient_clip_val": 1.0}  # the benchmark's setting: the norm is computed every step
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
COLLECTIVES = (
    "all_reduce",
    "barrier",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
)


def _counted_fit(rank, run):
    """``fit_gpt`` counting, from step 1 on, host reads of tensors called from lightning_3d code
    (Lightning's and torch's own reads count the same in both strategies), tensors made from
    host numbers on a device, and collectives."""
    import traceback

    import torch
    import torch.distributed as dist

    counts = collections.Counter()
    on = {"now": False}

    def ours() -> bool:  # called directly from lightning_3d (a mesh lookup's own reads are torch's)
        caller = traceback.extract_stack()[-3]
        return "lightning_3d" in caller.filename and "/harness/" not in caller.filename

    def counting(owner, name, key):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if on["now"] and (key != "read" or ours()):
                counts[key if key != "read" else name] += 1
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    for name in READS:
        counting(torch.Tensor, name, "read")
    for name in COLLECTIVES:
        counting(dist, name, "collective")
    original_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if on["now"] and kwargs.get("device") is not None and ours():
            counts["tensor(device=)"] += 1
        return original_tensor(*args, **kwargs)

    torch.tensor = tensor

    from lightning_3d.observe.summary import RunSummary

    start = RunSummary.on_train_batch_start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        on["now"] = batch_idx >= 1  # after the first step (set-up, first-step allocations)
        return start(self, trainer, pl_module, batch, batch_idx)

    RunSummary.on_train_batch_start = on_train_batch_start  # this process is the test's own
    result = fit_gpt(rank, run)
    result["counts"] = dict(counts)
    return result


def test_3d_on_one_device_matches_auto_with_no_collectives_and_no_extra_host_reads():
    """32-true, clipping at 1.0: the 3d run's losses and weights equal auto's (the ZeRO-0 engine
    steps aside, autograd's gradients are used as they are); from the second step on, 3d makes
    no collective call and lightning_3d code reads at most one device value per step (the
    non-finite check of loss, gradients and gradient norm, read together before the optimizer
    steps; RunSummary reads the losses once, at the end). Catches: the flat-bucket copy or a
    world-of-one all-reduce back in the step, the
    per-step signal agreement or loss reduction made into a device round trip again, the
    non-finite check reading its flags twice."""
    auto = fit_gpt(0, Run(steps=STEPS, trainer=TRAINER))
    (three_d,) = run_world(_counted_fit, 1, Run(strategy={}, steps=STEPS, trainer=TRAINER))
    assert_same_run(three_d, auto)
    counts = three_d["counts"]
    steps = STEPS - 1
    assert counts.get("collective", 0) == 0, counts
    assert counts.get("tensor(device=)", 0) == 0, counts
    reads = sum(v for k, v in counts.items() if k in READS)
    # One per step: the non-finite flags (fewer: the check is gone; more: overhead is back);
    # plus one at the end: RunSummary reads the steps' losses together.
    assert reads == steps + 1, counts
