"""Hugging Face decoder families under every layout reproduce one process (gloo worlds).

The CI set (``tools.harness.hf_configs.TINY_HF``): each family stands for something the
layouts must get right — per-head norms (Qwen3), an embedding scaled inside itself with sliding
windows and soft-capping (Gemma2), fused projections (Phi-3), full-width q/k norms (OLMo2),
experts (Mixtral), interleaved fused q/k/v and a parallel residual (GPT-NeoX), partial rotary
(Phi), a family that ships no plan (StableLM). Each layout trains 5 fp32 steps and must give
the single-process losses and every tensor's update; ``cp2`` (context parallelism) runs in CI
for Qwen3 and Phi, the rest under ``-m slow``. Packed chat rows: each conversation of a packed row
gives its logits alone, or packing is refused; one family per kind of token mixer that cannot
honour packing or context parallelism (linear-attention hybrid, Mamba, gpt-oss) is refused,
naming the layer. The whole registry: ``-m slow`` and ``python -m tools.harness.hf_matrix``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tools.harness.hf_matrix import LAYOUTS  # noqa: E402  (the whole matrix's layouts)
from tools.harness.parity import loss_mismatches, update_mismatches  # noqa: E402
from tools.harness.runs import Run, fit_gpt  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

STEPS, SEED = 5, 1234
TRAINER = {"gradient_clip_val": 0.05}
FAMILIES = ["qwen3", "gemma2", "phi3", "olmo2", "mixtral", "gpt_neox", "phi", "stablelm"]


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(family, attn):
        if (family, attn) not in cache:
            run = Run(
                steps=STEPS,
                seed=SEED,
                trainer=TRAINER,
                arch=f"hf_{family}",
                model={"attn_implementation": attn},
            )
            cache[family, attn] = fit_gpt(0, run)
        return cache[family, attn]

    return get


def assert_matches(run: dict, ref: dict) -> None:
    """Losses within 1e-5 and every tensor's 5-step update within 1e-3 relative (a missing
    reduction or an untranslated split moves an update by O(1); the layouts' other summation
    orders move the weights of these tiny models by up to ~5e-5 relative)."""
    problems = loss_mismatches(run["losses"], ref["losses"], rtol=1e-5)
    problems += update_mismatches(run["state"], ref["state"], ref["initial_state"], rtol=1e-3)
    assert not problems, "run differs from one process:\n  " + "\n  ".join(problems)


# Layouts a family cannot run as one process would, refused before any process starts.
REFUSED = {
    (
        "olmo2",
        "tp2_sp",
    ): r"Olmo2ForCausalLM: sequence_parallel=True .* model.model.layers.0.self_attn "
    r"\(Olmo2Attention\) would see a shard of the sequence",
    (
        "mixtral",
        "tp2_sp",
    ): r"MixtralForCausalLM: sequence_parallel=True .* model.model.layers.0.mlp "
    r"\(MixtralSparseMoeBlock\) would see a shard of the sequence",
    ("gemma2", "cp2"): r"context parallelism \(parallelism.context\): Gemma2ForCausalLM: "
    r"sliding-window attention \(sliding_window=8\), which the context kernels do not compute",
}


# Context parallelism's two-process runs in CI for two families (per-head norms, partial
# rotary); the others with -m slow. Its refusals (Gemma2's windows) are checks on meta: always.
CONTEXT_IN_CI = ("qwen3", "phi", "gemma2")


def _cases():
    for layout in LAYOUTS:
        for family in FAMILIES:
            slow = layout == "cp2" and family not in CONTEXT_IN_CI
            marks = [pytest.mark.slow] if slow else []
            yield pytest.param(family, layout, marks=marks, id=f"{family}-{layout}")


@pytest.mark.parametrize("family, layout", list(_cases()))
def test_family_matches_single_process(reference, family, layout):
    world_size, strategy, attn = LAYOUTS[layout]
    if family == "gemma2" and attn == "sdpa":
        pytest.skip("transformers refuses sdpa for Gemma2")
    if (family, layout) in REFUSED:
        import torch

        from lightning_3d.models.hf import HFCausalLM
        from lightning_3d.options import Plan
        from lightning_3d.options.model_check import check
        from tools.harness.hf_configs import tiny_hf_config

        with torch.device("meta"):  # as the app's launcher checks it
            module = HFCausalLM(config=tiny_hf_config(family))
        with pytest.raises(ValueError, match=REFUSED[family, layout]):
            check(module, Plan.from_options(**strategy), world_size)
        return
    run = Run(
        strategy=strategy,
        devices=world_size,
        steps=STEPS,
        seed=SEED,
        trainer=TRAINER,
        arch=f"hf_{family}",
        model={"attn_implementation": attn},
    )
    assert_matches(run_world(fit_gpt, world_size, run)[0], reference(family, attn))


SAVES = {"consolidated": {}, "sharded": {"checkpoint_format": "sharded"}}


@pytest.mark.parametrize("fmt", list(SAVES))
@pytest.mark.parametrize(
    "family, strategy",
    [
        ("qwen2", {"pipeline": 2}),
        ("gemma2", {"pipeline": 2}),
        ("qwen3", {"tensor": 2}),
        ("mixtral", {"data": 2, "zero_stage": 3}),
    ],
)
def test_saved_and_resumed_family_continues_the_single_process_run(
    tmp_path, reference, family, strategy, fmt
):
    """Saved after 3 steps in the layout, in each checkpoint format, and resumed there: the
    resumed steps and the final weights are the single-process run's. Catches: the tied weight's
    optimizer state merged from both stages (its two equal entries sorted: a crash at the first
    save), a sharded save that loses a stage's copy of a tie (a different model after resuming)."""
    attn = "eager" if family == "gemma2" else None
    model = {"attn_implementation": attn}
    layout = {**strategy, **SAVES[fmt]}
    common = dict(
        strategy=layout, devices=2, seed=SEED, trainer=TRAINER, arch=f"hf_{family}", model=model
    )
    run_world(
        fit_gpt, 2, Run(steps=3, save_to=str(tmp_path / "run.ckpt"), save_every_n_steps=3, **common)
    )
    resumed = run_world(
        fit_gpt, 2, Run(steps=STEPS, resume_from=str(tmp_path / "run-step=3.ckpt"), **common)
    )[0]
    straight = reference(family, attn)
    assert_matches(resumed, {**straight, "losses": straight["losses"][3:]})


@pytest.mark.parametrize(
    "family, dropout, strategy",
    [
        # Dropout on the replicated residual stream draws, on every tensor rank, the mask one
        # process draws (same seed, same shapes, same order); attention dropout (local heads) is off.
        ("gpt2", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}, {"tensor": 2}),
        ("phi", {"resid_pdrop": 0.1, "embd_pdrop": 0.1}, {"tensor": 2}),
        # A pipeline's stages draw from their own streams, so masks cannot match one process's;
        # p=1 on the first stage's embedding dropout is deterministic and still must be applied.
        ("gpt2", {"embd_pdrop": 1.0}, {"pipeline": 2}),
    ],
)
def test_dropout_on_matches_single_process(family, dropout, strategy):
    """Dropout on, ranks seeded alike (as every Lightning run seeds them). Catches: a model
    trained in eval mode (transformers' from_pretrained default; here the reference trains with
    dropout and the layout without, or the other way), a stage that skips the model's dropout."""
    model = {"hf": dropout}
    # One process under the strategy too: like every multi-process strategy it re-seeds each rank
    # when the processes start, after the model's init drew from the stream (Lightning's own
    # single-device run does not), so the masks start from the same state.
    one = dict(strategy={}, devices=1, steps=STEPS, seed=SEED, trainer=TRAINER, arch=f"hf_{family}")
    # In a child process each: the strategy's process group of one must not outlive the run here.
    ref = run_world(fit_gpt, 1, Run(**one, model=model))[0]
    plain = run_world(fit_gpt, 1, Run(**one))[0]
    assert ref["losses"] != plain["losses"]  # the dropout is on in the reference
    run = Run(
        strategy=strategy,
        devices=2,
        steps=STEPS,
        seed=SEED,
        trainer=TRAINER,
        arch=f"hf_{family}",
        model=model,
    )
    assert_matches(run_world(fit_gpt, 2, run)[0], ref)


# Token mixers that cannot keep packed conversations apart or run on a rank's chunks of the
# sequence, one family per kind: refused before any process starts, naming the layer class.
PACKING_REFUSED = {
    # linear-attention hybrid: gated delta nets between attention layers
    "qwen3_5_text": r"Qwen3_5ForCausalLM: layers 0, 2 mix tokens in Qwen3_5GatedDeltaNet "
    r"\(layer type 'linear_attention'\)",
    # state-space model: every layer a Mamba mixer
    "mamba": r"MambaForCausalLM: layers 0-3 mix tokens in MambaMixer",
    # attention through the interface, but a mask built without the packed position_ids
    "gpt_oss": r"GptOssForCausalLM: in a packed row the second conversation's logits differ",
}
CONTEXT_REFUSED = {
    "qwen3_5_text": r"context parallelism \(parallelism.context\): Qwen3_5ForCausalLM: layers "
    r"0, 2 mix tokens in Qwen3_5GatedDeltaNet",
    "mamba": r"context parallelism \(parallelism.context\): MambaForCausalLM: .* MambaMixer",
    "gpt_oss": r"context parallelism \(parallelism.context\): GptOssForCausalLM: attention "
    r"sinks \(GptOssAttention.sinks",
}


def _on_meta(family):
    import torch

    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_config

    with torch.device("meta"):  # as the app's launcher checks it
        return HFCausalLM(config=tiny_config(family))


@pytest.mark.parametrize("family", [*FAMILIES, "llama", "qwen2", "gpt2", *PACKING_REFUSED])
def test_packed_conversations_match_each_alone_or_packing_is_refused(family):
    """Each conversation of a packed row (positions restarting at 0, as ``data=chat`` packs)
    against the same conversation alone, one process: within 1e-5, or ``data.packing=true``
    refused naming the layer, and the refused family really leaks (so the refusal is not for
    nothing). Catches: a linear-attention or Mamba layer carrying one conversation's state into
    the next (Qwen3.5 ~0.1, Mamba ~1), a family whose mask ignores the positions (gpt-oss ~0.2)."""
    from lightning_3d.data.chat import ChatDataModule
    from tools.harness.hf_configs import tiny_config
    from tools.harness.hf_matrix import packed_leak

    leak = packed_leak(tiny_config(family))
    if family in PACKING_REFUSED:
        with pytest.raises(ValueError, match=PACKING_REFUSED[family]) as err:
            ChatDataModule.check_model(_on_meta(family), packing=True)
        assert "data.packing=true" in str(err.value) and "data.packing=false" in str(err.value)
        assert leak > 1e-2
        return
    ChatDataModule.check_model(_on_meta(family), packing=True)
    assert leak < 1e-5


@pytest.mark.parametrize("family", list(CONTEXT_REFUSED))
def test_token_mixers_context_parallelism_cannot_route_are_refused(family):
    """``parallelism.context=2`` on a linear-attention hybrid, a Mamba model and gpt-oss (sinks,
    windows): refused on the ``meta`` model, naming the layer class and the option. (Before,
    Qwen3.5 and Mamba passed the check and trained their recurrences on each rank's chunks as if
    they were contiguous.)"""
    from lightning_3d.options import Plan
    from lightning_3d.options.model_check import check

    with pytest.raises(ValueError, match=CONTEXT_REFUSED[family]):
        check(_on_meta(family), Plan.from_options(context=2), 2)
