"""The strategy's hooks into torch and Lightning are subclasses and a torch-function mode, not patches.

:func:`lightning_3d.strategy.precision.distributed_precision` returns the precision plugin as an instance
of a subclass of its own type: global-norm clipping, and (16-mixed) a grad scaler whose overflow
check covers every rank. :func:`lightning_3d.parallel.loss.vocab_parallel_loss` makes
``F.cross_entropy`` of vocab-sharded logits return a plain tensor through a torch-function mode.
Checked here: the behaviour, on one process and on a 2-rank gloo world (one world for all
2-rank checks: each rank imports Lightning, ~8 s of CPU), and that no attribute of
``torch.nn.functional``, the grad scaler classes or Lightning's plugin classes changed.
"""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_3d.parallel.loss import vocab_parallel_loss
from lightning_3d.strategy.precision import (
    distributed_precision,
    scale_loss,
    shared_overflow_scaler,
)
from tools.harness.world import run_world

CROSS_ENTROPY = F.cross_entropy
PLUGIN_CLASSES = (Precision, MixedPrecision, HalfPrecision, DoublePrecision, FSDPPrecision)
WATCHED = (F, torch.amp.GradScaler, ShardedGradScaler, *PLUGIN_CLASSES)


def _snapshot():
    """Every attribute of the watched modules and classes (warnings' registry aside)."""
    return {
        (repr(owner), name): value
        for owner in WATCHED
        for name, value in vars(owner).items()
        if name != "__warningregistry__"
    }


def _changed(before):
    after = _snapshot()
    return sorted(
        str(k)
        for k in before.keys() | after.keys()
        if before.get(k, None) is not after.get(k, None)
    )


def _fp16(init_scale=2.0**16):
    return MixedPrecision(
        "16-mixed",
        "cpu",
        scaler=torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=7),
    )


def _step_with_grad(plugin, grad):
    """One SGD step of a parameter of ones whose (scaled) gradient is ``grad``, through the scaler."""
    weight = torch.nn.Parameter(torch.ones(len(grad)))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = plugin.scaler
    scaler.scale(weight.sum()).backward()
    weight.grad.copy_(grad)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return weight.detach().clone(), scaler.get_scale()


def _clip_grads(rank, clip_at, norm_scope):
    """Rank ``rank``'s part of a 6-element gradient (both ranks: all of it), clipped by ``clip_at``
    through the adapted plugin the way Lightning calls it; returns the clipped gradients."""
    full = torch.arange(1.0, 7.0)
    params = (
        [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
        if rank is None
        else [torch.nn.Parameter(torch.zeros(3))]
    )
    parts = [full[:3], full[3:]] if rank is None else [full[3 * rank : 3 * rank + 3]]
    for p, g in zip(params, parts):
        p.grad = g.clone()
    plugin = distributed_precision(Precision(), norm_scope)
    plugin.clip_gradients(torch.optim.SGD(params, lr=1.0), clip_at)
    return torch.cat([p.grad for p in params])


# ---------------------------------------------------------------------------------- one process
@pytest.mark.parametrize(
    "make",
    [
        Precision,
        _fp16,
        lambda: MixedPrecision("bf16-mixed", "cpu"),
        lambda: HalfPrecision("bf16-true"),
        DoublePrecision,
        lambda: FSDPPrecision("bf16-mixed"),
    ],
    ids=["32", "16-mixed", "bf16-mixed", "bf16-true", "64", "fsdp"],
)
def test_adapted_plugin_subclasses_the_original_and_carries_its_state(make):
    before = _snapshot()
    plugin = make()
    adapted = distributed_precision(plugin)
    assert isinstance(adapted, type(plugin)) and type(adapted) is not type(plugin)
    assert type(distributed_precision(make())) is type(adapted)  # one class per plugin type
    assert distributed_precision(adapted) is adapted  # idempotent
    assert "clip_grad_by_norm" not in vars(adapted)  # the class overrides it, not the instance
    carried = {
        k: v
        for k, v in vars(adapted).items()
        if k not in ("scaler", "_norm_scope", "_nonfinite", "_before_step")
    }
    assert carried == {k: v for k, v in vars(plugin).items() if k != "scaler"}
    assert adapted.precision == plugin.precision
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        assert isinstance(adapted.scaler, type(scaler)) and adapted.scaler is not scaler
        assert "unscale_" not in vars(adapted.scaler)
        assert adapted.scaler.state_dict() == scaler.state_dict()  # scale, growth tracker, factors
        assert shared_overflow_scaler(adapted.scaler) is adapted.scaler
    else:
        assert getattr(adapted, "scaler", None) is None
    assert _changed(before) == []


def test_adapted_plugin_survives_pickling_and_copying():
    adapted = distributed_precision(_fp16(init_scale=8.0))
    for twin in (pickle.loads(pickle.dumps(adapted)), copy.deepcopy(adapted)):
        assert type(twin) is type(adapted) and type(twin.scaler) is type(adapted.scaler)
        assert twin.scaler.state_dict() == adapted.scaler.state_dict()


def test_one_process_clipping_is_torchs_and_asks_the_scope_at_clip_time():
    calls = []

    def scope():
        calls.append(1)
        return None, set()

    reference = torch.nn.Parameter(torch.zeros(6))
    reference.grad = torch.arange(1.0, 7.0)
    torch.nn.utils.clip_grad_norm_([reference], 2.0)
    torch.testing.assert_close(_clip_grads(None, 2.0, scope), reference.grad)
    assert calls == [1]


def test_one_process_scaler_skips_an_overflowing_step_like_torchs():
    adapted = distributed_precision(_fp16())
    assert scale_loss(adapted, torch.tensor(3.0)).item() == 3.0 * 2.0**16
    assert scale_loss(Precision(), torch.tensor(3.0)).item() == 3.0
    weight, scale = _step_with_grad(adapted, torch.tensor([1.0, float("inf"), 1.0]))
    assert torch.equal(weight, torch.ones(3)) and scale == 2.0**15
    weight, scale = _step_with_grad(adapted, torch.full((3,), 2.0**15))
    assert torch.allclose(weight, torch.full((3,), 0.9)) and scale == 2.0**15


def test_vocab_parallel_loss_leaves_plain_cross_entropy_and_the_function_alone():
    logits = torch.randn(4, 5, requires_grad=True)
    target = torch.tensor([0, 4, 2, 1])
    want = F.cross_entropy(logits, target)
    with vocab_parallel_loss():
        assert F.cross_entropy is CROSS_ENTROPY
        got = F.cross_entropy(logits, target)
        via_module = torch.nn.CrossEntropyLoss()(logits, target)
        got.backward()
    assert F.cross_entropy is CROSS_ENTROPY
    assert type(got) is torch.Tensor and torch.equal(got, want) and torch.equal(via_module, want)
    assert logits.grad is not None
    with pytest.raises(ValueError), vocab_parallel_loss():
        raise ValueError("the mode must be popped on the way out")
    assert not torch._C._is_torch_function_mode_enabled()


# ---------------------------------------------------------------------------------- two ranks
def _two_ranks(rank):
    """Every 2-rank check on one world; returns what the parent asserts on."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    before = _snapshot()
    dist.init_process_group("gloo")
    out = {}
    # 16-mixed: an overflow in rank 0's gradient only skips the step (and backs off) on both.
    overflow = torch.tensor([1.0, float("inf") if rank == 0 else 1.0, 1.0])
    out["overflow"] = _step_with_grad(distributed_precision(_fp16()), overflow)
    out["no_overflow"] = _step_with_grad(distributed_precision(_fp16()), torch.full((3,), 2.0**16))
    # Clipping: each rank holds half the parameters (as pipeline stages do), summed over both.
    out["clipped"] = _clip_grads(rank, 2.0, lambda: (dist.group.WORLD, set()))
    # Vocab-parallel loss: a column-parallel LM head on a 2-rank tp mesh vs the plain head.
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 10)
    sharded = copy.deepcopy(plain)
    parallelize_module(sharded, mesh, ColwiseParallel(use_local_output=False))
    x, target = torch.randn(6, 8), torch.randint(0, 10, (6,))
    want = F.cross_entropy(plain(x), target)
    want.backward()
    with vocab_parallel_loss():
        inside = F.cross_entropy is CROSS_ENTROPY
        logits = sharded(x)
        loss = F.cross_entropy(logits, target)
        module_loss = torch.nn.CrossEntropyLoss()(logits, target)
        loss.backward()
    out["loss"] = {
        "plain_tensor": type(loss) is torch.Tensor and type(module_loss) is torch.Tensor,
        "logits_sharded": type(logits).__name__ == "DTensor",
        "is_original": inside and F.cross_entropy is CROSS_ENTROPY,
        "loss": loss.detach(),
        "want": want.detach(),
        "module_loss": module_loss.detach(),
        "grads": [p.grad.full_tensor() for p in sharded.parameters()],
        "want_grads": [p.grad for p in plain.parameters()],
    }
    out["changed"] = _changed(before)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_world(_two_ranks, 2)


def test_an_overflow_on_one_rank_skips_the_step_on_both(two_ranks):
    for rank in two_ranks:
        weight, scale = rank["overflow"]
        assert torch.equal(weight, torch.ones(3)) and scale == 2.0**15  # skipped, backed off
        weight, scale = rank["no_overflow"]
        assert torch.allclose(weight, torch.full((3,), 0.9)) and scale == 2.0**16  # stepped


def test_clipping_over_two_ranks_is_the_one_process_norm(two_ranks):
    whole = _clip_grads(None, 2.0, lambda: (None, set()))
    torch.testing.assert_close(torch.cat([r["clipped"] for r in two_ranks]), whole)
    assert abs(whole.norm().item() - 2.0) < 1e-4


def test_vocab_parallel_loss_is_plain_cross_entropy_on_a_tp_mesh(two_ranks):
    for rank in two_ranks:
        got = rank["loss"]
        assert got["plain_tensor"] and got["logits_sharded"] and got["is_original"]
        torch.testing.assert_close(got["loss"], got["want"])
        torch.testing.assert_close(got["module_loss"], got["want"])
        for g, w in zip(got["grads"], got["want_grads"]):
            torch.testing.assert_close(g, w)
    # Identical per tp rank.
    assert torch.equal(two_ranks[0]["loss"]["loss"], two_ranks[1]["loss"]["loss"])


def test_nothing_in_torch_or_lightning_was_reassigned(two_ranks):
    assert [r["changed"] for r in two_ranks] == [[], []]
