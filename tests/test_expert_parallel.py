"""Expert parallelism (``parallel/expert.py``) on the reference MoE GPT (``models/moe.py``):
layouts against one process, and the inputs refused before launch.

Parity runs use momentum SGD (an update proportional to the gradient, so a wrong scale shows),
a shared expert, a load-balancing loss weighted 0.1 (so its gradient shows in the router), and
ranks that build their model under different seeds (``rank_seeds``: the first data rank's
experts must become everyone's before each rank keeps its slice). The router sends unequal
numbers of tokens to the experts (:func:`test_router_counts_are_unequal_and_exact`). Every
tensor's update is compared with one process's (``update_mismatches``), every rank's own copy
of every weight too. Losses are compared with one process under the strategy, whose summary
records the objective's cross-entropy token mean (the plain run's records the returned loss,
the load-balancing term included).

Broken variants caught (seen failing, each planted and reverted): expert gradients reduced over
the ``ep`` group (ranks holding different experts) instead of ``dp_replica``; expert gradients
not divided by the data size; the load-balancing statistics summed with their gradient (the
one-process aux gradient doubled); dispatch without regrouping the received tokens by local
expert (all four: ``ep2_zero1``); dropout drawn inside the experts, on the expert's rank (the
dropout case); the experts' optimizer state left out of a ZeRO-1 checkpoint (the checkpoint
case); the counts read to the host twice per layer (the device case); the app's launcher not
checking the model at ``expert`` > 1 (the dense-model case: the ranks started and failed).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tools.harness.parity import (
    loss_mismatches,
    rank_state_mismatches,
    update_mismatches,
)
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


@pytest.fixture(scope="module")
def runs():
    cache: dict = {}

    def get(name: str, stage: int = 1, world: int = 2, dropout: float = 0.0, clip=None):
        key = (name, stage, world, dropout, clip)
        if key in cache:
            return cache[key]
        model = {**MOE, "dropout": dropout}
        trainer = None if clip is None else {"gradient_clip_val": clip}
        if name == "one":  # Lightning's own single device: the independent reference
            run = Run(arch="moe", steps=STEPS, seed=SEED, model=model, trainer=trainer)
            cache[key] = fit_gpt(0, run)
        elif name == "one_3d":  # one process under the strategy: losses recorded alike
            run = Run(arch="moe", strategy={}, steps=STEPS, seed=SEED, model=model, trainer=trainer)
            cache[key] = run_world(fit_gpt_ranks, 1, run)[0]  # its own process group
        else:
            expert = {"ep1": 1, "ep2": 2}[name]
            run = Run(
                arch="moe",
                strategy={"expert": expert, "zero_stage": stage},
                devices=world,
                steps=STEPS,
                seed=SEED,
                model=model,
                rank_seeds=True,
                trainer=trainer,
            )
            cache[key] = run_world(fit_gpt_ranks, world, run)
        return cache[key]

    return get


def _assert_matches_one_process(world: list, one: dict, one_3d: dict) -> None:
    problems = loss_mismatches(world[0]["losses"], one_3d["losses"])
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(world, one)
    assert problems == [], "\n".join(problems)


LAYOUTS = [
    pytest.param(1, 2, None, id="ep2_zero1"),
    pytest.param(2, 2, None, id="ep2_zero2", marks=pytest.mark.slow),
    pytest.param(3, 2, None, id="ep2_zero3", marks=pytest.mark.slow),
    pytest.param(1, 4, None, id="ep2_dp2_zero1", marks=pytest.mark.slow),
    pytest.param(3, 4, None, id="ep2_dp2_zero3", marks=pytest.mark.slow),
    pytest.param(1, 4, 0.05, id="ep2_dp2_zero1_clip", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("stage", "world", "clip"), LAYOUTS)
def test_expert_parallel_matches_one_process(runs, stage, world, clip):
    """ep=2 (each rank half the experts) on 2 ranks, and ep=2 x dp/ep=2 on 4 (two ranks per
    expert), under ZeRO-1 (the flat-bucket engine with the experts set aside) and ZeRO-3 (FSDP2
    ignoring them); once with a clipping threshold every step hits (the global norm counts each
    expert once). Catches: expert gradients reduced over the wrong group or not divided by the
    data size, a wrong all-to-all route, a per-rank load-balancing loss."""
    one, one_3d = runs("one", clip=clip), runs("one_3d", clip=clip)
    _assert_matches_one_process(runs("ep2", stage, world, clip=clip), one, one_3d)


@pytest.mark.slow
def test_expert_parallel_with_dropout_matches_every_expert_on_every_rank(runs):
    """Dropout on (embeddings, attention, residuals, the MoE output on the token's own rank):
    ep=2 draws the masks that ep=1 (every expert on both data ranks) draws, so the two runs
    agree loss for loss and weight for weight."""
    ep1, ep2 = runs("ep1", dropout=0.1), runs("ep2", dropout=0.1)
    problems = loss_mismatches(ep2[0]["losses"], ep1[0]["losses"])
    problems += update_mismatches(ep2[0]["state"], ep1[0]["state"], ep1[0]["initial_state"], 1e-4)
    problems += rank_state_mismatches(ep2, ep1[0])
    assert problems == [], "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_saved_at_ep2_resumes_at_ep1_exactly(tmp_path, stage):
    """A consolidated checkpoint written at ep=2 after 2 steps holds every expert whole (and
    its momentum); resumed at ep=1 (every expert on both data ranks) for 2 more steps it
    gives the uninterrupted ep=2 run's losses and weights. Catches (ZeRO-1): the experts'
    optimizer state left out of the checkpoint (they are in no ZeRO bucket)."""
    from tools.harness.parity import weight_mismatches
    from tools.harness.runs import fit_gpt

    def fit(expert, steps, **kwargs):
        strategy = {"expert": expert, "zero_stage": stage}
        run = Run(arch="moe", strategy=strategy, devices=2, steps=steps, seed=SEED, model=MOE)
        return run_world(fit_gpt, 2, dataclasses.replace(run, **kwargs))[0]

    straight = fit(2, 4)
    first = fit(2, 2, save_to=str(tmp_path / "run.ckpt"), save_every_n_steps=1)
    second = fit(1, 4, resume_from=str(tmp_path / "run-step=2.ckpt"))
    problems = loss_mismatches(first["losses"] + second["losses"], straight["losses"])
    problems += weight_mismatches(second["state"], straight["state"], 1e-5, 1e-6)
    assert problems == [], "\n".join(problems)
    saved = torch.load(tmp_path / "run-step=2.ckpt", weights_only=False)
    assert saved["state_dict"]["model.blocks.0.mlp.experts.w_in"].shape == (4, 32, 128)
    assert len(saved["optimizer_states"][0]["state"]) == len(saved["state_dict"])


def test_router_counts_are_unequal_and_exact():
    """The parity runs' router sends unequal numbers of tokens to the experts (so a route that
    assumes equal splits fails them), every token to ``top_k`` of them, and the load-balancing
    loss is at least 1 (``E * sum f_e P_e``, equal to 1 when perfectly balanced) and finite."""
    from lightning_3d.models.moe import LitMoEGPT
    from tools.harness.runs import TINY_MODEL

    torch.manual_seed(SEED)
    module = LitMoEGPT(**{**TINY_MODEL, **MOE})
    idx = torch.randint(0, 256, (8, 32))
    module(idx)
    counts = module.model.tokens_per_expert()  # (layers, E)
    assert counts.shape == (2, 4)
    assert torch.equal(counts.sum(-1), torch.full((2,), 8 * 32 * 2.0))
    assert all(len(set(row.tolist())) > 1 for row in counts)
    aux = module.model.aux_loss()
    assert torch.isfinite(aux) and aux.item() >= 1.0 - 1e-6


def test_dropless_experts_match_a_dense_loop():
    """One MoE layer against a plain loop over tokens: each token's output is the weighted sum
    of its top-k experts' MLPs (weights renormalised over the k), plus the shared expert."""
    import torch.nn.functional as F

    from lightning_3d.models.moe import MoE, MoEConfig

    torch.manual_seed(0)
    config = MoEConfig(n_embd=16, n_head=2, mlp_ratio=2, n_experts=4, top_k=2, shared_expert=True)
    layer = MoE(config).to_empty(device="cpu")
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5, 16)
    got = layer(x).reshape(-1, 16)
    tokens = x.reshape(-1, 16)
    probs = layer.router(tokens).softmax(-1)
    w_in, w_out = layer.experts.w_in, layer.experts.w_out
    for n, token in enumerate(tokens):
        top = probs[n].topk(2)
        weights = top.values / top.values.sum()
        want = sum(w * (F.gelu(token @ w_in[e]) @ w_out[e]) for w, e in zip(weights, top.indices))
        want = want + layer.shared(token)
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ refused before launch
def test_layout_refuses_an_expert_axis_that_does_not_fit():
    from lightning_3d.layout import Layout

    with pytest.raises(ValueError, match=r"expert=3 does not divide data=4"):
        Layout(expert=3).resolve(world_size=4)
    with pytest.raises(ValueError, match=r"expert=2 does not divide data=1"):
        Layout(expert=2, tensor=2).resolve(world_size=2)  # the data axis it is carved from
    assert Layout(expert=2, tensor=2, context=2).resolve(world_size=8).data == 2
    with pytest.raises(ValueError, match=r"expert=0 must be a positive integer"):
        Layout(expert=0)
    assert Layout(expert=2).resolve(world_size=4).data == 4


def test_model_check_refuses_experts_it_cannot_split():
    from lightning_3d.models import LitGPT
    from lightning_3d.models.moe import LitMoEGPT, MoEConfig
    from lightning_3d.options import Plan
    from lightning_3d.options.model_check import check
    from tools.harness.runs import TINY_MODEL

    with torch.device("meta"):
        dense = LitGPT(**TINY_MODEL)
        three = LitMoEGPT(**TINY_MODEL, n_experts=3)
    plan = Plan().updated(expert=2)
    with pytest.raises(ValueError, match=r"expert=2 needs a mixture-of-experts model; LitGPT"):
        check(dense, plan, world_size=2)
    with pytest.raises(ValueError, match=r"expert=2 does not divide n_experts=3"):
        check(three, plan, world_size=2)
    with pytest.raises(ValueError, match=r"top_k=5 must be in 1..n_experts=4"):
        MoEConfig(n_experts=4, top_k=5)


def test_plan_refuses_what_expert_parallelism_does_not_combine_with_yet():
    from lightning_3d.options import Plan

    with pytest.raises(ValueError, match=r"expert=2 with offload='cpu' / offload_params=False"):
        Plan().updated(expert=2, offload="cpu")
    Plan().updated(expert=2, auto=True)  # the planner's search keeps that expert size
    for other in ("tensor", "context"):  # composes (tests/test_expert_parallel_tp_cp.py)
        Plan().updated(expert=2, **{other: 2})
    Plan().updated(expert=2, pipeline=2)  # composes (tests/test_expert_parallel_pp.py)


APP_CASES = {  # id -> (overrides, the one error line)
    "expert_not_dividing_n_experts": (
        ["model=moe_tiny", "parallelism=ep2", "model.n_experts=3"],
        "error: expert=2 does not divide n_experts=3",
    ),
    "expert_axis_on_a_dense_model": (
        ["parallelism=ep2"],
        "error: expert=2 needs a mixture-of-experts model; LitGPT has no MoE layer",
    ),
    "top_k_above_n_experts": (
        ["model=moe_tiny", "model.top_k=5"],
        "error: model (lightning_3d.models.moe.LitMoEGPT): ValueError: "
        "top_k=5 must be in 1..n_experts=4",
    ),
    "expert_not_dividing_data": (
        ["model=moe_tiny", "parallelism.expert=4"],
        "error: expert=4 does not divide data=2",
    ),
    "expert_with_tensor_leaving_one_data_rank": (
        ["model=moe_tiny", "parallelism.expert=2", "parallelism.tensor=2"],
        "error: expert=2 does not divide data=1",
    ),
}


CI_APP_CASES = ("expert_axis_on_a_dense_model",)  # the rest with -m slow (an app start each)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=() if c in CI_APP_CASES else pytest.mark.slow) for c in APP_CASES],
)
def test_app_refuses_before_launch_with_one_error_line(case, tmp_path):
    """The app's launcher refuses each bad expert setting with one ``error:`` line naming the
    values, exit code 2, before any rank starts (no run directory kept)."""
    from pathlib import Path

    from tools.harness.apps import start_app, wait_all

    repo = Path(__file__).resolve().parents[1]
    overrides = [*APP_CASES[case][0], "trainer.devices=2", "trainer.max_steps=1"]
    started = start_app(
        repo / "examples" / "train.py", [*overrides, f"hydra.run.dir={tmp_path / case}"], repo
    )
    proc = wait_all({case: started}, timeout=600)[case]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    described = f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2 and len(errors) == 1, described
    assert errors[0].startswith(APP_CASES[case][1]), errors[0]
    assert not (tmp_path / case).exists()


# ------------------------------------------------------------------ what a GPU would run
@pytest.mark.parametrize(
    "stage", [1, pytest.param(3, marks=pytest.mark.slow)], ids=["zero1", "zero3"]
)
def test_expert_parallel_collectives_take_device_tensors_and_read_once_a_layer(stage):
    """Under the device guard (``tests/test_device_faithful.py``'s): every collective of an ep2
    run, clipping by the global norm included, takes tensors made on the device; from the second
    step on, lightning_3d reads one device value per MoE layer and forward (the all-to-all's
    split sizes) besides the step agreement's verdict."""
    from support.guarded_runs import check_moe_reads

    steps = 3
    run = Run(
        arch="moe",
        strategy={"expert": 2, "zero_stage": stage},
        devices=2,
        steps=steps,
        model=MOE,
        trainer={"gradient_clip_val": 0.5},
    )
    check_moe_reads(run, 2, 2)
