"""Tensor-parallel plans on Hugging Face models: the built-in ``gpt2`` plan on transformers'
``GPT2LMHeadModel`` (``Conv1D`` projections, fused q/k/v split by ``split_size``, blocks called
with several positional arguments), and the refusals that must come before any process starts.

Plain unit tests resolve plans on whole tiny models (no process group). Real 2-rank gloo worlds
train 5 fp32 steps and compare losses and gathered weights with one process. Untied embedding
and head: tied weights under tensor parallelism are handled (and tested) elsewhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from lightning_3d.parallel.plans import detect_plan, plan_from_names  # noqa: E402
from lightning_3d.parallel.tensor import (  # noqa: E402
    FUSED_ROWS_ATTR,
    ColwiseConv1DParallel,
    FusedColwiseParallel,
    LocalSizes,
    PrepareHiddenStates,
    RowwiseConv1DParallel,
    regroup_fused_rows,
    resolve_plan,
)
from tools.harness.parity import assert_same_run, loss_mismatches, update_mismatches  # noqa: E402
from tools.harness.runs import Run, fit_gpt  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

STEPS, SEED = 5, 1234
UNTIED = {"tie_word_embeddings": False}


def _hf(family: str = "gpt2", **overrides):
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    return HFCausalLM(config=tiny_hf_config(family, **{**UNTIED, **overrides}))


def _refusal(model: nn.Module, plan: dict, tp: int) -> str:
    with pytest.raises(ValueError) as err:
        resolve_plan(model, plan, tp)
    assert not dist.is_initialized()  # shapes and names only: nothing launched, no collective
    return str(err.value)


# ================================================================== plain unit: the plan
@pytest.mark.parametrize("family, arch", [("gpt2", "gpt2"), ("llama", "llama"), ("qwen2", "llama")])
def test_hf_models_are_recognised_under_the_lightning_module(family, arch):
    model = _hf(family)
    name, plan = detect_plan(model, sequence_parallel=True)
    assert name == arch
    resolved = resolve_plan(model, plan, 2)
    assert "model.lm_head" in resolved  # found under HFCausalLM's ``model.`` prefix


def test_hf_gpt2_plan_splits_conv1d_and_localises_attention_sizes():
    model = _hf()
    resolved = resolve_plan(model, detect_plan(model, sequence_parallel=True)[1], 2)
    block = "model.transformer.h.0"
    assert isinstance(model.get_submodule(f"{block}.mlp.c_fc"), Conv1D)
    assert isinstance(resolved[f"{block}.attn.c_attn"], FusedColwiseParallel)
    assert isinstance(resolved[f"{block}.mlp.c_fc"], ColwiseConv1DParallel)
    assert isinstance(resolved[f"{block}.mlp.c_proj"], RowwiseConv1DParallel)
    assert resolved[f"{block}.mlp.c_proj"].output_layouts == (Shard(1),)
    assert isinstance(resolved[f"{block}.attn"], LocalSizes)
    assert resolved[f"{block}.attn"].sizes(model.get_submodule(f"{block}.attn")) == {
        "split_size": 32,
        "num_heads": 4,
        "embed_dim": 32,
    }
    assert isinstance(resolved["model.transformer.h.0"], PrepareHiddenStates)


def test_style_names_on_conv1d_get_the_conv1d_styles():
    """``"colwise"`` / ``"rowwise"`` (torch's own classes) on a Conv1D resolve to the subclasses
    that can split it, with the same layouts."""
    model = _hf()
    plan = plan_from_names(
        {"*.mlp.c_fc": "colwise", "*.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}
    )
    resolved = resolve_plan(model, plan, 2)
    fc, proj = (
        resolved["model.transformer.h.1.mlp.c_fc"],
        resolved["model.transformer.h.1.mlp.c_proj"],
    )
    assert type(fc) is ColwiseConv1DParallel and fc.input_layouts == (Replicate(),)
    assert type(proj) is RowwiseConv1DParallel and proj.output_layouts == (Shard(1),)
    assert type(plan["*.mlp.c_fc"]) is ColwiseParallel  # the plan itself is not changed


@pytest.mark.parametrize("dim", [0, -1], ids=["linear", "conv1d"])
def test_regroup_fused_rows_along_the_output_dim(dim):
    """Conv1D's output features are its weight's last dim: regrouping there is the transpose
    of regrouping nn.Linear's rows, and the inverse undoes it."""
    w = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    t = w if dim == 0 else w.T
    out = regroup_fused_rows(t, 3, 2, dim)
    expected = regroup_fused_rows(w, 3, 2)
    assert torch.equal(out if dim == 0 else out.T, expected)
    assert torch.equal(regroup_fused_rows(out, 3, 2, dim, inverse=True), t)


# ================================================================== plain unit: refusals
def test_indivisible_heads_and_widths_are_named_before_launch():
    model = _hf(n_embd=48, n_head=6, n_inner=66)  # 6 heads and an MLP width of 66 over tensor=4
    message = _refusal(model, detect_plan(model)[1], 4)
    assert message.startswith("tensor=4 does not divide the model")
    assert "model.transformer.h.0.attn.c_attn: heads 6 is not divisible by tensor=4" in message
    assert "model.transformer.h.1.attn: num_heads 6" in message
    assert "model.transformer.h.0.mlp.c_fc: out_features 66" in message
    assert "model.transformer.h.1.mlp.c_proj: in_features 66" in message
    assert "attn.c_proj" not in message  # 48 input features split fine


def test_indivisible_vocabulary_and_embedding_width_are_named():
    model = _hf(vocab_size=250)
    plan = {"*wte": RowwiseParallel(), "*wpe": ColwiseParallel(), "*lm_head": ColwiseParallel()}
    message = _refusal(model, plan, 4)
    assert "model.transformer.wte: num_embeddings (vocabulary) 250" in message
    assert "model.lm_head: out_features 250" in message
    assert "wpe" not in message  # embedding_dim 32 splits over 4
    assert "model.transformer.wpe: embedding_dim 32" in _refusal(
        model, {"*wpe": ColwiseParallel()}, 3
    )


def test_fused_chunks_must_divide_the_output():
    message = _refusal(_hf(), {"*.mlp.c_fc": FusedColwiseParallel(5)}, 2)  # 128 outputs, 5 chunks
    assert (
        "model.transformer.h.0.mlp.c_fc: out_features 128 do not split into 5 fused chunks"
        in message
    )


def test_style_on_a_module_type_it_cannot_split_is_named_with_its_class():
    model = _hf()
    plan = {
        "*.ln_1": ColwiseParallel(),
        "*wte": FusedColwiseParallel(3),
        "*.mlp.c_fc": ColwiseConv1DParallel(),
    }
    message = _refusal(model, plan, 2)
    assert (
        "model.transformer.h.0.ln_1 is a torch.nn.modules.normalization.LayerNorm, "
        "and ColwiseParallel splits only Linear, Embedding" in message
    )
    assert (
        "model.transformer.wte is a torch.nn.modules.sparse.Embedding, and FusedColwiseParallel"
        in message
    )
    assert "c_fc" not in message


# ================================================================== real 2-rank worlds
def _values_rank(rank: int) -> dict:
    """Apply the plan by hand (no Trainer) to a GPT-2 with random q/k/v biases: local shards,
    state round trips and forward parity, with and without sequence parallelism."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.checkpoint.consolidated import load_full_model_state
    from lightning_3d.checkpoint.view import full_state_dict
    from lightning_3d.parallel.tensor import apply_tensor_parallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = _hf().eval()
        for block in model.model.transformer.h:
            nn.init.normal_(block.attn.c_attn.bias, std=0.1)
        original = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            expected = model(idx)
        apply_tensor_parallel(model, mesh, detect_plan(model, sp)[1])
        attn = model.model.transformer.h[1].attn
        with torch.no_grad():
            logits = model(idx).full_tensor()
        full = full_state_dict(model)
        load_full_model_state(model, original)  # regrouped again on the way in
        out[sp] = {
            "original": original,
            "expected": expected,
            "logits": logits,
            "full": full,
            "local_w": attn.c_attn.weight.to_local().clone(),
            "local_b": attn.c_attn.bias.to_local().clone(),
            "fused_attr": getattr(attn.c_attn, FUSED_ROWS_ATTR),
            "split_size": attn.split_size,
            "num_heads": attn.num_heads,
            "after_load": full_state_dict(model),
        }
    return out


@pytest.fixture(scope="module")
def values_world():
    return run_world(_values_rank, 2)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_world_hf_gpt2_conv1d_shards_round_trip_and_forward(values_world, sp):
    for rank, world in enumerate(values_world):
        out = world[sp]
        original = out["original"]
        for key, value in original.items():
            # Regrouping undone along Conv1D's dim -1.
            assert torch.equal(out["full"][key], value), key
            assert torch.equal(out["after_load"][key], value), key
        assert out["fused_attr"] == (3, 2, -1)
        assert (out["split_size"], out["num_heads"]) == (16, 2)  # this rank's 2 of 4 heads
        # (in 32, out 96): q | k | v columns.
        w = original["model.transformer.h.1.attn.c_attn.weight"]
        b = original["model.transformer.h.1.attn.c_attn.bias"]
        cols = slice(rank * 16, (rank + 1) * 16)
        assert torch.equal(
            out["local_w"], torch.cat([c[:, cols] for c in w.chunk(3, dim=1)], dim=1)
        )
        assert torch.equal(out["local_b"], torch.cat([c[cols] for c in b.chunk(3)]))
        torch.testing.assert_close(out["logits"], out["expected"], atol=1e-5, rtol=0)


def _fit(rank: int, strategy: dict | None, devices: int) -> dict:
    return fit_gpt(
        rank,
        Run(
            strategy=strategy,
            devices=devices,
            steps=STEPS,
            seed=SEED,
            model={"hf": UNTIED},
            trainer={"gradient_clip_val": 0.05},
            arch="hf_gpt2",
        ),
    )


@pytest.fixture(scope="module")
def reference():
    return _fit(0, None, 1)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_hf_gpt2_tensor_parallel_matches_single_process(reference, sequence_parallel):
    world = run_world(_fit, 2, {"tensor": 2, "sequence_parallel": sequence_parallel}, 2)
    assert world[0]["summary"]["layout"]["tensor"] == 2
    assert world[1]["losses"] == world[0]["losses"]
    for rank in world[0]["summary"]["ranks"]:  # every split layer (Conv1D ones too) holds half
        assert rank["tp_split_param_bytes"] * 2 == rank["tp_split_dense_bytes"] > 0
    assert_same_run(world[0], reference)


def _meta_model(family: str):
    import transformers

    from tools.harness.hf_configs import tiny_config

    options = dict(tiny_config(family))
    config = transformers.AutoConfig.for_model(options.pop("model_type"), **options)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_sequence_parallel_finds_the_final_norm_without_a_pipeline_plan():
    """Nemotron ships no pipeline plan: its final norm must still hold the sequence shard (a
    plain norm handed a sequence-sharded DTensor crashed with 'mixed torch.Tensor and DTensor')."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from lightning_3d.parallel.plans.hf import hf_tensor_plan

    model = _meta_model("nemotron")
    assert getattr(model.config, "base_model_pp_plan", None) is None
    plan = hf_tensor_plan(model, sequence_parallel=True)
    assert isinstance(plan.get("model.norm"), SequenceParallel)
    assert all(
        isinstance(plan.get(f"model.layers.{i}.input_layernorm"), SequenceParallel)
        for i in range(model.config.num_hidden_layers)
    )


def test_sequence_parallel_refuses_a_base_model_that_runs_blocks_in_cycles():
    """HRM-Text runs two block lists in cycles and adds their states between them: a sequence
    shard would meet a whole tensor (a crash at the first step); refused on the meta model."""
    from lightning_3d.parallel.plans.hf import hf_tensor_plan

    model = _meta_model("hrm_text")
    with pytest.raises(
        ValueError,
        match=r"HrmTextForCausalLM: sequence_parallel=True .* not one list of blocks "
        r"run in order .*use sequence_parallel=False",
    ):
        hf_tensor_plan(model, sequence_parallel=True)
    assert hf_tensor_plan(model, sequence_parallel=False)  # plain tensor parallelism stays possible


def test_sequence_parallel_refuses_a_final_norm_that_also_runs_before_the_blocks():
    """NanoChat calls ``model.norm`` on the embedding and again after the last block: as the
    final norm it would shard the sequence before the first block (a crash at the first
    forward, '64 must match 32'); refused on the meta model."""
    from lightning_3d.parallel.plans.hf import hf_tensor_plan

    if "nanochat" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no NanoChat")
    model = _meta_model("nanochat")
    with pytest.raises(
        ValueError,
        match=r"NanoChatForCausalLM: sequence_parallel=True .* model.norm runs more "
        r"than once in NanoChatModel's forward",
    ):
        hf_tensor_plan(model, sequence_parallel=True)
    assert hf_tensor_plan(model, sequence_parallel=False)
    hf_tensor_plan(_meta_model("llama"), sequence_parallel=True)  # a final norm run once


def test_scalar_parameters_between_split_projections_sum_their_gradients():
    """Apertus' xIELU activation holds two scalars and runs between the column-parallel
    ``up_proj`` and the row-parallel ``down_proj``, where each rank holds part of the features:
    its gradient is a share per rank, summed over tp (transformers' plan does not list it; the
    replica guard stopped tp2 at the first step). A parameter-free activation gets no entry."""
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.parallel.plans.hf import hf_tensor_plan
    from lightning_3d.parallel.tensor import ReplicatedGradSum
    from tools.harness.hf_configs import tiny_config

    if "apertus" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no Apertus")
    with torch.device("meta"):
        apertus = HFCausalLM(config=tiny_config("apertus"))
        llama = HFCausalLM(config=tiny_config("llama"))
    assert isinstance(
        hf_tensor_plan(apertus, False)["model.model.layers.*.mlp.act_fn"], ReplicatedGradSum
    )
    assert not any(k.endswith("act_fn") for k in hf_tensor_plan(llama, False))
    # Per-head q/k norms a family's plan leaves out (Sarvam-MoE) are summed too; a norm over the
    # mixer's split channels (Nemotron-H's gated norm: its weight is split-width) is not.
    for family, pattern, summed in (
        ("sarvam_moe", "model.model.layers.*.self_attn.q_norm", True),
        ("nemotron_h", "model.model.layers.*.mixer.norm", False),
    ):
        if family in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
            with torch.device("meta"):
                plan = hf_tensor_plan(HFCausalLM(config=tiny_config(family)), False)
            assert isinstance(plan.get(pattern), ReplicatedGradSum) is summed, (
                family,
                plan.get(pattern),
            )


def _fit_family(rank: int, family: str, strategy: dict | None, devices: int) -> dict:
    from tools.harness.hf_configs import tiny_config

    run = Run(
        strategy=strategy,
        devices=devices,
        steps=3,
        seed=1234,
        arch="hf",
        model={"hf": tiny_config(family)},
    )
    return fit_gpt(rank, run)


def test_apertus_tensor_parallel_matches_one_process():
    if "apertus" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no Apertus")
    reference = run_world(_fit_family, 1, "apertus", None, 1)[0]
    world = run_world(_fit_family, 2, "apertus", {"tensor": 2}, 2)
    assert loss_mismatches(world[0]["losses"], reference["losses"], rtol=1e-5) == []
    assert (
        update_mismatches(
            world[0]["state"], reference["state"], reference["initial_state"], rtol=1e-3
        )
        == []
    )


def test_blocks_inside_blocks_are_part_of_their_block():
    """LongCat-Flash's layers hold lists of their own: the blocks are the outer list's elements
    only (ZeRO-3 sharded a layer, then a module inside it: 'Cannot concatenate overlapping
    meshes'), and a dp2 ZeRO-3 run matches one process."""
    from lightning_3d.parallel.fsdp import find_blocks

    inner = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    layer = nn.Sequential(nn.Linear(2, 2))
    layer.inner = inner
    model = nn.Module()
    model.layers = nn.ModuleList([layer, nn.Linear(2, 2)])
    assert [id(b) for b in find_blocks(model)] == [id(layer), id(model.layers[1])]
    if "longcat_flash" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip("this transformers has no LongCat-Flash")
    reference = run_world(_fit_family, 1, "longcat_flash", None, 1)[0]
    world = run_world(_fit_family, 2, "longcat_flash", {"data": 2, "zero_stage": 3}, 2)
    assert loss_mismatches(world[0]["losses"], reference["losses"], rtol=1e-5) == []
    assert (
        update_mismatches(
            world[0]["state"], reference["state"], reference["initial_state"], rtol=1e-3
        )
        == []
    )
