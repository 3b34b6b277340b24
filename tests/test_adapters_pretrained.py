"""``finetune.pretrained=FILE`` with and without adapters, on a model built on ``meta``
(``HFCausalLM(path=DIR)``, weights read later) and on one built eagerly: a whole model's file
becomes the adapted model's base (the adapters keep their init), an adapters-only file its
adapters (the base stays the directory's), and an adapters-only file into a model without
adapters is refused naming both ways to use it. Tiny random Llama, no downloads."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors.torch import save_file  # noqa: E402

from lightning_3d.adapters import is_adapter_name  # noqa: E402
from lightning_3d.adapters.lora import base_view  # noqa: E402
from lightning_3d.checkpoint.pretrained import load_pretrained  # noqa: E402
from lightning_3d.models.hf import HFCausalLM  # noqa: E402
from tools.harness.hf_configs import tiny_hf_config  # noqa: E402

LORA = {"method": "lora", "r": 4, "lora_alpha": 8}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A model directory, a different whole model (safetensors, HF names; and a Lightning
    ``.ckpt``, the module's names) and an adapters-only ``.ckpt``."""
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    HFCausalLM(config=tiny_hf_config("llama")).model.save_pretrained(root / "dir")
    torch.manual_seed(1)
    other = HFCausalLM(config=tiny_hf_config("llama"))
    save_file({k: v.contiguous() for k, v in other.model.state_dict().items()}, root / "o.st")
    (root / "other.safetensors").write_bytes((root / "o.st").read_bytes())
    torch.save({"state_dict": other.state_dict()}, root / "other.ckpt")
    torch.manual_seed(2)
    adapted = HFCausalLM(config=tiny_hf_config("llama"), adapter=LORA)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if is_adapter_name(name):
                p.normal_()  # B is zero at init: nonzero, so a load is visible
    adapters = {k: v for k, v in adapted.state_dict().items() if is_adapter_name(k)}
    torch.save({"state_dict": adapters, "adapter": LORA}, root / "adapters.ckpt")
    return {"root": root, "other": other.state_dict(), "adapters": adapters}


def _built(files, deferred: bool, adapter=LORA) -> HFCausalLM:
    path = str(files["root"] / "dir")
    return HFCausalLM(path=path, adapter=adapter, deferred_init=deferred)


@pytest.mark.parametrize("deferred", [True, False], ids=["meta", "eager"])
@pytest.mark.parametrize("name", ["other.safetensors", "other.ckpt"])
def test_a_whole_model_file_becomes_the_adapted_models_base(files, deferred, name):
    """Catches: the file refused for lacking ``base_layer`` / adapter names; the base left at the
    directory's weights (the record not pointed at the file); adapters overwritten."""
    module = _built(files, deferred)
    init = {k: v.clone() for k, v in module.state_dict().items() if is_adapter_name(k)}
    torch.manual_seed(3)
    loaded = load_pretrained(module, files["root"] / name)
    module.load_weights()
    state = module.state_dict()
    view = base_view(list(state))
    assert len(loaded) == len(view) > 10 and not any(is_adapter_name(n) for n in loaded)
    for plain, own in view.items():
        assert torch.equal(state[own], files["other"][plain]), own
    if not deferred:  # on meta the adapters are filled at materialise time, from their record
        for name_, value in init.items():
            assert torch.equal(state[name_], value), name_
    assert all(not torch.equal(state[k], files["adapters"][k]) for k in init)


@pytest.mark.parametrize("deferred", [True, False], ids=["meta", "eager"])
def test_an_adapters_only_file_becomes_the_adapters_on_the_directorys_base(files, deferred):
    module = _built(files, deferred)
    directory = _built(files, False, adapter=None).state_dict()
    load_pretrained(module, files["root"] / "adapters.ckpt")
    module.load_weights()
    state = module.state_dict()
    for name, value in files["adapters"].items():
        assert torch.equal(state[name], value), name
    for plain, own in base_view(list(state)).items():
        assert torch.equal(state[own], directory[plain]), own


@pytest.mark.parametrize("deferred", [True, False], ids=["meta", "eager"])
def test_lora_on_a_model_directory_starts_as_the_base_model(files, deferred):
    """Before any training every ``lora_B`` is exactly zero, so the adapted model's logits are
    the base model's (the directory's, no adapter) bit for bit, built on meta as the app does
    (``model.path=DIR adapter=lora``: the adapters filled when the model is materialised) and
    eagerly. Catches: the materialisation filling ``lora_B`` at random (the model starts away
    from its pretrained weights; a parity test against one process has the same fault)."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    base = _built(files, False, adapter=None).eval()
    module = _built(files, deferred).eval()
    assert (getattr(module.model, "deferred_init", None) is not None) == deferred
    module.load_weights()
    lora_b = {k: v for k, v in module.state_dict().items() if ".lora_B." in k}
    assert len(lora_b) == 14
    for name, value in lora_b.items():
        assert torch.count_nonzero(value) == 0, f"{name} is not zero before training"
    lora_a = [v for k, v in module.state_dict().items() if ".lora_A." in k]
    assert len(lora_a) == 14 and all(torch.count_nonzero(v) > 0 for v in lora_a)
    with torch.no_grad():
        want, got = base(ids), module(ids)
    assert torch.equal(got, want), f"step-0 logits differ by {(got - want).abs().max().item()}"


def test_an_adapters_only_file_into_a_model_without_adapters_is_refused(files):
    module = _built(files, True, adapter=None)
    path = files["root"] / "adapters.ckpt"
    with pytest.raises(ValueError) as caught:
        load_pretrained(module, path)
    message = str(caught.value)
    assert f"{path} holds only LoRA adapters (28 tensors, no base weights)" in message
    assert "adapter=lora" in message and "--merged" in message


def test_the_apps_check_takes_a_whole_model_file_for_an_adapted_model(files):
    """The launcher's check before any process starts: the same matching as the load."""
    from omegaconf import OmegaConf

    from lightning_3d.app.finetune import check_pretrained

    cfg = OmegaConf.create({})
    for name in ("other.safetensors", "other.ckpt", "adapters.ckpt"):
        check_pretrained(cfg, files["root"] / name, _built(files, True))
    with pytest.raises(ValueError, match="holds only LoRA adapters"):
        check_pretrained(cfg, files["root"] / "adapters.ckpt", _built(files, True, adapter=None))
    with pytest.raises(ValueError, match="unexpected in the checkpoint"):
        check_pretrained(
            cfg, files["root"] / "other.ckpt", HFCausalLM(config=tiny_hf_config("gpt2"))
        )


def test_a_whole_model_file_becomes_a_qlora_base_in_nf4(tmp_path):
    """QLoRA's base is NF4 by the time the file is read: each weight is quantized from its bf16
    rounding, exactly as when the model is built from those weights. Catches: the file's values
    cast into the NF4 codes another way, or the base left at its random init."""
    pytest.importorskip("torchao")
    wide = tiny_hf_config("llama", hidden_size=256, intermediate_size=512, num_key_value_heads=4)
    torch.manual_seed(4)
    other = HFCausalLM(config=wide)
    save_file({k: v.contiguous() for k, v in other.model.state_dict().items()}, tmp_path / "w.st")
    qlora = {**LORA, "method": "qlora"}
    torch.manual_seed(5)
    module = HFCausalLM(config=wide, adapter=qlora)
    load_pretrained(module, tmp_path / "w.st")
    from lightning_3d.adapters.qlora import require_nf4

    nf4, to_nf4 = require_nf4()
    state, source = module.state_dict(), other.model.state_dict()
    quantized = [n for n, v in state.items() if isinstance(v, nf4)]
    assert len(quantized) == 14
    for own in quantized:
        plain = own[len("model.") :].replace(".base_layer", "")
        expected = to_nf4(source[plain].to(torch.bfloat16), 64, 256).get_original_weight()
        torch.testing.assert_close(state[own].get_original_weight(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("adapter", [None, LORA], ids=["plain", "lora"])
def test_a_tied_head_stored_once_is_read_for_both_names(tmp_path, adapter):
    """Qwen2 ties its head to the embedding and its file stores the embedding only: the launcher's
    check and the load on meta take the file, and the head gets the embedding's values. Catches:
    the head reported missing from the file, or left at its init."""
    torch.manual_seed(0)
    source = HFCausalLM(config=tiny_hf_config("qwen2"))
    source.model.save_pretrained(tmp_path / "model")
    from omegaconf import OmegaConf
    from safetensors import safe_open

    from lightning_3d.app.finetune import check_pretrained

    path = tmp_path / "model" / "model.safetensors"
    with safe_open(str(path), "pt") as handle:
        assert "lm_head.weight" not in handle.keys()
    module = HFCausalLM(path=str(tmp_path / "model"), adapter=adapter)
    check_pretrained(OmegaConf.create({}), path, module)
    load_pretrained(module, path)
    module.load_weights()
    embedding = source.state_dict()["model.model.embed_tokens.weight"]
    assert torch.equal(module.state_dict()["model.lm_head.weight"], embedding)
