"""LoRA adapters on ``HFCausalLM`` in one process: only the adapters train, checkpoints hold only
them and resume exactly, and the exports are what ``peft`` and ``transformers`` load.

Tiny random Llama (``tools.harness.hf_configs``; no downloads), fp32, a few steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_3d.adapters import AdapterOptions, is_adapter_name  # noqa: E402
from lightning_3d.adapters.export import save_peft  # noqa: E402
from lightning_3d.models.hf import HFCausalLM  # noqa: E402
from tools.harness.hf_configs import tiny_hf_config  # noqa: E402
from tools.harness.runs import Run, fit_gpt  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

LORA = {"method": "lora", "r": 4, "lora_alpha": 8}
SEED = 1234


def lora_run(**changes) -> Run:
    model = {"adapter": LORA, "lr": 1e-2, **changes.pop("model", {})}
    return Run(**{"steps": 4, "seed": SEED, "arch": "hf_llama", "model": model, **changes})


def fit(run: Run, world: int = 1) -> dict:
    """Rank 0's result of ``run``: plain Lightning here, ``ThreeDStrategy`` in a world."""
    if run.strategy is None:
        return fit_gpt(0, run)
    return run_world(fit_gpt, world, dataclasses.replace(run, devices=world))[0]


def base_of(state: dict) -> dict:
    return {k: v for k, v in state.items() if not is_adapter_name(k)}


@pytest.mark.parametrize("strategy", [None, {}], ids=["lightning", "3d"])
def test_only_adapters_train_and_the_base_stays_bit_for_bit(strategy):
    """Catches: base weights handed to the optimizer (updated, or given Adam state); adapters
    that never receive a gradient (B stays zero: the model never changes)."""
    run = fit(lora_run(strategy=strategy))
    initial, final = run["initial_state"], run["state"]
    assert set(initial) <= set(final)  # final: with the non-persistent buffers
    adapters = sorted(k for k in final if is_adapter_name(k))
    # Every block's seven projections (q, k, v, o, gate, up, down), A and B each, two blocks.
    assert len(adapters) == 2 * 7 * 2, adapters
    assert len(base_of(initial)) > 10
    for name, value in base_of(initial).items():
        assert torch.equal(final[name], value), f"base weight {name} changed"
    for name in adapters:
        assert not torch.equal(final[name], initial[name]), f"adapter {name} did not train"
    assert run["losses"][-1] < run["losses"][0]


def test_checkpoint_holds_adapters_and_their_state_and_resumes_exactly(tmp_path):
    """Catches: the base written into every adapter checkpoint; optimizer state of frozen
    weights; a resume that loses the adapters' Adam moments or re-initialises them."""
    straight = fit(lora_run(strategy={}, steps=4))
    fit(lora_run(strategy={}, steps=2, save_to=str(tmp_path / "lora.ckpt"), save_every_n_steps=2))
    path = tmp_path / "lora-step=2.ckpt"
    saved = torch.load(path, weights_only=False)
    assert saved["state_dict"] and all(is_adapter_name(k) for k in saved["state_dict"])
    assert len(saved["state_dict"]) == 28
    assert saved["adapter"]["method"] == "lora" and saved["adapter"]["r"] == 4
    state = saved["optimizer_states"][0]["state"]
    assert len(state) == 28 and all(
        s["exp_avg"].shape == saved["state_dict"][k].shape
        for s, k in zip(
            state.values(), sorted(saved["state_dict"], key=list(saved["state_dict"]).index)
        )
    )
    resumed = fit(lora_run(strategy={}, steps=4, resume_from=str(path)))
    assert resumed["losses"] == straight["losses"][2:]
    for name, value in straight["state"].items():
        assert torch.equal(resumed["state"][name], value), name


def test_a_full_checkpoint_is_refused_by_an_adapted_model(tmp_path):
    path = tmp_path / "full.ckpt"
    fit(dataclasses.replace(lora_run(strategy={}, steps=1, save_to=str(path)), model={"lr": 1e-2}))
    with pytest.raises(RuntimeError, match="the checkpoint holds no adapter"):
        fit(lora_run(strategy={}, steps=2, resume_from=str(path)))


def test_an_adapters_only_checkpoint_with_a_base_tensor_is_refused_naming_it():
    """The check on loading an adapter checkpoint (``on_load_checkpoint``) takes the adapters
    only, and refuses one that also holds a base weight, naming it. Catches: the check for base
    tensors dropped (a base weight in the checkpoint would then load over the model's own)."""
    module = HFCausalLM(config=tiny_hf_config("llama"), adapter=LORA)
    state = module.state_dict()
    adapters = {k: v for k, v in state.items() if is_adapter_name(k)}
    options = AdapterOptions.parse(LORA).as_dict()
    module.on_load_checkpoint({"state_dict": dict(adapters), "adapter": options})  # accepted
    base = "model.model.layers.0.self_attn.q_proj.base_layer.weight"
    checkpoint = {"state_dict": {**adapters, base: state[base]}, "adapter": options}
    with pytest.raises(ValueError, match=r"does not fit the model: base tensors \[") as caught:
        module.on_load_checkpoint(checkpoint)
    assert f"base tensors ['{base}'] (of 1), adapter tensors missing [] (of 0)" in str(caught.value)


def _trained_module() -> tuple[HFCausalLM, dict]:
    run = fit(lora_run(strategy={}))
    module = HFCausalLM(config=tiny_hf_config("llama"), adapter=LORA)
    module.load_state_dict({k: v for k, v in run["state"].items() if k in module.state_dict()})
    return module.eval(), run["state"]


def test_peft_export_loads_in_peft_with_the_same_logits(tmp_path):
    """The PEFT directory is peft's own format: ``PeftModel.from_pretrained`` on the base gives
    the trained model's logits; the merged directory loads in plain ``transformers``. Catches:
    a key layout peft does not read (it loads silently and leaves the adapters at their init:
    B = 0, so the logits are the base's); a wrong scaling in the merge."""
    import transformers

    module, state = _trained_module()
    options = AdapterOptions.parse(LORA)
    save_peft(module.model.config, state, options, tmp_path / "adapter")
    save_peft(module.model.config, state, options, tmp_path / "merged", merged=True)
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    config = tiny_hf_config("llama")
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config)
    )
    base.load_state_dict(
        {
            k[len("model.") :].replace(".base_layer", ""): v
            for k, v in base_of(module.state_dict()).items()
        }
    )
    ids = torch.randint(3, 256, (2, 16))
    with torch.no_grad():
        want = module(ids)
        plain = base(input_ids=ids).logits
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        got = loaded(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
        got_merged = merged(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-3  # the adapters matter: the check can fail
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_merged, want, rtol=1e-5, atol=1e-5)
    assert not any("lora" in k for k in merged.state_dict())


@pytest.mark.parametrize(
    "adapter, message",
    [
        ({"method": "dora"}, r"method='dora' must be one of \('none', 'lora', 'qlora'\)"),
        (
            {"method": "lora", "r": 0, "lora_dropout": 1.5},
            r"r=0 must be a positive integer; adapter lora_dropout=1.5 must be in \[0, 1\)",
        ),
        ({"method": "lora", "rank": 4}, r"unknown adapter option\(s\) \['rank'\]"),
        (
            {"method": "lora", "target_modules": ["nothing_here"]},
            r"target_modules=\('nothing_here',\)",
        ),
    ],
)
def test_bad_adapter_options_are_refused(adapter, message):
    with pytest.raises(ValueError, match=message):
        HFCausalLM(config=tiny_hf_config("llama"), adapter=adapter)


def test_no_adapter_is_todays_full_fine_tune():
    module = HFCausalLM(config=tiny_hf_config("llama"), adapter="none")
    assert not any(is_adapter_name(n) for n, _ in module.named_parameters())
    assert all(p.requires_grad for p in module.parameters())


def test_checkpoint_exports_on_the_command_line(tmp_path):
    """``python -m lightning_3d.adapters CKPT DIR [--merged]`` from an adapter checkpoint of a
    model directory: the merged model's logits are the trained module's (base read from the
    directory, adapters from the checkpoint). Catches: a merge from a wrong base; adapters not
    loaded before the export (the merged model would be the base)."""
    import transformers

    from lightning_3d.adapters.__main__ import main

    HFCausalLM(config=tiny_hf_config("llama")).model.save_pretrained(tmp_path / "base")
    run = fit(
        lora_run(
            model={"path": str(tmp_path / "base"), "deferred_init": False},
            save_to=str(tmp_path / "lora.ckpt"),
        )
    )
    assert main([str(tmp_path / "lora.ckpt"), str(tmp_path / "merged"), "--merged"]) == 0
    assert main([str(tmp_path / "lora.ckpt"), str(tmp_path / "adapter")]) == 0
    trained = HFCausalLM(path=str(tmp_path / "base"), adapter=LORA)
    trained.load_weights()  # built on meta: storage first, then the trained adapters
    trained.load_state_dict({k: v for k, v in run["state"].items() if k in trained.state_dict()})
    ids = torch.randint(3, 256, (2, 16))
    with torch.no_grad():
        want = trained.eval()(ids)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
        plain = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        got = adapted(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
        got_merged = merged(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_merged, want, rtol=1e-5, atol=1e-5)


def test_config_only_checkpoint_cannot_be_merged(tmp_path, capsys):
    from lightning_3d.adapters.__main__ import main

    fit(lora_run(steps=1, save_to=str(tmp_path / "lora.ckpt")))
    assert main([str(tmp_path / "lora.ckpt"), str(tmp_path / "merged"), "--merged"]) == 2
    assert "merging needs a model built from path=" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()


def test_hydra_adapter_group_reaches_the_model(tmp_path, monkeypatch):
    from tools.harness.apps import compose_config

    monkeypatch.chdir(tmp_path)  # composing makes the run directories (unique_dir) here

    cfg = compose_config("train", "model=hf", "adapter=lora", "model.adapter.r=4")
    assert AdapterOptions.parse(dict(cfg.model.adapter)) == AdapterOptions(method="lora", r=4)
    assert "adapter" not in compose_config("train", "model=hf").model  # none: today's model
    assert compose_config("finetune", "model=hf", "adapter=qlora").model.adapter.method == "qlora"
