"""Hugging Face decoder families under every layout reproduce one process (gloo worlds).

The CI set (``lightning_3d.testing.hf_configs.TINY_HF``): each family stands for something the
layouts must get right — per-head norms (Qwen3), an embedding scaled inside itself with sliding
windows and soft-capping (Gemma2), fused projections (Phi-3), full-width q/k norms (OLMo2),
experts (Mixtral), interleaved fused q/k/v and a parallel residual (GPT-NeoX), partial rotary
(Phi), a family that ships no plan (StableLM). Each layout trains 5 fp32 steps and must give
the single-process losses and every tensor's update. The whole registry: ``-m slow`` and
``python -m lightning_3d.testing.hf_matrix``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from lightning_3d.testing.parity import loss_mismatches, update_mismatches  # noqa: E402
from lightning_3d.testing.runs import Run, fit_gpt  # noqa: E402
from lightning_3d.testing.world import run_world  # noqa: E402

STEPS, SEED = 5, 1234
TRAINER = {"gradient_clip_val": 0.05}
FAMILIES = ["qwen3", "gemma2", "phi3", "olmo2", "mixtral", "gpt_neox", "phi", "stablelm"]
LAYOUTS = {
    "tp2": (2, {"tensor": 2}, None),
    "pp2_sdpa": (2, {"pipeline": 2}, "sdpa"),
    "pp2_eager": (2, {"pipeline": 2}, "eager"),
    "dp2_zero3": (2, {"data": 2, "zero_stage": 3}, None),
    "dp2_tp2": (4, {"data": 2, "tensor": 2, "zero_stage": 1}, None),
}


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(family, attn):
        if (family, attn) not in cache:
            run = Run(steps=STEPS, seed=SEED, trainer=TRAINER, arch=f"hf_{family}", model={"attn_implementation": attn})
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


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_single_process(reference, family, layout):
    world_size, strategy, attn = LAYOUTS[layout]
    if family == "gemma2" and attn == "sdpa":
        pytest.skip("transformers refuses sdpa for Gemma2")
    run = Run(strategy=strategy, devices=world_size, steps=STEPS, seed=SEED, trainer=TRAINER, arch=f"hf_{family}",
              model={"attn_implementation": attn})
    assert_matches(run_world(fit_gpt, world_size, run)[0], reference(family, attn))
