"""A model built on ``meta`` and materialised in its final place (``LitGPT(deferred_init=True)``,
``parallel/materialize.py``) starts from the eager build's weights, bit for bit, and trains the
same steps; and it never holds a full fp32 copy of the model on the way."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.parallel.materialize import AHEAD, DeferredInit, ParamInit, materialize
from lightning_3d.parallel.tensor import local_tensor
from tools.harness.parity import assert_same_run
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

CONFIG = GPTConfig(vocab_size=300, block_size=37, n_layer=3, n_head=4, n_embd=64, bias=True)


def _eager(seed: int, dtype: torch.dtype) -> GPT:
    torch.manual_seed(seed)
    return GPT(CONFIG).to(dtype)


def _deferred(seed: int, dtype: torch.dtype) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CONFIG, defer_init=True)
    torch.rand(5)  # the RNG moves on after the build: the recorded state is what counts
    assert materialize(model.to(dtype), torch.device("cpu")) == len(list(model.parameters()))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_initial_weights_bit_for_bit(dtype):
    eager, deferred = _eager(7, dtype), _deferred(7, dtype)
    assert deferred.deferred_init is None  # filled once: a second materialize has nothing to do
    for (name, a), (other, b) in zip(
        eager.named_parameters(), deferred.named_parameters(), strict=True
    ):
        assert name == other and b.dtype == dtype and not b.is_meta
        assert torch.equal(a, b), name
    # The seed matters.
    assert not torch.equal(_deferred(8, dtype).lm_head.weight, deferred.lm_head.weight)


def test_unplanned_meta_tensors_are_refused_before_any_work():
    model = GPT(CONFIG, defer_init=True)
    model.deferred_init = DeferredInit(model.deferred_init.rng_state, model.deferred_init.inits[1:])
    with pytest.raises(ValueError, match=r"tok_emb\.weight"):
        materialize(model, torch.device("cpu"))
    assert model.tok_emb.weight.is_meta and model.lm_head.weight.is_meta
    holder = torch.nn.Linear(3, 3, bias=False, device="meta")
    holder.deferred_init = DeferredInit(
        torch.random.get_rng_state(), (ParamInit("weight", (2, 3), lambda t, g: t.zero_()),)
    )
    with pytest.raises(
        ValueError, match=r"weight: recorded shape \(2, 3\), the model now has \(3, 3\)"
    ):
        materialize(holder, torch.device("cpu"))
    assert holder.weight.is_meta


def test_load_from_checkpoint_of_a_deferred_model(tmp_path):
    """A checkpoint's hyperparameters say deferred_init=True: the weights it holds still load."""
    from lightning_3d.models import LitGPT

    hparams = dict(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    saved = LitGPT(**hparams, deferred_init=True)
    materialize(saved, torch.device("cpu"))
    with torch.no_grad():
        saved.model.lm_head.weight.add_(1.0)  # not what any init gives
    path = tmp_path / "deferred.ckpt"
    torch.save(
        {
            "state_dict": saved.state_dict(),
            "hyper_parameters": dict(saved.hparams),
            "pytorch-lightning_version": "2.6.6",
        },
        path,
    )
    loaded = LitGPT.load_from_checkpoint(path)
    assert torch.equal(loaded.model.lm_head.weight, saved.model.lm_head.weight)


class LiveBytes(TorchDispatchMode):
    """The most bytes of ``dtype`` tensors on the CPU alive at once while the mode is on: every
    storage an operation returns is tracked until it is freed (weak references to storages)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype, self.live, self.peak = dtype, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            t = local_tensor(t) if isinstance(t, torch.Tensor) else None
            if t is not None and t.dtype == self.dtype and t.device.type == "cpu" and not t.is_meta:
                storage = t.untyped_storage()
                self.live.setdefault(
                    storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes())
                )
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def test_no_full_fp32_copy_of_the_model():
    full = sum(p.numel() for p in GPT(CONFIG, defer_init=True).parameters()) * 4
    largest = max(p.numel() for p in GPT(CONFIG, defer_init=True).parameters()) * 4
    with LiveBytes(torch.float32) as old:
        _eager(0, torch.bfloat16)
    with LiveBytes(torch.float32) as new:
        _deferred(0, torch.bfloat16)
    assert old.peak >= full  # the eager build holds the whole model in fp32 (the check can fail)
    # Deferred: the buffers of the parameter being copied and of those filled ahead of it.
    assert new.peak <= (AHEAD + 1) * largest < full / 2, (new.peak, largest, full)


# The Trainer: the same losses and final weights as the eager build, bit for bit (the same
# initial weights, so the same everything after them), offloaded and ZeRO-3 sharded.
DEFERRED = {"deferred_init": True}
OFFLOAD_CPU = Run(strategy={"offload": "cpu"}, steps=2, trainer={"precision": "bf16-true"})
ZERO3_PARAMS = Run(strategy={"zero_stage": 3, "offload": "cpu", "offload_params": True}, steps=2)


def _eager_and_deferred(rank: int, runs: list) -> list:
    """Each run eager, then deferred, in this one process (a world of one); where the recipe
    materialised the deferred model."""
    import lightning_3d.parallel.materialize as recipe_step

    places = []
    original = recipe_step.materialize
    recipe_step.materialize = lambda module, device: (
        places.append(str(device)) or original(module, device)
    )
    try:
        return [
            (fit_gpt(0, run), fit_gpt(0, dataclasses.replace(run, model=DEFERRED)), places[i:])
            for i, run in enumerate(runs)
        ]
    finally:
        recipe_step.materialize = original


def test_trainer_same_run_as_eager_build():
    """``offload="cpu"`` at bf16-true, and ZeRO-3 + ``offload_params``: bit for bit the eager run."""
    for eager, deferred, places in run_world(_eager_and_deferred, 1, [OFFLOAD_CPU, ZERO3_PARAMS])[
        0
    ]:
        # The recipe did it, after sharding (offload_params: FSDP2's CPU shards).
        assert places[:1] == ["cpu"]
        assert len(eager["losses"]) == 2
        assert_same_run(deferred, eager, rtol=0.0, atol=0.0)


def test_other_strategies_get_the_eager_build():
    """Lightning's own single-device strategy does not materialise meta modules: LitGPT's
    configure_model does, as the eager build (fp32, CPU), and the run is the eager one."""
    run = Run(steps=2)
    eager = fit_gpt(0, run)
    assert len(eager["losses"]) == 2
    assert_same_run(fit_gpt(0, dataclasses.replace(run, model=DEFERRED)), eager, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("rank", [0, 3])
@pytest.mark.parametrize(
    "options",
    [{"zero_stage": 3, "offload": "cpu", "offload_params": True}, {"zero_stage": 3, "tensor": 2}],
    ids=["zero3_dp4_offload", "zero3_dp2_tp2"],
)
def test_each_rank_holds_its_shard_of_the_eager_weights(options, rank):
    """The recipe on one rank of a fake world of 4: every parameter's local shard (FSDP2's
    dim-0 shards, tensor-parallel splits inside them) is that rank's part of the eager build's
    weights, bit for bit, and no full fp32 copy of the model existed on the way."""
    from torch.distributed.tensor import distribute_tensor

    from lightning_3d.layout import build_mesh
    from lightning_3d.models import LitGPT
    from lightning_3d.options import Plan
    from lightning_3d.parallel.fake_world import fake_world
    from lightning_3d.strategy.recipe import parallelize

    hparams = dict(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64)
    torch.manual_seed(5)
    eager = LitGPT(**hparams).to(torch.bfloat16)
    torch.manual_seed(5)
    module = LitGPT(**hparams, deferred_init=True).to(torch.bfloat16)
    plan = Plan().updated(**options).resolved(4)
    with fake_world(rank, 4), LiveBytes(torch.float32) as fp32:
        parallelize(
            module,
            build_mesh(plan.layout, "cpu"),
            plan,
            device=torch.device("cpu"),
            precision="bf16-true",
        )
        for name, param in module.named_parameters():
            expected = distribute_tensor(
                eager.get_parameter(name).detach(),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            ).to_local()
            assert torch.equal(local_tensor(param), expected), name
    largest = max(p.numel() for p in eager.parameters()) * 4
    # The buffers of the parameters in flight, and DTensor's split of a strided shard.
    assert fp32.peak <= (AHEAD + 3) * largest < sum(p.numel() for p in eager.parameters()) * 2


@pytest.mark.slow
def test_zero3_shards_at_two_ranks_match_one_process():
    """Each rank fills only its own shard of every parameter; the two-rank run trains as the
    single-process eager run does (within the parity bounds: ranks add gradients in another order)."""
    reference = fit_gpt(0, dataclasses.replace(ZERO3_PARAMS, strategy=None))
    sharded = run_world(fit_gpt, 2, dataclasses.replace(ZERO3_PARAMS, devices=2, model=DEFERRED))[0]
    assert_same_run(sharded, reference)


@pytest.mark.slow
def test_pipeline_stages_skip_the_other_stages_draws():
    """Under a pipeline each rank fills only its stage's parameters but replays every draw, so
    the two-stage run (with ZeRO-3 inside each stage) trains as the single-process eager run does."""
    run = Run(strategy={"pipeline": 2, "zero_stage": 3, "micro_batches": 2}, steps=2)
    reference = fit_gpt(0, dataclasses.replace(run, strategy=None))
    staged = run_world(fit_gpt, 2, dataclasses.replace(run, devices=2, model=DEFERRED))[0]
    assert_same_run(staged, reference)


def test_a_fused_projection_under_tensor_parallelism_gets_its_regrouped_rows():
    """A fused [q; k; v] projection split over 2 tensor ranks: rank 1 holds [q_1; k_1; v_1], as the
    eager build's FusedColwiseParallel lays it out (one rank of a fake world, no communication)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_3d.parallel.fake_world import fake_world
    from lightning_3d.parallel.tensor import FusedColwiseParallel

    def fill(t, g):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view_as(t))

    with fake_world(1, 2):
        holder = torch.nn.Linear(4, 12, bias=False, device="meta")  # 3 chunks (q, k, v) of 4 rows
        holder.deferred_init = DeferredInit(
            torch.random.get_rng_state(), (ParamInit("weight", (12, 4), fill),)
        )
        parallelize_module(holder, init_device_mesh("cpu", (2,)), FusedColwiseParallel(3))
        assert materialize(holder, torch.device("cpu")) == 1
        local = holder.weight.to_local()
    full = torch.arange(48, dtype=torch.float32).view(12, 4)
    # The second half of each chunk.
    expected = torch.cat([full[c * 4 + 2 : c * 4 + 4] for c in range(3)])
    assert torch.equal(local, expected)
