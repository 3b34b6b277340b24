"""QLoRA: LoRA adapters over a base stored in NF4 (torchao), one process and the layouts it runs
under, each against one process running QLoRA (same losses, same adapter updates, the NF4 base
unchanged); tensor parallelism refused.

A tiny random Llama, wide enough for torchao 0.18's NF4 (every adapted weight a multiple of
64 x 256 elements, and of that times 2 for FSDP2's shards)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("torchao")

from lightning_3d.adapters import is_adapter_name  # noqa: E402
from support.qlora import SEED, WIDE  # noqa: E402
from support.qlora import qlora_run as support_run  # noqa: E402
from tools.harness.parity import loss_mismatches, update_mismatches  # noqa: E402
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

QLORA = {"method": "qlora", "r": 4, "lora_alpha": 8}


def qlora_run(strategy, **changes) -> Run:
    return support_run(strategy, QLORA, **changes)


def dequantized(value: torch.Tensor) -> torch.Tensor:
    return value.get_original_weight() if hasattr(value, "get_original_weight") else value


@pytest.fixture(scope="module")
def reference():
    return fit_gpt(0, qlora_run(None))


@pytest.fixture(scope="module")
def initial_base():
    """The base as ``fit_gpt`` builds it (same seed), dequantized straight from its NF4 codes:
    torchao 0.18's ``NF4Tensor.clone`` re-quantizes, which is not exact, so the run's own
    ``initial_state`` (a clone) cannot stand for the base."""
    import lightning as L

    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    L.seed_everything(SEED, verbose=False)
    module = HFCausalLM(config=tiny_hf_config("llama", **WIDE), adapter=QLORA)
    return {
        k: dequantized(v).clone() for k, v in module.state_dict().items() if not is_adapter_name(k)
    }


def test_qlora_base_is_nf4_and_only_adapters_train(reference, initial_base):
    """Catches: a base left dense (no memory saved); a base that moves; adapters that do not."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    module = HFCausalLM(config=tiny_hf_config("llama", **WIDE), adapter=QLORA)
    q_proj = module.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer.weight, NF4Tensor)
    assert q_proj.base_layer.weight.dtype == torch.bfloat16  # computed in bf16
    assert not q_proj.base_layer.weight.requires_grad and q_proj.lora_A.default.weight.requires_grad
    initial, final = reference["initial_state"], reference["state"]
    for name, value in initial.items():
        if is_adapter_name(name):
            assert not torch.equal(final[name], value), f"adapter {name} did not train"
    assert len(initial_base) > 10
    for name, value in initial_base.items():
        assert torch.equal(final[name], value), f"base weight {name} changed"
    assert reference["losses"][-1] < reference["losses"][0]


LAYOUTS = {
    "one_device_3d": (1, {}),
    "one_device_offload": (1, {"offload": "cpu"}),
    "dp2_zero1": (2, {"data": 2, "zero_stage": 1}),
    "dp2_zero3": (2, {"data": 2, "zero_stage": 3}),
    "pp2": (2, {"pipeline": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qlora_layouts_match_one_process(reference, initial_base, layout):
    """Catches: an NF4 base broadcast, sharded or gathered as a plain tensor (torchao refuses
    c10d on an NF4Tensor: its codes and scales travel instead), or re-quantized on the way."""
    world_size, strategy = LAYOUTS[layout]
    world = run_world(fit_gpt_ranks, world_size, qlora_run(strategy, devices=world_size))
    initial = reference["initial_state"]
    problems = loss_mismatches(world[0]["losses"], reference["losses"], rtol=1e-5)
    adapters = {k: v for k, v in world[0]["state"].items() if is_adapter_name(k)}
    assert adapters
    problems += update_mismatches(adapters, reference["state"], initial, rtol=1e-4)
    for rank, result in enumerate(world):
        for name, value in result["rank_state"].items():
            if name in initial_base:
                if not torch.equal(value, initial_base[name]):
                    problems.append(f"rank {rank}: base weight {name} changed")
    assert not problems, "QLoRA run differs from one process:\n  " + "\n  ".join(problems)


def test_qlora_under_tensor_parallelism_is_refused():
    with pytest.raises(
        RuntimeError, match=r"adapter method='qlora' cannot run with tensor=2: the NF4 base"
    ):
        run_world(fit_gpt, 2, qlora_run({"tensor": 2}, devices=2, steps=1))


def test_qlora_layouts_that_cannot_work_are_refused_naming_every_option():
    from lightning_3d.adapters.qlora import check_qlora_plan
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.options import Plan
    from tools.harness.hf_configs import tiny_hf_config

    module = HFCausalLM(config=tiny_hf_config("llama", **WIDE), adapter=QLORA)
    plan = Plan.from_options(tensor=2, zero_stage=3, offload="cpu", offload_params=True)
    with pytest.raises(
        ValueError,
        match=r"cannot run with tensor=2: .*; zero_stage=3 with "
        r"offload_params=True: FSDP2's CPU offload",
    ):
        check_qlora_plan(module, plan)
    check_qlora_plan(module, Plan.from_options(zero_stage=3, offload="cpu"))  # state only: fine
    lora = HFCausalLM(config=tiny_hf_config("llama", **WIDE), adapter={**QLORA, "method": "lora"})
    check_qlora_plan(lora, plan)  # a dense base takes every layout


def test_qlora_under_zero3_refuses_nf4_weights_that_do_not_split_over_the_data_ranks():
    """torchao shards an NF4 weight's codes and both levels of scales in ``data`` equal parts:
    a 256 x 256 weight (4 x 16384 values) splits over 2 or 4 ranks, not 8. Catches: the check
    missing (FSDP2 dies on every rank in torchao's chunk with "quantization_factor.numel() not
    divisible by 8")."""
    from lightning_3d.adapters.qlora import check_qlora_plan
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.options import Plan
    from tools.harness.hf_configs import tiny_hf_config

    module = HFCausalLM(config=tiny_hf_config("llama", **WIDE), adapter=QLORA)
    zero3 = Plan.from_options(zero_stage=3)
    for data in (2, 4):
        check_qlora_plan(module, zero3, data)
    check_qlora_plan(module, Plan.from_options(zero_stage=2), 8)  # ZeRO 1-2: weights whole
    with pytest.raises(
        ValueError,
        match=r"zero_stage=3 over data=8 ranks .* multiple of 8 x 16384 values; these do not: "
        r"model\.model\.layers\.0\.self_attn\.q_proj\.base_layer\.weight \(\(256, 256\): 65536",
    ):
        check_qlora_plan(module, zero3, 8)


def test_qlora_refuses_bases_torchao_cannot_hold():
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    with pytest.raises(
        ValueError,
        match=r"multiple of 16384 elements in NF4; these cannot be: "
        r"model\.layers\.0\.self_attn\.q_proj \(Linear, \(32, 32\)\)",
    ):
        HFCausalLM(config=tiny_hf_config("llama"), adapter=QLORA)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn \(Conv1D"):
        HFCausalLM(config=tiny_hf_config("gpt2"), adapter=QLORA)


def test_qlora_checkpoint_resumes_exactly_and_exports_to_peft(tmp_path, reference, initial_base):
    """The checkpoint holds the adapters (the NF4 base is rebuilt, not saved) and resumes to the
    uninterrupted run; the PEFT export on the dequantized base gives the QLoRA model's logits."""
    import peft
    import transformers

    from lightning_3d.adapters import AdapterOptions
    from lightning_3d.adapters.export import save_peft
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    save = qlora_run({}, steps=1, save_to=str(tmp_path / "q.ckpt"), save_every_n_steps=1)
    run_world(fit_gpt, 1, save)
    path = tmp_path / "q-step=1.ckpt"
    saved = torch.load(path, map_location="cpu", weights_only=False)
    assert saved["state_dict"] and all(is_adapter_name(k) for k in saved["state_dict"])
    resumed = run_world(fit_gpt, 1, qlora_run({}, resume_from=str(path)))[0]
    assert resumed["losses"] == pytest.approx(reference["losses"][1:], rel=1e-6)
    for name, value in reference["state"].items():
        torch.testing.assert_close(resumed["state"][name], value, rtol=1e-6, atol=1e-7)

    import lightning as L

    config = tiny_hf_config("llama", **WIDE)
    L.seed_everything(SEED, verbose=False)  # the run's base
    module = HFCausalLM(config=config, adapter=QLORA).eval()
    module.load_state_dict(
        {k: v for k, v in reference["state"].items() if is_adapter_name(k)}, strict=False
    )
    state = {k: v for k, v in reference["state"].items() if k in module.state_dict()}
    save_peft(module.model.config, state, AdapterOptions.parse(QLORA), tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    )
    base.load_state_dict(
        {
            k[len("model.") :].replace(".base_layer", ""): v.float()
            for k, v in state.items()
            if not is_adapter_name(k)
        }
    )
    ids = torch.randint(3, 256, (2, 16))
    with torch.no_grad():
        want = module(ids)
        got = (
            peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
            .eval()(input_ids=ids)
            .logits
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
