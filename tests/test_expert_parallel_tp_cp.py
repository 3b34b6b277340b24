"""Expert parallelism composed with context and with tensor parallelism, against one process.

ep2 x cp2 (4 ranks: two data ranks splitting the experts, each sequence cut in two): an
expert's gradient is summed over every rank holding the same experts, ``dp_replica`` x ``cp``
(``parallel/expert.py``'s ``expert_groups``), and divided by data x context; the router's
statistics and the capacity line go over data x context (the shard mesh). ep2 x tp2 (4 ranks:
attention split over two tensor ranks, router and experts replicated on them, the ``ep``
groups at one tensor coordinate; ``parallel/plans/moe.py``), with and without sequence
parallelism (the MoE input gathered before the router).

Parity runs as in ``tests/test_expert_parallel.py``: momentum SGD (an update proportional to
the gradient, so a wrong scale shows), a shared expert, a load-balancing loss weighted 0.1,
ranks seeded differently (``rank_seeds``), the router sending unequal numbers of tokens to the
experts and so unequal numbers of rows to each rank; every tensor's update and every rank's copy
of every weight compared with one process, the losses step by step.

Broken variants caught (each planted and reverted, seen failing): the expert gradients summed
over ``dp_replica`` only, leaving the context ranks out (``ep2_cp2``; qwen3_moe at ep2 x cp2,
on text and on chat rows; mixtral with its router loss at ep2 x cp2); the capacity line drawn
over half the data x context ranks (``ep2_cp2_capacity``); the ``ep`` groups crossing tensor
coordinates (``ep2_tp2_sp``: the first step's replica check stops the run, naming the
experts); the global norm summing the expert weights' squares on each rank alone
(``ep2_tp2_zero3_clip``); dropout drawn on the expert's rank (the dropout case); a host-made
tensor in the counts' all-to-all (the device-guard case); a plan naming an absent shared
expert, and Qwen3-MoE's dense-MLP entries kept for MoE layers (the plan cases).
"""

from __future__ import annotations

import pytest

from tools.harness.parity import loss_mismatches, rank_state_mismatches, update_mismatches
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks
from tools.harness.world import run_world

SEED = 1234
STEPS = 3
MOE = {
    "optimizer": "sgd",
    "lr": 0.3,
    "n_experts": 4,
    "top_k": 2,
    "shared_expert": True,
    "aux_loss_coef": 0.1,
}
LAYOUTS = {  # id -> (strategy, model changes)
    "ep2_cp2": ({"expert": 2, "context": 2, "zero_stage": 1}, {}),
    "ep2_cp2_capacity": (
        {"expert": 2, "context": 2, "zero_stage": 1},
        {"capacity_factor": 0.75},
    ),
    "ep2_cp2_zero3_alltoall": (
        {"expert": 2, "context": 2, "zero_stage": 3, "context_scheme": "alltoall"},
        {},
    ),
    "ep2_tp2": ({"expert": 2, "tensor": 2, "zero_stage": 1}, {}),
    "ep2_tp2_sp": ({"expert": 2, "tensor": 2, "sequence_parallel": True, "zero_stage": 1}, {}),
    "ep2_tp2_zero3_clip": ({"expert": 2, "tensor": 2, "zero_stage": 3}, {}),
    "ep2_cp2_tp2_sp": (
        {"expert": 2, "context": 2, "tensor": 2, "sequence_parallel": True, "zero_stage": 1},
        {},
    ),
}
CI = ("ep2_cp2", "ep2_tp2_sp")


def _one(model: dict, trainer: dict | None) -> tuple[dict, dict]:
    """Lightning's single device (the independent reference) and one process under the
    strategy (its summary records the objective's cross-entropy alike)."""
    one = fit_gpt(0, Run(arch="moe", steps=STEPS, seed=SEED, model=model, trainer=trainer))
    run = Run(arch="moe", strategy={}, steps=STEPS, seed=SEED, model=model, trainer=trainer)
    return one, run_world(fit_gpt_ranks, 1, run)[0]


# ------------------------------------------------------------------ plans, no processes
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_moe_gpt_plan_splits_attention_and_replicates_router_and_experts(shared, sequence_parallel):
    """The reference MoE GPT is recognised (it has no dense ``mlp.fc1``); every entry of its
    plan matches a module (a plan naming an absent shared expert would stop the launch); the
    router and the experts are in no entry; under sequence parallelism the MoE layer gathers its
    input and cuts its output back to the sequence shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    from lightning_3d.models.moe import LitMoEGPT
    from lightning_3d.parallel.plans import detect_plan
    from lightning_3d.parallel.tensor import resolve_plan
    from tools.harness.runs import TINY_MODEL

    module = LitMoEGPT(**{**TINY_MODEL, **MOE, "shared_expert": shared})
    arch, plan = detect_plan(module, sequence_parallel)
    assert arch == "moe_gpt"
    resolved = resolve_plan(module, plan, 2)  # require_all: every pattern matches something
    assert not any(".router" in n or ".experts" in n for n in resolved)
    assert any(n.endswith("mlp.shared.fc1") for n in resolved) == shared
    moe = plan.get("*.mlp")
    if not sequence_parallel:
        assert moe is None
        return
    assert isinstance(moe, PrepareModuleInputOutput)
    into, out = moe.prepare_module_input, moe.prepare_module_output
    assert into.input_layouts == (Shard(1),) and into.desired_input_layouts == (Replicate(),)
    assert out.output_layouts == (Replicate(),) and out.desired_output_layouts == (Shard(1),)


def test_qwen3_moe_plan_skips_the_dense_mlp_entries_of_moe_layers_only():
    """Qwen3-MoE's plan names a dense MLP's projections for the layers ``mlp_only_layers``
    keeps dense: with every layer an MoE block they match nothing and are skipped (the launch
    stopped on them before); a dense layer's are still split."""
    pytest.importorskip("transformers")
    from lightning_3d.models import HFCausalLM
    from lightning_3d.parallel.plans import build_plan
    from lightning_3d.parallel.tensor import resolve_plan
    from tools.harness.hf_configs import tiny_config

    sparse = HFCausalLM(config=tiny_config("qwen3_moe"))
    resolved = resolve_plan(sparse, build_plan(sparse, None, False), 2)
    assert not any(".mlp." in n for n in resolved)
    dense_first = HFCausalLM(config=tiny_config("qwen3_moe", mlp_only_layers=[0]))
    resolved = resolve_plan(dense_first, build_plan(dense_first, None, False), 2)
    assert {n for n in resolved if ".mlp." in n} == {
        f"model.model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")
    }


# ------------------------------------------------------------------ parity, 4 gloo ranks
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in CI else pytest.mark.slow) for n in LAYOUTS]
)
def test_moe_gpt_matches_one_process(name):
    """ep2 x cp2 and ep2 x tp2 on 4 gloo ranks (ep2 x cp2 x tp2 on 8) against one process:
    losses, every tensor's update, every rank's copy. Catches: context ranks left out of the experts' replica sum
    (their tokens' share of every expert gradient lost), a capacity line over part of the
    batch, ``ep`` groups that mix tensor coordinates, a norm that counts an expert twice
    (``_clip``: a threshold every step hits)."""
    strategy, changes = LAYOUTS[name]
    model = {**MOE, **changes}
    trainer = {"gradient_clip_val": 0.05} if name.endswith("_clip") else None
    one, one_3d = _one(model, trainer)
    run = Run(
        arch="moe",
        strategy=strategy,
        devices=8 if "cp2_tp2" in name else 4,
        steps=STEPS,
        seed=SEED,
        model=model,
        rank_seeds=True,
        trainer=trainer,
    )
    world = run_world(fit_gpt_ranks, run.devices, run)
    problems = loss_mismatches(world[0]["losses"], one_3d["losses"])
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(world, one)
    assert problems == [], "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2_cp2", "ep2_tp2_sp"])
def test_moe_gpt_with_dropout_matches_every_expert_on_every_rank(name):
    """Dropout on (embeddings, residuals, the MoE output on the token's rank): the
    layout at ``expert=2`` draws the masks that ``expert=1`` (every expert on every data rank)
    draws in the same layout, so the two agree loss for loss and weight for weight, and every
    rank's copy agrees (tensor ranks drawing different masks on their replicated MoE output
    would part their replicas)."""
    strategy, _ = LAYOUTS[name]
    runs = {}
    for expert in (1, 2):
        run = Run(
            arch="moe",
            strategy={**strategy, "expert": expert},
            devices=4,
            steps=STEPS,
            seed=SEED,
            # The context kernels run attention without dropout (refused): residuals only.
            model={**MOE, "dropout": 0.1, "attn_dropout": 0.0},
            rank_seeds=True,
        )
        runs[expert] = run_world(fit_gpt_ranks, 4, run)
    ep1, ep2 = runs[1], runs[2]
    problems = loss_mismatches(ep2[0]["losses"], ep1[0]["losses"])
    problems += update_mismatches(ep2[0]["state"], ep1[0]["state"], ep1[0]["initial_state"], 1e-4)
    problems += rank_state_mismatches(ep2, ep1[0])
    assert problems == [], "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2_cp2", "ep2_tp2_sp"])
def test_collectives_take_device_tensors_and_read_once_a_layer(name):
    """Under the device guard (``tests/test_device_faithful.py``'s): every collective of the
    composed layouts (the flattened replica group's sums, the gathered MoE input, clipping by
    the global norm) takes tensors made on the device; from the second step on lightning_3d reads
    one device value per MoE layer and forward (the all-to-all's split sizes) besides the step
    agreement's verdict, as at ep2 alone."""
    from support.guarded_runs import check_moe_reads

    strategy, _ = LAYOUTS[name]
    run = Run(
        arch="moe",
        strategy=strategy,
        devices=4,
        steps=STEPS,
        model=MOE,
        trainer={"gradient_clip_val": 0.5},
    )
    check_moe_reads(run, 4, 2)


# ------------------------------------------------------------------ Hugging Face families
HF_LAYOUTS = {
    "ep2_cp2": {"expert": 2, "context": 2, "zero_stage": 1},
    "ep2_tp2": {"expert": 2, "tensor": 2, "zero_stage": 1},
}
# deepseek_v3 x tp: its attention (multi-head latent) has no tensor plan here; gpt_oss x cp:
# its sliding windows and attention sinks are not in the context kernels (both refused before
# launch whatever the expert axis, tests/test_hf_tensor_plans.py and the context refusals).
HF_CASES = [
    ("qwen3_moe", "ep2_cp2"),
    ("qwen3_moe", "ep2_tp2"),
    ("mixtral", "ep2_cp2"),
    ("mixtral", "ep2_tp2"),
    ("deepseek_v3", "ep2_cp2"),
    ("gpt_oss", "ep2_tp2"),
]


def _hf_run(family: str, strategy: dict | None, world: int = 1) -> Run:
    from tools.harness.hf_configs import tiny_config

    return Run(
        arch="hf",
        strategy=strategy,
        devices=world,
        steps=STEPS,
        seed=SEED,
        model={"optimizer": "sgd", "lr": 0.3, "hf": tiny_config(family)},
        rank_seeds=strategy is not None,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), HF_CASES)
def test_hf_moe_matches_one_process(family, layout):
    """Tiny random ``transformers`` MoE models (experts found by ``base_model_ep_plan``) at
    ep2 x cp2 and ep2 x tp2 against one process: shared experts and a dense first layer
    (deepseek_v3), expert biases, a clamped gate and attention sinks (gpt_oss)."""
    pytest.importorskip("transformers")
    one = fit_gpt(0, _hf_run(family, None))
    world = run_world(fit_gpt_ranks, 4, _hf_run(family, HF_LAYOUTS[layout], 4))
    problems = loss_mismatches(world[0]["losses"], one["losses"], 1e-5)
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(world, one, 1e-5)
    assert problems == [], "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(HF_LAYOUTS))
def test_hf_moe_on_chat_rows_trains_the_token_mean(tmp_path, layout):
    """Chat rows (targets on the answers only): the data ranks, and the two halves of a row
    that the context ranks hold, count different numbers of target tokens, and the experts
    receive unequal numbers of rows; qwen3_moe at ep2 x cp2 and ep2 x tp2 still trains the
    token mean of the global batch as one process does."""
    pytest.importorskip("transformers")
    import dataclasses

    from support.chat_files import write_chat_files
    from tools.harness.hf_configs import tiny_config

    chat = {**write_chat_files(tmp_path), "block_size": 48, "batch_size": 8, "packing": False}
    chat["val_fraction"] = 0.2
    one_run = dataclasses.replace(_hf_run("qwen3_moe", None), data={"chat": chat})
    assert one_run.model["hf"] == tiny_config("qwen3_moe")
    one = fit_gpt(0, one_run)
    run = dataclasses.replace(_hf_run("qwen3_moe", HF_LAYOUTS[layout], 4), data={"chat": chat})
    world = run_world(fit_gpt_ranks, 4, run)
    problems = loss_mismatches(world[0]["losses"], one["losses"], 1e-5)
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(world, one, 1e-5)
    assert problems == [], "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(HF_LAYOUTS))
def test_hf_router_aux_loss_under_cp_and_tp(layout):
    """mixtral with its router's load-balancing loss in the objective (weight 0.5, so its
    gradient shows in the router): counts and probabilities over the global batch, data x
    context under ep2 x cp2, each tensor rank the whole of its data rank's tokens under ep2 x
    tp2. Losses against one process under the strategy (whose summary records the
    cross-entropy alike), updates against Lightning's single device."""
    pytest.importorskip("transformers")
    import dataclasses

    from tools.harness.hf_configs import tiny_config

    config = tiny_config("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)

    def with_aux(run: Run) -> Run:
        return dataclasses.replace(run, model={**run.model, "hf": config})

    one = fit_gpt(0, with_aux(_hf_run("mixtral", None)))
    one_3d = run_world(fit_gpt_ranks, 1, with_aux(_hf_run("mixtral", {}, 1)))[0]
    world = run_world(fit_gpt_ranks, 4, with_aux(_hf_run("mixtral", HF_LAYOUTS[layout], 4)))
    problems = loss_mismatches(world[0]["losses"], one_3d["losses"], 1e-5)
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(world, one, 1e-5)
    assert problems == [], "\n".join(problems)
