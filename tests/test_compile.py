"""``torch.compile`` per block: the same losses, gradients and names as eager, in any layout
it accepts; bad values refused before any work."""

from __future__ import annotations

import pytest
import torch

from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.options import Plan
from lightning_3d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_3d.parallel.compile import compile_blocks
from tools.harness.parity import assert_same_run
from tools.harness.runs import Run, fit_layout


def _loss_and_grads(compiled: bool, policy: str):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.0)
    )
    apply_activation_checkpointing(model, policy)
    names = list(model.state_dict())
    if compiled:
        assert compile_blocks(model, "aot_eager") == 3
    x = torch.randint(0, 64, (2, 16))
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
    loss.backward()
    return (
        loss.item(),
        {n: p.grad.clone() for n, p in model.named_parameters()},
        names,
        list(model.state_dict()),
    )


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_compiled_blocks_match_eager_and_keep_their_names(policy):
    eager_loss, eager_grads, names, _ = _loss_and_grads(False, policy)
    loss, grads, before, after = _loss_and_grads(True, policy)
    assert before == after == names  # compiling renames nothing: checkpoints and plans still apply
    assert loss == pytest.approx(eager_loss, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-6)


def test_bad_compile_options_are_refused_before_any_work():
    with pytest.raises(ValueError, match="compile_backend='nope' is not a torch.compile backend"):
        Plan.from_options(compile=True, compile_backend="nope")
    with pytest.raises(ValueError, match="compile=True with tensor=2 needs zero_stage=3"):
        Plan.from_options(compile=True, tensor=2, zero_stage=1)
    with pytest.raises(ValueError, match="compile='yes' must be True or False"):
        Plan.from_options(compile="yes")
    assert Plan.from_options(compile=True, tensor=2, zero_stage=3).compile.enabled


@pytest.mark.parametrize(
    "strategy",
    [
        {
            "data": 2,
            "zero_stage": 2,
            "ac_policy": "full",
            "compile": True,
            "compile_backend": "aot_eager",
        },
        pytest.param(
            {"data": 2, "zero_stage": 2, "ac_policy": "full", "compile": True},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"tensor": 2, "zero_stage": 3, "compile": True, "compile_backend": "aot_eager"},
            marks=pytest.mark.slow,
        ),
        pytest.param({"pipeline": 2, "zero_stage": 3, "compile": True}, marks=pytest.mark.slow),
    ],
    ids=[
        "dp2_zero2_ac_aot_eager",
        "dp2_zero2_ac_inductor",
        "tp2_zero3_aot_eager",
        "pp2_zero3_inductor",
    ],
)
def test_compiled_layouts_match_one_process(strategy):
    reference = fit_layout(Run(steps=3), 1)
    compiled = fit_layout(Run(strategy=strategy, steps=3), 2)
    assert_same_run(compiled, reference)  # losses of every step and the trained weights
    blocks = [rank.get("compiled_blocks") for rank in compiled["summary"]["ranks"]]
    # Every block this rank holds (n_layer=2).
    assert blocks == ([1, 1] if strategy.get("pipeline") else [2, 2])
