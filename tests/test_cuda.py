"""One CUDA device: every strategy option at ``devices=1`` against Lightning's ``auto``, and NCCL.

Run with ``pytest -m cuda`` on a machine with one GPU (sized for under 5 minutes on an H200, not
yet measured there; ``bash .ci/gpu tests`` runs it with 4 pytest processes where pytest-xdist is
installed); without a device every test here is skipped, except the CPU check of the bound. Each
run is the reference ``LitGPT`` of
:func:`tools.harness.runs.fit_gpt` (tiny, 5 AdamW steps, ``gradient_clip_val=1.0``) in a
child process of its own (``run_world(..., 1)``), as the CPU tests run theirs: no CUDA context
and no process group in the pytest process.

"The same run" at bf16 tolerance: on a GPU the two runs may round differently (FSDP2's
parameter cast instead of autocast, flat-buffer sums, kernels chosen per shape), so weights are
compared by their *update* over the run, ``||Δ_3d - Δ_auto|| / ||Δ_auto||`` over all tensors
together, and losses per step. Measured on CPU (gloo, this model, 5 steps): bf16-mixed ZeRO-0
against ``auto`` 4e-4, ZeRO-3 1.7e-2 (the size of bf16-mixed against fp32), bf16-true ZeRO-3
6e-3; a 5% higher learning rate 5.5e-2. The bound, 4e-2, is above the rounding and below a
real fault: clipping not applied, a skipped or doubled step, stale weights or a learning rate
10% off each move the update by 10% or more (the CPU check
``test_update_bound_detects_a_ten_percent_learning_rate_change`` runs on every machine).

The NCCL test runs the collectives the ZeRO engine calls (all-gather and reduce-scatter into
tensors, torch's and ``lightning_3d.compat``'s, all-reduce, broadcast) once each on a one-rank
NCCL group, then the engine itself (stages 0-2) against a plain optimizer step.
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch

from tools.harness.parity import loss_mismatches
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device (pytest -m cuda on a GPU machine)"
)

STEPS, SEED = 5, 1234
# NCCL crashed here once with CPU-resident shards (parallel/clip.py).
CLIP = {"gradient_clip_val": 1.0}
# (loss rtol per step, update rtol over all tensors) per precision; see the module docstring.
TOLERANCE = {"bf16-mixed": (2e-2, 4e-2), "bf16-true": (3e-2, 4e-2), "32-true": (1e-4, 1e-3)}

# id: (ThreeDStrategy options, precision). Checkpointing "none" and ZeRO 0 are the zero0 case.
CASES = {
    "zero0": ({"zero_stage": 0}, "bf16-mixed"),
    "zero1": ({"zero_stage": 1}, "bf16-mixed"),
    "zero2": ({"zero_stage": 2}, "bf16-mixed"),
    "zero3": ({"zero_stage": 3}, "bf16-mixed"),
    "ac_full": ({"ac_policy": "full"}, "bf16-mixed"),
    "ac_selective": ({"ac_policy": "selective"}, "bf16-mixed"),
    "offload_cpu": ({"offload": "cpu"}, "bf16-mixed"),
    "offload_nvme": ({"offload": "nvme", "offload_chunk_mb": 0.01}, "bf16-mixed"),  # path: tmp_path
    "zero3_offload_params": (
        {"zero_stage": 3, "offload": "cpu", "offload_params": True},
        "bf16-mixed",
    ),
    "bf16_true": ({"zero_stage": 0}, "bf16-true"),
    "bf16_true_zero3": ({"zero_stage": 3}, "bf16-true"),
    "fp32": ({"zero_stage": 0}, "32-true"),
    "fp32_zero2": ({"zero_stage": 2}, "32-true"),
    "compile": ({"compile": True}, "bf16-mixed"),
}


def gpu_run(strategy: dict | None, precision: str) -> Run:
    return Run(
        strategy=strategy,
        accelerator="gpu",
        steps=STEPS,
        seed=SEED,
        trainer={"precision": precision, **CLIP},
    )


def fit_child(run: Run) -> dict:
    """``fit_gpt`` on a world of one, in a child process (CUDA and NCCL stay out of pytest)."""
    return run_world(fit_gpt, 1, run)[0]


def update_error(run: dict, reference: dict) -> float:
    """Relative error of the whole model's update: ``||Δ_run - Δ_ref|| / ||Δ_ref||`` over all
    tensors together, each update measured from the reference's initial weights (both runs start
    from the same seeded weights; checked by the caller)."""
    start = reference["initial_state"]
    num = den = 0.0
    for name, w0 in start.items():
        if name not in reference["state"]:
            continue  # a buffer the module does not save
        want = reference["state"][name].float() - w0.float()
        got = run["state"][name].float() - w0.float()
        num += (got - want).norm().item() ** 2
        den += want.norm().item() ** 2
    return math.sqrt(num / den) if den > 0 else math.inf


def assert_matches_auto(run: dict, reference: dict, precision: str) -> None:
    loss_rtol, update_rtol = TOLERANCE[precision]
    assert len(run["losses"]) == STEPS and all(math.isfinite(x) for x in run["losses"]), run[
        "losses"
    ]
    assert set(run["state"]) == set(reference["state"])
    assert loss_mismatches(run["losses"], reference["losses"], loss_rtol) == []
    error = update_error(run, reference)
    assert error <= update_rtol, (
        f"update differs from Lightning auto's by {error:.2e} (max {update_rtol:.0e})"
    )


@pytest.fixture(scope="module")
def auto():
    """Lightning's ``strategy="auto"`` on the device, one run per precision, cached."""
    cache: dict[str, dict] = {}

    def get(precision: str) -> dict:
        if precision not in cache:
            cache[precision] = fit_child(gpu_run(None, precision))
        return cache[precision]

    return get


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_strategy_option_matches_auto_on_one_device(case, auto, tmp_path):
    """Catches an option that breaks on CUDA (device placement, NCCL on CPU tensors, a dtype
    the kernels refuse) or changes the numbers beyond bf16 rounding on one device."""
    options, precision = CASES[case]
    if options.get("offload") == "nvme":
        options = {**options, "offload_path": str(tmp_path)}
    reference = auto(precision)
    run = fit_child(gpu_run(options, precision))
    for name, w0 in reference["initial_state"].items():  # the same seeded start
        assert torch.equal(run["initial_state"][name], w0), name
    assert_matches_auto(run, reference, precision)
    rank = run["summary"]["ranks"][0]
    # Both trained on the device, not the CPU.
    for trained in (rank, reference["summary"]["ranks"][0]):
        assert trained.get("device_peak_mb", 0) > 0, trained
    if options.get("offload_params"):  # every sharded parameter lived in CPU memory
        assert rank["offloaded_param_bytes"] == rank["param_bytes"] > 0
    if options.get("offload") == "nvme":
        assert list(tmp_path.iterdir()) == []  # the private state directory is gone


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "options",
    [{"offload": "cpu"}, {"zero_stage": 3, "offload": "cpu", "offload_params": True}],
    ids=["offload_cpu", "zero3_offload_params"],
)
def test_a_model_built_on_meta_trains_as_the_eager_build(options):
    """``LitGPT(deferred_init=True)`` materialised on the device (or in CPU shards) by the strategy:
    the same initial weights bit for bit, and the same run (at bf16 tolerance) as the eager build."""
    eager = fit_child(gpu_run(options, "bf16-true"))
    deferred = fit_child(
        Run(
            strategy=options,
            accelerator="gpu",
            steps=STEPS,
            seed=SEED,
            model={"deferred_init": True},
            trainer={"precision": "bf16-true", **CLIP},
        )
    )
    for name, w0 in eager["initial_state"].items():
        assert torch.equal(deferred["initial_state"][name], w0), name
    # CUDA's embedding backward is not bit-reproducible.
    assert_matches_auto(deferred, eager, "bf16-true")


def test_update_bound_detects_a_ten_percent_learning_rate_change():
    """The bf16 bound above can fail: on CPU (fp32, in this process, Lightning's plain strategy)
    a run at 1.1x the learning rate is outside it, and outside the loss bound of fp32 too."""
    reference = fit_gpt(0, Run(steps=STEPS, seed=SEED, trainer=CLIP))
    faster = fit_gpt(0, Run(steps=STEPS, seed=SEED, trainer=CLIP, model={"lr": 3e-3 * 1.1}))
    assert update_error(reference, reference) == 0.0
    assert update_error(faster, reference) > 2 * TOLERANCE["bf16-mixed"][1]
    assert loss_mismatches(faster["losses"], reference["losses"], TOLERANCE["32-true"][0]) != []


# --- NCCL on one rank ---------------------------------------------------------------------------


def _world_of_one(rank: int, device_type: str = "cuda") -> dict:
    """Each collective the engine uses, once, on a one-rank NCCL group; then ZeRO stages 0-2.
    ``device_type="cpu"``: the same on gloo, so that this check itself runs on every machine.

    Returns ``{name: None}`` for what worked and ``{name: traceback}`` for what did not, so one
    broken call does not hide the others.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    # One backend, named: no "cpu:gloo,cuda:nccl" mix.
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh(device_type, (1,), mesh_dim_names=("dp",))
    group = mesh.get_group()
    out: dict = {"backend": dist.get_backend(group)}
    x = torch.arange(1.0, 7.0, device=device_type)  # (6,)

    def check(name, fn):
        try:
            got = fn()
            if cuda:
                torch.cuda.synchronize()
            # A world of one: every collective gives back its input (sum / mean over one rank).
            torch.testing.assert_close(got.cpu(), x.cpu())
            out[name] = None
        except Exception:  # noqa: BLE001 - reported per collective to the test
            out[name] = traceback.format_exc()

    def into(op, *, async_op=False):
        def run():
            target = torch.empty_like(x)
            work = op(target, x.clone(), group=group, async_op=async_op)
            if async_op:
                work.wait()
            return target

        return run

    def in_place(op, **kw):
        def run():
            y = x.clone()
            op(y, group=group, **kw)
            return y

        return run

    check("all_reduce", in_place(dist.all_reduce))
    check("broadcast", in_place(dist.broadcast, src=0))
    check("all_gather_into_tensor", into(dist.all_gather_into_tensor, async_op=True))
    check("reduce_scatter_tensor", into(dist.reduce_scatter_tensor, async_op=True))
    # The engine's calls: torch's own where it has them, else a fallback.
    from lightning_3d import compat

    for name in ("all_gather_single", "reduce_scatter_single"):
        check(name, into(getattr(compat, name), async_op=True))
    for stage in (0, 1, 2):
        try:
            out[f"zero{stage}"] = _engine_step(mesh, stage)
        except Exception:  # noqa: BLE001
            out[f"zero{stage}"] = traceback.format_exc()
    return out


def _engine_step(mesh, stage: int):
    """Two SGD steps through ``ZeroDataParallel`` (buckets of 20 elements: several, padded)
    against plain SGD on a copy; ``None`` when they agree."""
    import copy

    from lightning_3d.parallel.zero import ZeroDataParallel

    device = torch.device(mesh.device_type)  # "cuda" here; "cpu" (gloo) to try the check itself
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(
        device
    )
    plain = copy.deepcopy(model)
    engine = ZeroDataParallel(mesh, stage=stage, bucket_numel=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine.attach(optimizer)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for _step in range(2):
        batch = torch.randn(4, 7, device=device)
        engine.prepare_backward(sync=True)
        model(batch).square().sum().backward()
        engine.finish_backward()
        optimizer.step()
        engine.after_step()
        reference.zero_grad()
        plain(batch).square().sum().backward()
        reference.step()
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6, msg=name)
    return None


@pytest.fixture(scope="module")
def nccl_results():
    return run_world(_world_of_one, 1)[0]


def test_collective_checks_run_on_gloo():
    """The NCCL checks below, run on gloo (CPU) here: each collective and each ZeRO stage passes,
    so a failure on a GPU is the device's path, not the check."""
    results = run_world(_world_of_one, 1, "cpu")[0]
    assert results.pop("backend") == "gloo"
    assert results == {
        name: None
        for name in (
            "all_reduce",
            "broadcast",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_gather_single",
            "reduce_scatter_single",
            "zero0",
            "zero1",
            "zero2",
        )
    }


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "name",
    [
        "all_reduce",
        "broadcast",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_gather_single",
        "reduce_scatter_single",
    ],
)
def test_nccl_collective_on_one_rank(nccl_results, name):
    assert nccl_results["backend"] == "nccl"
    assert nccl_results[name] is None, nccl_results[name]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_engine_on_nccl_matches_a_plain_step(nccl_results, stage):
    """The flat-bucket engine's NCCL path (reduce-scatter / all-gather into slices through
    ``lightning_3d.compat``, all-reduce, the initial broadcast) gives plain SGD's weights on one
    rank, on the device's torch (2.11 has no ``dist.all_gather_single``)."""
    assert nccl_results[f"zero{stage}"] is None, nccl_results[f"zero{stage}"]


def _offload_overlap(rank: int, device: str, delay: bool = False) -> dict:
    """bf16 parameters and an fp32 one on ``device`` stepped by ``OffloadedAdam`` with and without
    overlap (tiny staging buffers, so the buffers turn many times, one lane per dtype), and fp32
    ``torch.optim.AdamW(fused=True)`` on the CPU from the same start; after each step the compute
    stream sums the weights, as the next forward would read them. Each step's gradients are
    written on the compute stream behind a long sleep kernel, as backward leaves them: a
    prefetch (or, with ``delay``, a snapshot) that does not wait for the compute stream copies the
    previous gradients. Right after ``step()`` the gradients are overwritten in place, as a ZeRO
    engine zeroes its buckets, and once freed their memory is refilled: a copy not ordered before
    those reads NaN. Each step's weights (``seen``) are returned too; with ``delay`` the final
    ones after ``synchronize()``."""
    from lightning_3d.offload import OffloadedAdam

    sizes, steps = (1000, 3000, 517, 1500), 3
    dtypes = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)
    start = [
        torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dt)
        for n, dt in zip(sizes, dtypes)
    ]
    grads = [
        [
            torch.randn(n, generator=torch.Generator().manual_seed(100 * s + n)).to(dt)
            for n, dt in zip(sizes, dtypes)
        ]
        for s in range(steps)
    ]
    out: dict = {}
    OffloadedAdam.stage_bytes = 1024  # this child process only
    cuda = device == "cuda"
    # On a CPU: the same path, with synchronous copies; on a GPU, as in production.
    OffloadedAdam.prefetch_devices = ("cuda",) if cuda else ("cuda", "cpu")
    for overlap in (True, False):
        params = [torch.nn.Parameter(t.to(device, copy=True)) for t in start]
        # On the device before the loop.
        staged = [[g.to(device, copy=True) for g in step] for step in grads]
        opt = OffloadedAdam(
            params, lr=1e-2, chunk_bytes=12 * 256, overlap=overlap, delay_update=delay
        )
        sums, seen = [], []
        for s in range(steps):
            if cuda:
                torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the gradient writes
            for p, g in zip(params, staged[s]):
                p.grad = g.clone()  # a kernel on the compute stream, queued behind the sleep
            opt.step()
            for p in params:
                # In place, on the compute stream, before the host waits for anything.
                p.grad.fill_(float("nan"))
            opt.zero_grad(set_to_none=True)
            # The freed gradients' memory.
            refill = [torch.full_like(g, float("nan")) for g in staged[s]]
            # Compute stream, right after the step.
            sums.append(sum(p.float().sum() for p in params).item())
            seen.append([p.detach().to("cpu", copy=True) for p in params])
            del refill
        opt.synchronize()
        out[overlap] = ([p.detach().cpu() for p in params], sums, seen)
        opt.close()
    masters = [torch.nn.Parameter(t.float().clone()) for t in start]
    reference = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    out["history"] = [start]
    for s in range(steps):
        for p, g in zip(masters, grads[s]):
            p.grad = g.float().clone()
        reference.step()
        out["history"].append([m.detach().to(t.dtype, copy=True) for m, t in zip(masters, start)])
    out["reference"] = out["history"][-1]
    return out


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("delay", [False, True], ids=["overlap", "delayed"])
def test_offload_overlap_check_runs_on_cpu(delay):
    """The check below on CPU parameters (no side streams there, but the same prefetching and
    snapshot paths, bf16 and fp32 lanes): both paths equal the reference; delayed, every step's
    weights are the update before last."""
    out = run_world(_offload_overlap, 1, "cpu", delay)[0]
    for overlap in (True, False):
        assert _same(out[overlap][0], out["reference"])
        if delay:
            assert all(_same(seen, out["history"][s]) for s, seen in enumerate(out[overlap][2]))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("delay", [False, True], ids=["overlap", "delayed"])
def test_offload_overlap_matches_blocking_bit_for_bit(delay):
    """Gradients down and weights up on side streams (delayed: the gradients snapshot into pinned
    buffers without the host waiting): the same weights as the blocking path and as fp32 AdamW on
    the CPU cast to bf16, and every forward after a step reads the weights it should."""
    out = run_world(_offload_overlap, 1, "cuda", delay)[0]
    (overlapped, sums_o, seen_o), (blocking, sums_b, seen_b) = out[True], out[False]
    assert _same(overlapped, blocking) and _same(overlapped, out["reference"])
    assert sums_o == sums_b
    assert all(_same(a, b) for a, b in zip(seen_o, seen_b))
    if delay:
        assert all(_same(seen, out["history"][s]) for s, seen in enumerate(seen_o))
