"""Hugging Face ``transformers`` models under every layout reproduce one process (gloo worlds).

Tiny random configs built here (``tools.harness.hf_configs``; no downloads): Llama with
grouped-query attention, Qwen2 with tied input embedding and LM head, GPT-2 (``Conv1D``, fused
q/k/v, tied). Each layout trains 5 fp32 steps and must give the single-process losses within
1e-5 and its weights (``assert_same_run``), and every tied weight must still be one tensor:
one ``Parameter`` on a rank that holds both of its modules, equal copies on the pipeline ranks
that hold one each.

One exception to the weight comparison: the key-projection bias (Qwen2's ``k_proj.bias``, the
key third of GPT-2's ``c_attn.bias``) has an identically zero true gradient (softmax ignores a
shift shared by all keys), so Adam turns the gradient's rounding noise into updates of ~1e-7
that differ with any change of summation order; it is compared by absolute error alone.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tools.harness.parity import loss_mismatches, weight_mismatches  # noqa: E402
from tools.harness.runs import Run, fit_gpt  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

STEPS, SEED = 5, 1234
TRAINER = {"gradient_clip_val": 0.05}  # always hit: norms must count shards and tied copies once
FAMILIES = ["llama", "qwen2", "gpt2"]
LAYOUTS = {
    "dp2_zero1": (2, {"data": 2, "zero_stage": 1}),
    "dp2_zero3": (2, {"data": 2, "zero_stage": 3}),
    "tp2": (2, {"tensor": 2}),
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}),
    "pp2": (2, {"pipeline": 2}),
    "dp2_tp2_zero3": (4, {"data": 2, "tensor": 2, "zero_stage": 3}),
}
ZERO_GRADIENT_BIASES = ("k_proj.bias",)  # see the module docstring (GPT-2's is inside c_attn.bias)


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(family, model=None, trainer=TRAINER):
        key = (family, repr(model), repr(trainer))
        if key not in cache:
            cache[key] = fit_gpt(
                0, Run(steps=STEPS, seed=SEED, model=model, trainer=trainer, arch=f"hf_{family}")
            )
        return cache[key]

    return get


def assert_matches(run: dict, ref: dict) -> None:
    problems = loss_mismatches(run["losses"], ref["losses"], rtol=1e-5)
    exact = {k: v for k, v in ref["state"].items() if not k.endswith(ZERO_GRADIENT_BIASES)}
    problems += weight_mismatches({k: run["state"][k] for k in exact if k in run["state"]}, exact)
    for name in set(ref["state"]) - set(exact):
        worst = (run["state"][name] - ref["state"][name]).abs().max().item()
        if worst > 1e-6:
            problems.append(f"{name}: max abs {worst:.2e} (max 1e-6)")
    assert not problems, "run differs from one process:\n  " + "\n  ".join(problems)


def assert_ties_hold(world: list[dict]) -> None:
    """Every rank holding both names of a tie holds one Parameter; all copies are equal."""
    per_tie: dict[int, list] = {}
    for rank in world:
        for index, tie in enumerate(rank["ties"]):
            assert tie["one_parameter"], f"tie {tie['names']} split into several parameters"
            if tie["value"] is not None:
                per_tie.setdefault(index, []).append(tie)
    for copies in per_tie.values():
        for other in copies[1:]:
            if (
                other["value"].shape == copies[0]["value"].shape
                and other["names"] != copies[0]["names"]
            ):
                torch.testing.assert_close(other["value"], copies[0]["value"], rtol=0, atol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_model_matches_single_process(reference, family, layout):
    world_size, strategy = LAYOUTS[layout]
    world = run_world(
        fit_gpt,
        world_size,
        Run(
            strategy=strategy,
            devices=world_size,
            steps=STEPS,
            seed=SEED,
            trainer=TRAINER,
            arch=f"hf_{family}",
        ),
    )
    assert_matches(world[0], reference(family))
    assert_ties_hold(world)
    # A tie counted once.
    assert world[0]["summary"]["num_params"] == reference(family)["summary"]["num_params"]
    tied = family != "llama"
    assert bool(world[0]["ties"]) == tied  # the tie is seen (and only where the config ties)


# The tie under the memory features too: activation checkpointing wraps the decoder layers
# (which take rotary embeddings as keyword arguments), offload steps the one weight on the CPU.
WITH_MEMORY_FEATURES = {
    "qwen2": (2, {"data": 2, "zero_stage": 2, "ac_policy": "full", "offload": "cpu"}),
    "gpt2": (2, {"pipeline": 2, "ac_policy": "selective"}),
}


@pytest.mark.parametrize("family", list(WITH_MEMORY_FEATURES))
def test_hf_model_with_checkpointing_and_offload_matches_single_process(reference, family):
    world_size, strategy = WITH_MEMORY_FEATURES[family]
    world = run_world(
        fit_gpt,
        world_size,
        Run(
            strategy=strategy,
            devices=world_size,
            steps=STEPS,
            seed=SEED,
            trainer=TRAINER,
            arch=f"hf_{family}",
        ),
    )
    assert_matches(world[0], reference(family))
    assert_ties_hold(world)


@pytest.mark.parametrize("zero_stage", [2, 3])  # the ZeRO engine's buffers / FSDP2's reduced shards
def test_tied_copies_on_two_stages_are_summed_and_counted_once(reference, zero_stage):
    """Pipeline with the tied weight on both stages, momentum SGD (unlike Adam, it shows a
    gradient's scale) and a clip threshold every step hits. Catches: copies not summed (each
    stage steps with half the gradient: the copies and the reference part), and the copy
    counted twice in the global norm (every step clipped too hard)."""
    model, trainer = {"optimizer": "sgd", "lr": 0.5}, {"gradient_clip_val": 0.5}
    strategy = {"pipeline": 2, "zero_stage": zero_stage}
    run = Run(
        strategy=strategy,
        devices=2,
        steps=STEPS,
        seed=SEED,
        model=model,
        trainer=trainer,
        arch="hf_qwen2",
    )
    world = run_world(fit_gpt, 2, run)
    assert_matches(world[0], reference("qwen2", model, trainer))
    assert_ties_hold(world)
    holders = [rank["ties"][0]["names"] for rank in world]
    assert holders == [["model.model.embed_tokens.weight"], ["model.lm_head.weight"]]


def test_tie_survives_a_resume(tmp_path, reference):
    """Saved under tensor=2 (one tied DTensor), resumed under pipeline=2 (one copy per stage):
    the resumed run continues the single-process run, and the tie holds after the load."""
    run_world(
        fit_gpt,
        2,
        Run(
            strategy={"tensor": 2},
            devices=2,
            steps=3,
            seed=SEED,
            trainer=TRAINER,
            arch="hf_qwen2",
            save_to=str(tmp_path / "tied.ckpt"),
            save_every_n_steps=3,
        ),
    )
    path = tmp_path / "tied-step=3.ckpt"
    world = run_world(
        fit_gpt,
        2,
        Run(
            strategy={"pipeline": 2},
            devices=2,
            steps=STEPS,
            seed=SEED,
            trainer=TRAINER,
            arch="hf_qwen2",
            resume_from=str(path),
        ),
    )
    assert_ties_hold(world)
    straight = reference("qwen2")
    assert_matches(world[0], {"losses": straight["losses"][3:], "state": straight["state"]})


def test_tied_weights_sharded_differently_are_refused(capfd):
    """A plan that splits the embedding on the vocabulary but the head on the hidden size
    cannot keep one parameter: ValueError naming both, never a silent untie."""
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.parallel.plans import plan_from_names
    from lightning_3d.parallel.tensor import resolve_plan
    from lightning_3d.parallel.tied import check_tied_styles, find_tied
    from tools.harness.hf_configs import tiny_hf_config

    module = HFCausalLM(config=tiny_hf_config("qwen2"))
    ties = find_tied(module)
    assert ties == [("model.model.embed_tokens.weight", "model.lm_head.weight")]
    good = {"*embed_tokens": "vocab", "*lm_head": "head"}
    # Both split the vocabulary.
    check_tied_styles(module, resolve_plan(module, plan_from_names(good), 2), ties)
    plan = {"*embed_tokens": "vocab", "*lm_head": "rowwise"}
    message = r"tied parameters model\.model\.embed_tokens\.weight .*model\.lm_head\.weight .*sharded differently"
    # Without processes, as the app checks before launch.
    with pytest.raises(ValueError, match=message):
        check_tied_styles(module, resolve_plan(module, plan_from_names(plan), 2), ties)
    # And by the strategy on the ranks, before any rewrite.
    with pytest.raises(RuntimeError, match=message):
        run_world(_fit_module_with_plan, 2, plan)
    # Reported as what it is (the step, the exception), not as a lost peer with resume advice.
    err = capfd.readouterr().err
    assert (
        "rank 0: setting up HFCausalLM for Layout(data=1, tensor=2, pipeline=1, zero_stage=0) failed "
        "during tensor parallelism: ValueError: tied parameters" in err
    )
    assert "a collective failed" not in err and "ckpt_path='last'" not in err


def _fit_module_with_plan(rank: int, plan: dict) -> None:
    fit_gpt(
        rank,
        Run(
            strategy={"tensor": 2, "tp_plan": plan}, devices=2, steps=1, seed=SEED, arch="hf_qwen2"
        ),
    )


def test_pipeline_times_tensor_skips_other_stages_stand_ins(reference):
    """pp2 x tp2: a stage's plan entries that match another stage's weightless stand-ins (the
    head, the embedding) are skipped rather than refused as modules the style cannot split."""
    run = Run(
        strategy={"pipeline": 2, "tensor": 2},
        devices=4,
        steps=STEPS,
        seed=SEED,
        trainer=TRAINER,
        arch="hf_llama",
    )
    assert_matches(run_world(fit_gpt, 4, run)[0], reference("llama"))
