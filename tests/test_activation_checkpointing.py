"""Activation checkpointing: same losses and gradients, same names, fewer saved bytes.

Single-process unit tests, plus one 2-process gloo world where checkpointing composes with
FSDP2 ``fully_shard`` (data axis) and with DTensor tensor parallelism (sequence parallel).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.parallel import activation_checkpoint as checkpointing
from lightning_3d.parallel.activation_checkpoint import (
    POLICIES,
    ac_options,
    activation_bytes_per_block,
    apply_activation_checkpointing,
    is_checkpointed,
    transformer_blocks,
)
from lightning_3d.parallel.activations import ActivationMeter
from tools.harness.tiny_models import TinyGPT2, TinyLlama
from tools.harness.world import run_world

B, T = 2, 16


def _gpt(n_layer: int = 4, dropout: float = 0.1) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_embd=32, n_head=4, n_layer=n_layer, block_size=T, dropout=dropout))


MODELS = {
    "gpt": _gpt,
    "llama": lambda: TinyLlama(d=32, n_layer=3),
    "gpt2": lambda: TinyGPT2(block_size=T, n_layer=3),
}


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=gen), torch.randint(
        0, 256, (B, T), generator=gen
    )


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Loss and this rank's gradients (shards, for DTensor parameters) of one step."""
    torch.manual_seed(7)  # the same dropout masks for every run
    logits = model(x)
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits  # vocab-parallel head
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    grads = {
        n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        for n, p in model.named_parameters()
    }
    return loss.detach(), {n: g.clone() for n, g in grads.items()}


def _assert_same(a: tuple[torch.Tensor, dict], b: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # loss, then every gradient by name


# ================================================================== options
@pytest.mark.parametrize(
    "policy, every_n, match",
    [
        ("sometimes", 2, r"'sometimes'.*\['none', 'full', 'every_n', 'selective'\]"),
        ("Full", 2, "'Full'"),
        ("every_n", 0, "every_n=0"),
        ("every_n", -3, "every_n=-3"),
        ("every_n", 1.5, "every_n=1.5"),
        ("every_n", True, "every_n=True"),
        ("full", "2", "every_n='2'"),
    ],
)
def test_bad_options_raise_value_error_naming_them(policy, every_n, match):
    assert ac_options("every_n", 3) == {"policy": "every_n", "every_n": 3, "offload": False}
    with pytest.raises(ValueError, match=match):
        ac_options(policy, every_n)
    with pytest.raises(ValueError, match=match):
        apply_activation_checkpointing(_gpt(1), policy, every_n)
    with pytest.raises(ValueError, match=match):
        activation_bytes_per_block(_gpt(1), _batch()[0], policy, every_n)


# ================================================================== parity
@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("policy", POLICIES)
def test_same_loss_and_grads_as_without(arch, policy):
    torch.manual_seed(0)
    model, (x, y) = MODELS[arch](), _batch()
    reference = _step(copy.deepcopy(model), x, y)
    names = apply_activation_checkpointing(model, policy)
    assert bool(names) == (policy != "none")
    _assert_same(_step(model, x, y), reference)


def test_dropout_draws_and_eval_without_grad_gives_the_same_output():
    model, (x, _) = _gpt(dropout=0.1), _batch()
    with torch.no_grad():
        assert not torch.equal(model(x), model(x))  # else the dropout parity above were vacuous
        model.eval()
        expected = model(x)
        apply_activation_checkpointing(model, "selective")
        assert torch.equal(model(x), expected)


# ================================================================== module surgery
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_names_and_state_dict_keys_unchanged(arch):
    model = MODELS[arch]()
    before = (list(model.state_dict()), [n for n, _ in model.named_modules()])
    names = apply_activation_checkpointing(model, "full")
    assert names and all(n in before[1] for n in names)
    assert (list(model.state_dict()), [n for n, _ in model.named_modules()]) == before


def test_every_n_picks_blocks_by_index_in_their_list():
    model = _gpt(n_layer=5)
    assert apply_activation_checkpointing(model, "every_n", 2) == [
        "blocks.0",
        "blocks.2",
        "blocks.4",
    ]
    assert apply_activation_checkpointing(model, "every_n", 3) == ["blocks.0", "blocks.3"]
    assert apply_activation_checkpointing(model, "every_n", 1) == [f"blocks.{i}" for i in range(5)]
    assert (
        apply_activation_checkpointing(model, "every_n", 2)
        and "forward" not in model.blocks[1].__dict__
    )


@pytest.fixture
def calls(monkeypatch) -> list:
    """One entry per call of torch.utils.checkpoint.checkpoint made by the module under test."""
    made, real = [], checkpointing.checkpoint
    monkeypatch.setattr(
        checkpointing, "checkpoint", lambda *a, **k: made.append(1) or real(*a, **k)
    )
    return made


def test_idempotent_and_reversible(calls):
    """Applying twice wraps once; "none" restores the forward found, even an instance one."""
    model, (x, y) = _gpt(n_layer=3), _batch()
    block = model.blocks[2]
    custom = block.forward = lambda h: type(block).forward(block, h) * 1.0  # someone else's forward
    for policy in ("full", "full", "selective"):
        apply_activation_checkpointing(model, policy)
        calls.clear()
        _step(model, x, y)
        assert len(calls) == 3
    apply_activation_checkpointing(model, "none")
    assert "forward" not in model.blocks[0].__dict__ and model.blocks[2].forward is custom
    calls.clear()
    _step(model, x, y)
    assert calls == []


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_run_their_own_blocks_checkpointed(how, calls):
    model = _gpt(n_layer=2)
    apply_activation_checkpointing(model, "full")
    clone = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(1.5)  # were the copy to run the original's blocks, its grads would not change
    x, y = _batch()
    plain = copy.deepcopy(clone)
    apply_activation_checkpointing(plain, "none")
    expected = _step(plain, x, y)
    calls.clear()
    _assert_same(_step(clone, x, y), expected)
    assert len(calls) == 2


# ================================================================== saved bytes
def test_saved_bytes_full_below_selective_below_none():
    model, (x, _) = _gpt(dropout=0.0), _batch()
    per = {p: activation_bytes_per_block(model, x, p) for p in POLICIES}
    assert "forward" not in model.blocks[0].__dict__  # the model's own policy is restored
    for name in per["none"]:
        assert per["full"][name] < per["selective"][name] < per["none"][name]
        # A fully checkpointed block keeps only its input: its output is the next one's input.
        assert per["full"][name] == B * T * 32 * 4
        index = int(name.rsplit(".", 1)[1])
        assert per["every_n"][name] == per["full" if index % 2 == 0 else "none"][name]


def test_saved_bytes_agree_with_saved_tensors_hooks_without_checkpointing():
    """Cross-check where autograd's hooks see everything. They attribute a tensor to the block
    that saves it (its input), the measurement to the one creating it (its output): same bytes."""
    model, (x, _) = _gpt(dropout=0.1), _batch()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    running, seen = [None], {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen.setdefault(storage.data_ptr(), (storage.nbytes(), running[-1]))
        return t

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *_, n=f"blocks.{i}": running.append(n) and None)
        block.register_forward_hook(lambda *_: running.pop() and None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    hooked = {f"blocks.{i}": 0 for i in range(len(model.blocks))}
    for nbytes, owner in seen.values():
        if owner is not None:
            hooked[owner] += nbytes
    assert activation_bytes_per_block(model, x, "none") == hooked


def test_run_summary_meter_counts_what_the_benchmark_counts():
    """``RunSummary``'s counter (``ActivationMeter``: autograd's saved tensors, plus what
    ``selective`` caches) against the benchmark's storage recorder: the same bytes per block
    for every policy, over a whole training step; everything released after backward."""
    model, (x, y) = _gpt(dropout=0.1), _batch()
    for policy in POLICIES:
        expected = activation_bytes_per_block(model, x, policy)
        apply_activation_checkpointing(model, policy)
        blocks = transformer_blocks(model)
        assert [name for name, _ in blocks] == list(expected)
        assert sum(is_checkpointed(b) for _, b in blocks) == {"none": 0, "every_n": 2}.get(
            policy, 4
        )
        meter = ActivationMeter()
        unwatch = meter.watch(blocks)
        meter.reset(model.parameters())
        with meter.hooks():
            _step(model, x, y)
        unwatch()
        assert meter.block_bytes == expected, policy
        assert meter.peak >= sum(expected.values()) and meter.live == 0, (
            policy,
            meter.peak,
            meter.live,
        )
    apply_activation_checkpointing(model, "none")
    assert "forward" not in model.blocks[0].__dict__


# ================================================================== 2-process world
def _watch_sharding(model: GPT) -> list[bool]:
    """One entry per forward of blocks.0's attention (its recompute in backward adds one) and of
    the final norm, in order: whether blocks.0's q weight is a DTensor at that moment. Under
    FSDP its hooks ran around the checkpointed forward (and the recompute) iff the weight is
    gathered (a plain tensor) inside the block and a shard after it; under tensor parallelism it
    stays a DTensor, and the entries count the recomputation."""
    seen, attn = [], model.blocks[0].attn

    def note(*_: object) -> None:
        seen.append(isinstance(attn.wq.weight, DTensor))

    attn.register_forward_hook(note)
    model.norm.register_forward_hook(note)
    return seen


def _world_rank(rank: int) -> dict:
    """One world for both checks (each spawn costs seconds of imports on 2 cores)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel.fsdp import apply_zero3
    from lightning_3d.parallel.plans import detect_plan
    from lightning_3d.parallel.tensor import apply_tensor_parallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("axis",))
    x, y = _batch(seed=10 + rank)  # data parallel: each rank its own batch
    out: dict = {}
    for policy in POLICIES:  # FSDP2 per block after checkpointing, dropout on
        model = _gpt(dropout=0.1)
        apply_activation_checkpointing(model, policy)
        apply_zero3(model, mesh, roots=[model])  # the GPT is the outer unit
        seen = _watch_sharding(model)
        out[("fsdp", policy)] = (*_step(model, x, y), seen)
    x, y = _batch(seed=20)  # tensor parallel: every rank the same batch
    for policy in POLICIES:
        model = _gpt(dropout=0.0)
        apply_tensor_parallel(model, mesh, detect_plan(model, sequence_parallel=True)[1])
        apply_activation_checkpointing(model, policy)
        seen = _watch_sharding(model)
        out[("tp", policy)] = (*_step(model, x, y), seen)
    return out


# What _watch_sharding sees in one step: blocks.0's forward, the final norm, and (when blocks.0 is
# checkpointed: every policy but "none") blocks.0's recompute in backward, with weights gathered.
EXPECTED_SEEN = {
    ("fsdp", False): [False, True],
    ("fsdp", True): [False, True, False],
    ("tp", False): [True, True],
    ("tp", True): [True, True, True],
}


def test_composes_with_fsdp2_and_tensor_parallel_on_two_ranks():
    """Catches: checkpointing that silently does nothing under FSDP2 or tensor parallelism (no
    recompute counted), FSDP's hooks not run around the recompute (weights still sharded)."""
    world = run_world(_world_rank, 2)
    for rank_out in world:
        for kind in ("fsdp", "tp"):
            reference = rank_out[(kind, "none")]
            for policy in POLICIES:
                loss, grads, seen = rank_out[(kind, policy)]
                assert seen == EXPECTED_SEEN[kind, policy != "none"], (kind, policy, seen)
                assert grads and all(g is not None for g in grads.values())
                _assert_same((loss, grads), reference[:2])
    assert world[0][("fsdp", "none")][0] != world[1][("fsdp", "none")][0]  # different batches
