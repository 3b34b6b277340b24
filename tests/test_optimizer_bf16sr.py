"""``optimizer="adamw_bf16sr"``: torchao's AdamW on bf16 parameters with bf16 moments and
stochastic rounding (no fp32 master): it trains, its rounding is stochastic, the planner counts
its 4 bytes a parameter, and it is refused where the parameters it steps are not bf16.

Eager (``torch.compiler.set_stance("force_eager")``), as tests/test_low_bit_optim.py: torchao's
step is a compiled function, the same arithmetic op by op.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_3d.parallel.optimizers import (
    build_optimizer,
    optimizer_problems,
    state_bytes_by_dtype,
)

pytest.importorskip("torchao")


@pytest.fixture
def eager():
    with torch.compiler.set_stance("force_eager"):
        yield


def _groups(module: nn.Module) -> list[dict]:
    return [{"params": list(module.parameters()), "weight_decay": 0.0}]


def test_it_trains_bf16_parameters(eager):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(torch.bfloat16)
    x, y = torch.randn(32, 64, dtype=torch.bfloat16), torch.randint(0, 8, (32,))
    optimizer = build_optimizer("adamw_bf16sr", _groups(model), 1e-2, (0.9, 0.95))
    losses = []
    for _ in range(20):
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # the moments are bf16 (2 x 2 bytes a parameter); fp32 only for each tensor's step count
    count = sum(p.numel() for p in model.parameters())
    assert state_bytes_by_dtype(optimizer) == {"bfloat16": 4 * count, "float32": 4 * 4}


def test_updates_below_half_a_bf16_step_still_move_the_weights(eager):
    """Catches: rounding to nearest (``bf16_stochastic_round`` off), which drops every update
    smaller than half the spacing of bf16 values: just below 1.0 that spacing is 2^-8, so Adam's
    first step of 1e-3 leaves a plain bf16 AdamW's weights of 1.0 exactly where they were, while
    stochastic rounding moves about 1e-3 / 2^-8 = 26 % of them one step down, 1e-3 on average."""
    lr, n = 1e-3, 100_000
    moved = {}
    for name in ("adamw", "adamw_bf16sr"):
        torch.manual_seed(0)
        weight = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
        weight.grad = torch.ones(n, dtype=torch.bfloat16)  # Adam's first step: -lr everywhere
        optimizer = build_optimizer(
            name, [{"params": [weight], "weight_decay": 0.0}], lr, (0.9, 0.95)
        )
        optimizer.step()
        moved[name] = 1.0 - weight.detach().float()
    assert moved["adamw"].abs().max() == 0  # rounded to nearest: nothing moved
    sr = moved["adamw_bf16sr"]
    assert 0.21 < (sr != 0).float().mean() < 0.31
    assert sr.mean().item() == pytest.approx(lr, rel=0.1)  # unbiased: -lr on average


def test_the_planner_counts_its_state_bytes(eager):
    """The planner's optimizer bytes for ``adamw_bf16sr`` at ``bf16-true`` (bf16 moments, no fp32
    master) against the bytes a LitGPT's optimizer holds after a step."""
    from lightning_3d.models import LitGPT
    from lightning_3d.planner.choice import Choice, PlannerOptions
    from lightning_3d.planner.facts import model_facts
    from lightning_3d.planner.memory import rank_memory

    shape = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = LitGPT(**shape).to(torch.bfloat16)
    optimizer = build_optimizer("adamw_bf16sr", _groups(model), 1e-3, (0.9, 0.95))
    x = torch.randint(0, 256, (2, 32))
    nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
    optimizer.step()
    measured = state_bytes_by_dtype(optimizer)["bfloat16"]
    with torch.device("meta"):
        facts = model_facts(LitGPT(**shape), precision="bf16-true", policies=("none",))
    options = PlannerOptions(reserve_gb=0)
    base = Choice(1, 1, 1, batch_per_rank=2)
    planned = rank_memory(
        facts, Choice(1, 1, 1, batch_per_rank=2, optimizer="adamw_bf16sr"), options
    )
    assert planned.optimizer == measured
    # AdamW with ZeRO-0's fp32 masters at bf16-true: 12 bytes a parameter against these 4
    assert rank_memory(facts, base, options).optimizer == 3 * measured


def test_it_is_refused_where_the_parameters_are_not_bf16():
    problems = optimizer_problems("adamw_bf16sr", precision="bf16-mixed")
    assert len(problems) == 1 and "precision='bf16-mixed'" in problems[0]
    assert "bf16-true" in problems[0]
    problems = optimizer_problems(
        "adamw_bf16sr", zero_stage=1, precision="bf16-true", master_weights=True
    )
    assert len(problems) == 1 and "zero_master_weights=True" in problems[0]
    assert not optimizer_problems(
        "adamw_bf16sr", zero_stage=1, precision="bf16-true", master_weights=False
    )
    assert not optimizer_problems(
        "adamw_bf16sr", zero_stage=3, precision="bf16-true", master_weights=True
    )
    assert "offload='cpu'" in optimizer_problems("adamw_bf16sr", offload="cpu")[0]
    with pytest.raises(ValueError, match=r"1 trained parameter\(s\) are torch.float32"):
        build_optimizer("adamw_bf16sr", [nn.Parameter(torch.ones(4))], 1e-3, (0.9, 0.95))


def test_the_planner_refuses_it_outside_bf16_true():
    from lightning_3d.models import LitGPT
    from lightning_3d.planner import Cluster, PlannerOptions, plan_layouts
    from lightning_3d.planner.facts import model_facts

    with torch.device("meta"):
        module = LitGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    cluster = Cluster(nodes=1, devices_per_node=1, device_memory_gb=80)
    options = PlannerOptions(optimizer="adamw_bf16sr", offloads=("none",), ac_policies=("none",))
    for precision, fits in (("bf16-mixed", False), ("bf16-true", True)):
        facts = model_facts(module, precision=precision, policies=("none",))
        cands = plan_layouts(facts, cluster, options)
        assert any(c.fits for c in cands) is fits, precision
    refused = plan_layouts(
        model_facts(module, precision="bf16-mixed", policies=("none",)), cluster, options
    )
    assert "precision='bf16-mixed'" in refused[0].reason
