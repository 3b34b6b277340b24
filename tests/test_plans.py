"""Tensor-parallel plans: recognition, resolution, refusals, and what applying them produces.

Three levels: plain unit tests (no process group: ``detect_plan`` / ``resolve_plan`` only read
names and shapes), a fake one-process world for the placements and local shapes at large tensor
sizes, and two real 2-rank gloo worlds: one for values (fused q/k/v round trip, forward parity),
one for the strategy refusing an indivisible model by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_3d.models import GPT, GPTConfig, LitGPT
from lightning_3d.parallel.fake_world import fake_world
from lightning_3d.parallel.plans import BUILTIN, build_plan, detect_plan, plan_from_names
from lightning_3d.parallel.tensor import (
    FUSED_ROWS_ATTR,
    FusedColwiseParallel,
    apply_tensor_parallel,
    regroup_fused_rows,
    resolve_plan,
)
from tools.harness.tiny_models import LitTinyLM, TinyGPT2, TinyLlama
from tools.harness.world import run_world


def _gpt(**kw) -> GPT:
    cfg = dict(vocab_size=256, block_size=32, n_layer=1, n_head=4, n_embd=32)
    return GPT(GPTConfig(**{**cfg, **kw}))


def _wrapped(model: nn.Module) -> nn.Module:
    """``model`` under ``.model``, as a LightningModule holds it."""
    root = nn.Module()
    root.model = model
    return root


def _resolve_error(model: nn.Module, tp: int) -> str:
    with pytest.raises(ValueError) as err:
        resolve_plan(model, detect_plan(model)[1], tp)
    assert not dist.is_initialized()  # resolution is shape logic only: no process group needed
    return str(err.value)


# ================================================================== plain unit: detect_plan
@pytest.mark.parametrize(
    "make, arch",
    [
        (lambda: _gpt(), "gpt"),
        (lambda: LitGPT(n_layer=1, n_head=4, n_embd=32, block_size=16), "gpt"),
        (lambda: TinyLlama(), "llama"),
        (lambda: LitTinyLM(arch="llama", n_layer=1, n_head=4, n_embd=32, block_size=16), "llama"),
        (lambda: TinyGPT2(), "gpt2"),
        (lambda: LitTinyLM(arch="gpt2", n_layer=1, n_head=4, n_embd=32, block_size=16), "gpt2"),
    ],
    ids=["GPT", "LitGPT", "TinyLlama", "LitTinyLM-llama", "TinyGPT2", "LitTinyLM-gpt2"],
)
def test_detect_plan_recognises_builtin_architectures(make, arch):
    model = make()
    name, plan = detect_plan(model)
    assert name == arch
    spec = BUILTIN[arch]
    assert set(spec.colwise) | set(spec.rowwise) | {spec.embedding, spec.head} <= set(plan)
    # The detected plan resolves against the very model it was detected on (tp=2 divides all).
    resolved = resolve_plan(model, plan, 2)
    assert any(n.endswith("lm_head") for n in resolved)


def test_detect_plan_gpt2_uses_fused_qkv_style():
    plan = detect_plan(TinyGPT2())[1]
    fused = plan["*.attn.c_attn"]
    assert isinstance(fused, FusedColwiseParallel) and fused.chunks == 3


def test_detect_plan_with_sequence_parallel_adds_norms_and_first_block():
    plan = detect_plan(TinyLlama(), sequence_parallel=True)[1]
    assert isinstance(plan["*layers.0"], PrepareModuleInput)
    for norm in BUILTIN["llama"].norms:
        assert isinstance(plan[norm], SequenceParallel)
    assert plan["*.self_attn.q_proj"].input_layouts == (Shard(1),)
    assert plan["*.self_attn.o_proj"].output_layouts == (Shard(1),)
    plain = detect_plan(TinyLlama())[1]
    assert not any(isinstance(s, (SequenceParallel, PrepareModuleInput)) for s in plain.values())


def test_detect_plan_unknown_model_lists_names_and_suggests_explicit_plan():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError) as err:
        detect_plan(model)
    message = str(err.value)
    assert "Sequential" in message
    for spec in BUILTIN.values():
        for pattern in spec.signature:
            assert pattern in message
    assert "explicit plan" in message and "tp_plan" in message


# ================================================================== plain unit: resolve_plan
def test_resolve_plan_unmatched_pattern_is_named():
    plan = {"*.attn.wq": ColwiseParallel(), "*.attn.nonexistent": RowwiseParallel()}
    with pytest.raises(ValueError) as err:
        resolve_plan(_gpt(), plan, 2)
    assert "*.attn.nonexistent" in str(err.value)
    assert "GPT" in str(err.value)
    assert "*.attn.wq'" not in str(err.value)  # only the unmatched pattern is blamed


def test_resolve_plan_expands_patterns_first_match_wins():
    first, second = ColwiseParallel(), RowwiseParallel()
    resolved = resolve_plan(_gpt(n_layer=2), {"*.attn.wq": first, "*.attn.w*": second}, 2)
    assert resolved["blocks.0.attn.wq"] is first and resolved["blocks.1.attn.wq"] is first
    assert resolved["blocks.1.attn.wk"] is second and resolved["blocks.0.attn.wo"] is second
    assert set(resolved) == {f"blocks.{i}.attn.w{x}" for i in (0, 1) for x in "qkvo"}


def test_resolve_plan_heads_not_divisible():
    message = _resolve_error(_gpt(n_head=6, n_embd=48), 4)  # 48 columns divide, 6 heads do not
    assert "tensor=4" in message
    assert "blocks.0.attn.wq: heads 6" in message
    assert "blocks.0.attn.wk: heads 6" in message and "blocks.0.attn.wv: heads 6" in message
    assert "out_features" not in message and "mlp" not in message


def test_resolve_plan_kv_heads_not_divisible():
    model = TinyLlama(d=32, n_head=4, n_kv_head=2)
    message = _resolve_error(model, 4)
    assert "tensor=4" in message
    assert "model.layers.0.self_attn.k_proj: heads 2" in message
    assert "v_proj: heads 2" in message
    assert "q_proj" not in message  # 4 query heads split fine
    resolve_plan(model, detect_plan(model)[1], 2)  # 2 k/v heads over 2 ranks: fine


def test_resolve_plan_fused_heads_not_divisible():
    message = _resolve_error(TinyGPT2(d=48, n_head=6), 4)
    assert "transformer.h.0.attn.c_attn: heads 6" in message and "tensor=4" in message


def test_resolve_plan_mlp_hidden_not_divisible():
    # GPT's hidden is mlp_ratio * n_embd, so any tp dividing n_embd divides it: make it 34 by hand.
    model = _gpt(n_head=4, n_embd=32)
    model.blocks[0].mlp.fc1 = nn.Linear(32, 34, bias=False)
    model.blocks[0].mlp.fc2 = nn.Linear(34, 32, bias=False)
    message = _resolve_error(model, 4)
    assert "tensor=4" in message
    assert "blocks.0.mlp.fc1: out_features 34" in message
    assert "blocks.0.mlp.fc2: in_features 34" in message
    assert "attn" not in message and "heads" not in message


def test_resolve_plan_vocabulary_not_divisible():
    message = _resolve_error(_gpt(vocab_size=255), 2)
    assert "tok_emb: num_embeddings (vocabulary) 255" in message
    assert "lm_head: out_features 255" in message
    assert "tensor=2" in message


# ================================================================== plain unit: plan_from_names
def test_plan_from_names_maps_each_style_name():
    plan = plan_from_names(
        {"a": "colwise", "b": "rowwise", "c": "sequence", "d": "vocab", "e": "head"},
        sequence_parallel=False,
    )
    assert type(plan["a"]) is ColwiseParallel and plan["a"].input_layouts == (Replicate(),)
    assert type(plan["b"]) is RowwiseParallel and plan["b"].output_layouts == (Replicate(),)
    assert type(plan["c"]) is SequenceParallel
    vocab = plan["d"]
    assert type(vocab) is RowwiseParallel
    assert vocab.input_layouts == (Replicate(),) and vocab.output_layouts == (Replicate(),)
    head = plan["e"]
    assert type(head) is ColwiseParallel
    assert head.input_layouts == (Replicate(),) and head.output_layouts == (Shard(-1),)
    assert head.use_local_output is False  # logits stay a vocab-sharded DTensor for loss_parallel


def test_plan_from_names_keeps_style_objects_and_rejects_unknown_names():
    style = RowwiseParallel(output_layouts=Shard(1))
    assert plan_from_names({"x": style})["x"] is style
    with pytest.raises(ValueError) as err:
        plan_from_names({"*.attn.wq": "colwise", "*.mlp.fc1": "columnwise"})
    message = str(err.value)
    assert "'columnwise'" in message and "'*.mlp.fc1'" in message
    for known in ("colwise", "rowwise", "sequence", "vocab", "head"):
        assert known in message


def test_build_plan_explicit_or_detected():
    model = _gpt()
    detected = build_plan(model, None, False)
    assert set(detected) == set(detect_plan(model)[1])
    explicit = build_plan(model, {"*.attn.wq": "colwise"}, False)
    assert list(explicit) == ["*.attn.wq"] and type(explicit["*.attn.wq"]) is ColwiseParallel


# ================================================================== plain unit: regroup_fused_rows
def test_regroup_fused_rows_rank_blocks_are_q_k_v():
    chunks, tp, d = 3, 2, 4
    t = torch.arange(chunks * d * 5, dtype=torch.float32).reshape(chunks * d, 5)  # rows labelled
    q, k, v = t.chunk(3)
    out = regroup_fused_rows(t, chunks, tp)
    half = chunks * d // tp
    for r in range(tp):
        rows = slice(r * d // tp, (r + 1) * d // tp)
        assert torch.equal(out[r * half : (r + 1) * half], torch.cat([q[rows], k[rows], v[rows]]))
    assert out[:, 0].tolist() == [0, 5, 20, 25, 40, 45, 10, 15, 30, 35, 50, 55]


@pytest.mark.parametrize("chunks, tp", [(3, 2), (3, 4), (2, 4), (3, 1), (1, 3)])
@pytest.mark.parametrize("shape", [(24, 5), (24,)], ids=["weight", "bias"])
def test_regroup_fused_rows_round_trip(chunks, tp, shape):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = regroup_fused_rows(t, chunks, tp)
    assert out.shape == t.shape
    assert torch.equal(regroup_fused_rows(out, chunks, tp, inverse=True), t)
    if chunks > 1 and tp > 1:
        assert not torch.equal(out, t)  # it really permutes


# ================================================================== fake world (one process)
def _placement(p):
    return p.placements if isinstance(p, DTensor) else None


def _local(p):
    return tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)


REF = dict(vocab_size=256, block_size=32, n_layer=2, n_head=16, n_embd=256)


def _apply_in_fake_world(root: nn.Module, tp: int, sequence_parallel: bool, rank: int = 1) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(rank, tp):
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        apply_tensor_parallel(root, mesh, detect_plan(root, sequence_parallel)[1])
        return dict(root.named_parameters())


@pytest.mark.parametrize("tp", [8, 16])
def test_fake_world_gpt_placements_and_local_shapes(tp):
    params = _apply_in_fake_world(GPT(GPTConfig(**REF)), tp, sequence_parallel=False)
    assert not dist.is_initialized()
    d, hidden, vocab = 256, 4 * 256, 256
    for i in range(2):
        for w in ("wq", "wk", "wv"):
            p = params[f"blocks.{i}.attn.{w}.weight"]
            assert _placement(p) == (Shard(0),) and _local(p) == (d // tp, d)
        p = params[f"blocks.{i}.attn.wo.weight"]
        assert _placement(p) == (Shard(1),) and _local(p) == (d, d // tp)
        p = params[f"blocks.{i}.mlp.fc1.weight"]
        assert _placement(p) == (Shard(0),) and _local(p) == (hidden // tp, d)
        p = params[f"blocks.{i}.mlp.fc2.weight"]
        assert _placement(p) == (Shard(1),) and _local(p) == (d, hidden // tp)
        for norm in ("attn_norm", "mlp_norm"):
            assert not isinstance(params[f"blocks.{i}.{norm}.weight"], DTensor)
    assert _placement(params["tok_emb.weight"]) == (Shard(0),) and _local(
        params["tok_emb.weight"]
    ) == (vocab // tp, d)
    assert _placement(params["lm_head.weight"]) == (Shard(0),) and _local(
        params["lm_head.weight"]
    ) == (vocab // tp, d)
    for name in ("norm.weight", "pos_emb.weight"):
        assert not isinstance(params[name], DTensor) and _local(params[name]) == tuple(
            params[name].shape
        )
    # Global shapes are the dense ones.
    assert tuple(params["blocks.0.mlp.fc2.weight"].shape) == (d, hidden)


@pytest.mark.parametrize("tp", [8, 16])
def test_fake_world_sequence_parallel_norms_are_replicated_dtensors(tp):
    lit = LitGPT(**{k: v for k, v in REF.items()})
    params = _apply_in_fake_world(lit, tp, sequence_parallel=True)
    norms = [n for n in params if "norm" in n]
    assert sorted(norms) == sorted(
        ["model.norm.weight"]
        + [f"model.blocks.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "mlp_norm")]
    )
    for name in norms:
        assert isinstance(params[name], DTensor) and params[name].placements == (Replicate(),)
        assert _local(params[name]) == (256,)
    assert not isinstance(params["model.pos_emb.weight"], DTensor)
    assert params["model.blocks.1.attn.wq.weight"].placements == (Shard(0),)
    assert _local(params["model.blocks.1.attn.wq.weight"]) == (256 // tp, 256)


def test_fake_world_bare_gpt_sequence_parallel():
    params = _apply_in_fake_world(GPT(GPTConfig(**REF)), 8, sequence_parallel=True)
    assert params["norm.weight"].placements == (Replicate(),)


def test_named_plan_with_sequence_parallel_is_refused():
    """Style names cannot say where the residual stream becomes sequence-sharded: refused."""
    names = {
        "*tok_emb": "vocab",
        "*.attn.wq": "colwise",
        "*.attn.wk": "colwise",
        "*.attn.wv": "colwise",
        "*.mlp.fc1": "colwise",
        "*.attn.wo": "rowwise",
        "*.mlp.fc2": "rowwise",
        "*lm_head": "head",
    }
    lit = LitGPT(n_layer=1, n_head=4, n_embd=32, block_size=16)
    with pytest.raises(ValueError, match="sequence_parallel=True with style names"):
        build_plan(lit, names, sequence_parallel=True)


# ================================================================== real 2-rank worlds
def _tp_mesh(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))


def _values_rank(rank: int) -> dict:
    """One world for both value checks (each spawn costs ~15 s of imports on 2 cores)."""
    mesh = _tp_mesh(2)
    return {"gpt2": _gpt2_fused(mesh), "gpt": _gpt_forward(mesh)}


def _gpt2_fused(mesh) -> dict:
    from lightning_3d.checkpoint.view import full_state_dict

    torch.manual_seed(0)
    model = TinyGPT2(vocab=64, block_size=16, d=32, n_layer=2, n_head=4)
    gen = torch.Generator().manual_seed(1)
    for block in model.transformer.h:
        fused = nn.Linear(32, 96, bias=True)
        with torch.no_grad():
            fused.weight.copy_(torch.randn(96, 32, generator=gen) * 0.1)
            fused.bias.copy_(torch.randn(96, generator=gen) * 0.1)
        block.attn.c_attn = fused
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 64, (2, 16), generator=gen)
    with torch.no_grad():
        expected = model(idx)
    apply_tensor_parallel(model, mesh, detect_plan(model)[1])
    attn = model.transformer.h[1].attn
    local_w = attn.c_attn.weight.to_local().detach().clone()
    local_b = attn.c_attn.bias.to_local().detach().clone()
    with torch.no_grad():
        logits = model(idx).full_tensor()
    return {
        "original": original,
        "full": full_state_dict(model),
        "local_w": local_w,
        "local_b": local_b,
        "fused_attr": getattr(attn.c_attn, FUSED_ROWS_ATTR, None),
        "logits": logits,
        "expected": expected,
    }


@pytest.fixture(scope="module")
def values_world():
    return run_world(_values_rank, 2)


def test_world_gpt2_fused_qkv_round_trip_and_local_rows(values_world):
    world = [out["gpt2"] for out in values_world]
    original = world[0]["original"]
    for r, out in enumerate(world):
        assert set(out["full"]) == set(original)
        for key, value in original.items():
            assert torch.equal(out["full"][key], value), key
        assert out["fused_attr"] == (3, 2)
        w = original["transformer.h.1.attn.c_attn.weight"]
        b = original["transformer.h.1.attn.c_attn.bias"]
        # This rank's 2 of 4 heads (head_dim 8) in each of q, k, v.
        rows = slice(r * 16, (r + 1) * 16)
        assert torch.equal(out["local_w"], torch.cat([c[rows] for c in w.chunk(3)]))
        assert torch.equal(out["local_b"], torch.cat([c[rows] for c in b.chunk(3)]))
        torch.testing.assert_close(out["logits"], out["expected"], atol=1e-5, rtol=1e-5)


def _gpt_forward(mesh) -> dict:
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    reference = GPT(cfg).eval()
    with torch.no_grad():
        expected = reference(idx)
    out = {"expected": expected}
    for sp in (False, True):
        torch.manual_seed(0)
        root = _wrapped(GPT(cfg).eval())
        apply_tensor_parallel(root, mesh, detect_plan(root, sp)[1])
        with torch.no_grad():
            logits = root.model(idx)
        out[f"placements_sp={sp}"] = logits.placements
        out[f"sp={sp}"] = logits.full_tensor()
    return out


def test_world_gpt_forward_matches_unsplit_model(values_world):
    world = [out["gpt"] for out in values_world]
    expected = world[0]["expected"]
    assert expected.shape == (2, 16, 64)
    for out in world:
        assert torch.equal(out["expected"], expected)
        for sp in (False, True):
            assert out[f"placements_sp={sp}"] == (Shard(2),)  # vocab-parallel logits
            torch.testing.assert_close(out[f"sp={sp}"], expected, atol=1e-5, rtol=0)


def _strategy_bad_heads_rank(rank: int) -> str | None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_3d import ThreeDStrategy

    x = torch.randint(0, 256, (8, 16))
    data = DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=2)
    model = LitGPT(n_layer=1, n_head=3, n_embd=48, block_size=16, max_steps=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ThreeDStrategy(tensor=2),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model, train_dataloaders=data)
    except ValueError as err:
        return str(err)
    return None


def test_world_strategy_rejects_indivisible_heads_by_name():
    world = run_world(_strategy_bad_heads_rank, 2)
    for message in world:
        assert message is not None, "fit did not raise"
        assert "heads 3" in message and "tensor=2" in message
        assert "attn.wq" in message
