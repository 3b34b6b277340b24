"""What Hugging Face mixture-of-experts families train besides the cross-entropy
(``models/hf_moe.py``): the router load-balancing loss (transformers' own value on one process,
the global batch's under data and expert parallelism, the config's choice by default), the
expert loads, and the aux-loss-free balancing bias; bad values refused.

Parity runs compare every tensor's update and every rank's copy with one process (momentum SGD:
an update proportional to the gradient, so a router gradient off by a rank's share shows), not
the logged losses: under ``ThreeDStrategy`` those are the cross-entropy's token mean, one
process's Lightning loss holds the router term too.

Broken variants caught (each planted and reverted, seen failing): each rank's own router loss
(``batch_sum`` without its all-reduce: the data-parallel parity fails); the probability share
not multiplied by the group size (the same); the padding mask ignored (the transformers value
fails); the loads not summed over the data ranks (the bias parity fails); the bias moved the
wrong way (the same).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tools.harness.parity import rank_state_mismatches, update_mismatches  # noqa: E402
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

SWITCH_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "granitemoe", "qwen2_moe"]
ON = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


def _module(family: str, coef=None, **hf):
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_config

    return HFCausalLM(config=tiny_config(family, **hf), router_aux_loss_coef=coef)


@pytest.mark.parametrize("family", SWITCH_FAMILIES)
def test_one_process_value_is_transformers_own(family):
    """Outside a strategy the loss is ``router_aux_loss_coef * aux_loss`` as the family's forward
    computes it, padding left out by the attention mask."""
    from lightning_3d.models.hf_moe import global_router_loss

    torch.manual_seed(0)
    module = _module(family, **ON)
    vocab = module.model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    out = module.model(input_ids=ids, attention_mask=mask, output_router_logits=True, labels=ids)
    ours = global_router_loss(out.router_logits, module.router_loss, mask)
    torch.testing.assert_close(ours, 0.5 * out.aux_loss.float(), rtol=1e-6, atol=0)


def test_the_config_decides_by_default_and_zero_turns_it_off():
    assert _module("mixtral").router_loss is None  # output_router_logits off: none, as HF
    on = _module("mixtral", **ON).router_loss
    assert on is not None and on.coef == 0.5 and on.top_k == 2
    assert _module("mixtral", 0.0, **ON).router_loss is None
    assert _module("mixtral", 0.1).router_loss.coef == 0.1  # given here, config off
    assert _module("deepseek_v3", **ON).router_loss is None  # bias-balanced: no Switch loss


@pytest.mark.parametrize(
    ("family", "coef", "why"),
    [
        ("llama", 0.5, r"LlamaForCausalLM has no router load-balancing loss"),
        ("mixtral", -1.0, r"router_aux_loss_coef=-1.0 must be a number >= 0"),
        ("mixtral", "high", r"router_aux_loss_coef='high' must be a number >= 0"),
    ],
)
def test_bad_values_are_refused_on_construction(family, coef, why):
    with pytest.raises(ValueError, match=why):
        _module(family, coef)


def test_a_pipeline_carries_the_router_loss_only_where_it_is_on():
    """With the loss on, every stage but the last returns its router sums beside its hidden
    states (``models/hf_pipeline_router.py``); off, the pipeline's stages as before."""
    from lightning_3d.models.hf_pipeline import run_in_turn, stages_in_one_process

    torch.manual_seed(0)
    module = _module("mixtral", **ON)
    ids = torch.randint(0, module.model.config.vocab_size, (2, 8))
    stages = stages_in_one_process(module, 2)
    first = stages[0](ids)
    assert isinstance(first, tuple) and first[1].shape == (3 * 4 + 1,)  # 3E + 1, E = 4
    torch.testing.assert_close(run_in_turn(stages, ids), module(ids))
    off = stages_in_one_process(_module("mixtral", 0.0, **ON), 2)
    assert isinstance(off[0](ids), torch.Tensor)


def _run(strategy: dict | None, world: int = 1, family: str = "mixtral", **model) -> Run:
    from tools.harness.hf_configs import tiny_config

    hf = tiny_config(family, **ON) if family == "mixtral" else tiny_config(family)
    return Run(
        arch="hf",
        strategy=strategy,
        devices=world,
        steps=3,
        seed=1234,
        model={"optimizer": "sgd", "lr": 0.3, "hf": hf, **model},
        rank_seeds=strategy is not None,
    )


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"zero_stage": 1}, id="dp2", marks=pytest.mark.slow),
        pytest.param({"expert": 2, "zero_stage": 1}, id="ep2"),
    ],
)
def test_two_ranks_train_the_global_batchs_router_loss(layout):
    """dp2 and ep2 on 2 ranks, each with half the batch, against one process on all of it:
    every tensor's update (the router's too) and every rank's copy."""
    one = fit_gpt(0, _run(None))
    ranks = run_world(fit_gpt_ranks, 2, _run(layout, 2))
    problems = update_mismatches(ranks[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(ranks, one, 1e-5)
    assert problems == [], "\n".join(problems)


# ------------------------------------------------------------------ loads and the bias
def test_loads_are_the_routers_choices():
    """The experts modules' counted slots equal what the router chose (its own output,
    read by a hook on the router), layer by layer; a recomputed forward does not add."""
    torch.manual_seed(0)
    module = _module("qwen3_moe")
    module.train()
    chosen = []
    for layer in module.model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
    ids = torch.randint(0, module.model.config.vocab_size, (2, 12))
    module.model(input_ids=ids)
    module.model(input_ids=ids)  # a recomputation overwrites
    counts = module.expert_loads.take()
    E = module.model.config.num_experts
    half = len(chosen) // 2
    expected = torch.stack([torch.bincount(c.flatten(), minlength=E) for c in chosen[half:]])
    torch.testing.assert_close(counts, expected.float())
    assert module.expert_loads.take() is None  # taken: nothing until the next forward


@pytest.mark.parametrize(
    ("family", "rate", "why"),
    [
        ("qwen3_moe", 1e-3, r"router_bias_update_rate=0.001: Qwen3MoeForCausalLM has no router"),
        ("llama", 1e-3, r"router_bias_update_rate=0.001: LlamaForCausalLM has no router"),
        ("deepseek_v3", -1, r"router_bias_update_rate=-1 must be a number >= 0"),
    ],
)
def test_a_bias_rate_the_model_cannot_take_is_refused(family, rate, why):
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_config

    with pytest.raises(ValueError, match=why):
        HFCausalLM(config=tiny_config(family), router_bias_update_rate=rate)
    if rate > 0 and family == "deepseek_v3":
        return
    module = HFCausalLM(config=tiny_config("deepseek_v3"), router_bias_update_rate=1e-3)
    with pytest.raises(ValueError, match=r"router_bias_update_rate=0.001 with a pipeline"):
        module.pipeline_spec()


def _biases(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.endswith("e_score_correction_bias")}


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"zero_stage": 1}, id="dp2"),
        pytest.param({"expert": 2, "zero_stage": 1}, id="ep2", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_move_the_bias_by_the_global_loads(layout):
    """deepseek_v3 with ``router_bias_update_rate`` on 2 data ranks against one process: every
    tensor's update, the bias buffers included (moved, not left at zero), and the step's
    loads in ``summary.json``."""
    model = {"router_bias_update_rate": 0.05}
    one = fit_gpt(0, _run(None, family="deepseek_v3", **model))
    ranks = run_world(fit_gpt_ranks, 2, _run(layout, 2, "deepseek_v3", **model))
    moved = _biases(one["state"])
    assert moved and all(b.abs().max() > 0 for b in moved.values())
    problems = update_mismatches(ranks[0]["state"], one["state"], one["initial_state"], 2e-4)
    problems += [
        f"{k}: {v.tolist()} vs {moved[k].tolist()}"
        for k, v in _biases(ranks[0]["state"]).items()
        if not torch.equal(v, moved[k])
    ]
    assert problems == [], "\n".join(problems)
    figures = ranks[0]["summary"]["step_figures"]
    assert figures["tokens_per_expert"] == one["summary"]["step_figures"]["tokens_per_expert"]
    # The direction: each step moves an expert below its layer's mean load up, above it down.
    loads = torch.tensor(figures["tokens_per_expert"])  # (steps, layers, experts)
    expected = 0.05 * torch.sign(loads.mean(-1, keepdim=True) - loads).sum(0)
    got = torch.stack([moved[k] for k in sorted(moved, key=lambda k: int(k.split(".")[3]))])
    torch.testing.assert_close(got, expected)
