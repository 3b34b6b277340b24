"""QLoRA with bitsandbytes' 4-bit NF4 base (``adapter.quantization="bitsandbytes"``, its CPU
kernels here): the base is ``Linear4bit``, only the adapters train, and the layouts it runs
under (one device, dp2 ZeRO-1/2, pp2; ranks seeded apart) match one process; tensor parallelism
and ZeRO-3 are refused naming the backend. Tiny random Llama, 256 wide."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from lightning_3d.adapters import AdapterOptions, is_adapter_name  # noqa: E402
from support.qlora import WIDE, qlora_run  # noqa: E402
from tools.harness.parity import loss_mismatches, update_mismatches  # noqa: E402
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

QLORA = {"method": "qlora", "r": 4, "lora_alpha": 8, "quantization": "bitsandbytes"}


def bnb_run(strategy, **changes) -> Run:
    return qlora_run(strategy, QLORA, **changes)


@pytest.fixture(scope="module")
def reference():
    return fit_gpt(0, bnb_run(None))


def _module():
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    return HFCausalLM(config=tiny_hf_config("llama", **WIDE), adapter=QLORA)


def test_the_base_is_bitsandbytes_4bit_and_only_adapters_train(reference):
    """Catches: the option ignored (a torchao or dense base), a base that moves, adapters that
    do not train."""
    import bitsandbytes as bnb

    q_proj = _module().model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit)
    assert (
        q_proj.base_layer.weight.quant_type == "nf4"
        and q_proj.base_layer.weight.dtype == torch.uint8
    )
    assert not q_proj.base_layer.weight.requires_grad and q_proj.lora_A.default.weight.requires_grad
    initial, final = reference["initial_state"], reference["state"]
    moved = [k for k in initial if is_adapter_name(k) and not torch.equal(final[k], initial[k])]
    assert len(moved) == 28  # every A and B of 14 projections
    base = [k for k in final if not is_adapter_name(k) and k in initial]  # not the quant states
    assert len(base) > 10
    for name in base:
        assert torch.equal(final[name], initial[name]), f"base weight {name} changed"
    assert reference["losses"][-1] < reference["losses"][0]


LAYOUTS = {
    "one_device_3d": (1, {}),
    "dp2_zero1": (2, {"data": 2, "zero_stage": 1}),
    "dp2_zero2": (2, {"data": 2, "zero_stage": 2}),
    "pp2": (2, {"pipeline": 2}),
    "dp2_zero1_ranks_seeded_apart": (2, {"data": 2, "zero_stage": 1}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bitsandbytes_qlora_layouts_match_one_process(reference, layout):
    """Catches: the 4-bit codes broadcast without their scales (ranks seeded apart then pair rank
    0's codes with their own scales: another base); a stage that loses its quantized bases."""
    world_size, strategy = LAYOUTS[layout]
    apart = layout.endswith("seeded_apart")
    run = bnb_run(strategy, devices=world_size, rank_seeds=apart)
    world = run_world(fit_gpt_ranks, world_size, run)
    initial = reference["initial_state"]
    problems = loss_mismatches(world[0]["losses"], reference["losses"], rtol=1e-5)
    adapters = {k: v for k, v in world[0]["state"].items() if is_adapter_name(k)}
    assert adapters
    problems += update_mismatches(adapters, reference["state"], initial, rtol=1e-4)
    assert not problems, "bitsandbytes QLoRA differs from one process:\n  " + "\n  ".join(problems)


def test_tensor_parallelism_and_zero3_are_refused_naming_the_backend():
    from lightning_3d.adapters.qlora import check_qlora_plan
    from lightning_3d.options import Plan

    module = _module()
    with pytest.raises(
        ValueError,
        match=r"qlora' \(bitsandbytes\) cannot run with tensor=2: .*; zero_stage=3: "
        r"bitsandbytes' 4-bit weights keep their scales beside the parameter",
    ):
        check_qlora_plan(module, Plan.from_options(tensor=2, zero_stage=3))
    check_qlora_plan(module, Plan.from_options(zero_stage=2, offload="cpu"))  # fine


def test_the_option_is_checked():
    with pytest.raises(ValueError, match=r"quantization='bitsandbytes' applies to method='qlora'"):
        AdapterOptions.parse({"method": "lora", "quantization": "bitsandbytes"})
    with pytest.raises(ValueError, match=r"quantization='gptq' must be one of"):
        AdapterOptions.parse({"method": "qlora", "quantization": "gptq"})
