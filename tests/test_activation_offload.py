"""Activation offload: the same run as without it, and the saved bytes leave the device.

Single-process checks of the mechanism (on a CPU the "host" copy is a separate copy, counted by
the activation meter as host bytes), the option's refusals, and (slow) the Trainer with ZeRO 1,
ZeRO-3 and a pipeline on two gloo ranks against one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_3d.models.gpt import GPT, GPTConfig
from lightning_3d.options import Plan
from lightning_3d.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    is_offloaded,
    transformer_blocks,
)
from lightning_3d.parallel.activations import ActivationMeter

B, T = 2, 16


def _train(policy: str, offload: bool, steps: int = 3) -> tuple[list[float], dict, dict]:
    """Losses, final weights and the first step's meter readings of a few SGD steps of a
    4-block GPT with dropout (SGD: a scaled gradient would change the update)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_embd=32, n_head=4, n_layer=4, block_size=T, dropout=0.1))
    apply_activation_checkpointing(model, policy, offload=offload)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 256, (B, T), generator=gen) for _ in range(2))
    meter = ActivationMeter()
    meter.watch(transformer_blocks(model))
    meter.reset(model.parameters())
    losses, first = [], {}
    for step in range(steps):
        torch.manual_seed(7 + step)  # the same dropout masks in both runs
        with meter.hooks():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        if step == 0:
            first = {
                "device": dict(meter.block_bytes),
                "host": dict(meter.block_host_bytes),
                "left": (meter.live, meter.host_live),
            }
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, weights, first


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_same_losses_and_updates_as_without(policy):
    """Catches: a host copy that is not the saved tensor (stale after an in-place change, another
    tensor's at a reused address, a copy not made), or a block left on its old forward."""
    losses, weights, _ = _train(policy, offload=False)
    losses_off, weights_off, first = _train(policy, offload=True)
    assert losses_off == losses
    torch.testing.assert_close(weights_off, weights, rtol=0, atol=0)
    assert sum(first["host"].values()) > 0  # the mechanism ran


@pytest.mark.parametrize("policy", ["none", "full"])
def test_device_saved_bytes_per_block_drop_to_a_tenth(policy):
    """The meter's device bytes per block with offload <= 1/10 of without, the bytes reappear as
    host bytes, and nothing is left counted after backward. Catches: saves that bypass the hook
    (hooks outside checkpoint's, a block not wrapped) and host copies never released."""
    _, _, before = _train(policy, offload=False, steps=1)
    _, _, after = _train(policy, offload=True, steps=1)
    assert all(before["device"].values()) and not any(before["host"].values())
    for name, saved in before["device"].items():
        assert after["device"][name] <= saved / 10, (name, after["device"][name], saved)
        assert after["host"][name] >= saved, (name, after["host"][name], saved)
    assert after["left"] == (0, 0)


def test_undo_and_flag():
    model = GPT(GPTConfig(n_embd=32, n_head=4, n_layer=2, block_size=T))
    apply_activation_checkpointing(model, "none", offload=True)
    assert all(is_offloaded(b) for _, b in transformer_blocks(model))
    apply_activation_checkpointing(model, "none")
    assert "forward" not in model.blocks[0].__dict__
    assert not any(is_offloaded(b) for _, b in transformer_blocks(model))


@pytest.mark.parametrize(
    "options, match",
    [
        ({"activation_offload": "yes"}, "activation_offload='yes' must be True or False"),
        ({"activation_offload": True, "compile": True}, "activation_offload=True with compile"),
    ],
)
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        Plan.from_options(**options)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        {"zero_stage": 1, "ac_policy": "none"},
        {"zero_stage": 3, "ac_policy": "full"},
        {"pipeline": 2, "ac_policy": "full"},
    ],
)
def test_trainer_layouts_match_one_process(layout):
    """The Trainer on two gloo ranks with activation offload against one plain process (SGD):
    same losses and weights. Catches: the option not reaching the recipe's blocks, gathered
    ZeRO-3 weights or pipeline stage inputs copied wrongly."""
    from tools.harness.parity import assert_same_run
    from tools.harness.runs import Run, fit_layout

    model = {"optimizer": "sgd", "dropout": 0.0}
    reference = fit_layout(Run(steps=3, model=model), 1)
    run = fit_layout(Run(steps=3, model=model, strategy={**layout, "activation_offload": True}), 2)
    assert_same_run(run, reference)


@pytest.mark.slow
def test_memory_kit_benchmark_writes_its_rows(tmp_path, capsys):
    """``python -m tools.bench.memory_kit --quick``: both tables, and the summary's figures say
    what the rows claim (offload empties the device's bytes per block; 8-bit states are smaller)."""
    import json

    from tools.bench import memory_kit

    assert memory_kit.main(["--quick", "--out", str(tmp_path)]) == 0
    assert "| activation_offload |" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    by = {(r["ac_policy"], r["activation_offload"]): r for r in summary["activations"]}
    for policy in ("none", "full"):
        assert (
            by[policy, True]["device_bytes_per_block"]
            <= by[policy, False]["device_bytes_per_block"] / 10
        )
    ratios = {r["optimizer"]: r["state_ratio"] for r in summary["optimizers"]}
    assert ratios["adamw"] == 1 and ratios["adamw8bit"] < 0.5
