"""``python -m lightning_3d.adapters CKPT DIR [--merged] [--force]`` is as safe as ``export-hf``:
checksums verified, weights-only loading, no directory overwritten without ``--force`` (and
with it, no file of the user's deleted or replaced by peft's model card), QLoRA's NF4 base
exported, the merged directory a whole model (tokenizer, chat template, ``use_cache``), and bad
input one ``error:`` line with exit code 2 before anything is written.

Tiny random Llama (LoRA) and its wide variant (QLoRA: NF4 needs multiples of 64 x 256 values),
read from a model directory built here with a word-level tokenizer and a chat template; fp32,
two steps under ``strategy="3d"`` (its checkpoints carry checksums); no downloads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lightning_3d.adapters import is_adapter_name  # noqa: E402
from lightning_3d.adapters.__main__ import main  # noqa: E402
from lightning_3d.checkpoint.checks import load_lightning_checkpoint  # noqa: E402
from lightning_3d.models.hf import HFCausalLM  # noqa: E402
from support.chat_files import write_chat_files  # noqa: E402
from support.damage import copy_checkpoint, flip_in_tensor  # noqa: E402
from support.qlora import WIDE  # noqa: E402
from tools.harness.hf_configs import tiny_hf_config  # noqa: E402
from tools.harness.runs import Run, fit_gpt  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

LORA = {"method": "lora", "r": 4, "lora_alpha": 8}
QLORA = {"method": "qlora", "r": 4, "lora_alpha": 8}
SEED = 1234


def _model_dir(root: Path, config: dict) -> Path:
    """A model directory: random weights of ``config`` and a tokenizer with a chat template."""
    directory = root / "base"
    HFCausalLM(config=config).model.save_pretrained(directory)
    chat = write_chat_files(root / "chat", conversations=1)
    transformers.AutoTokenizer.from_pretrained(chat["tokenizer"]).save_pretrained(directory)
    return directory


def _train(root: Path, adapter: dict, config: dict) -> tuple[Path, Path, dict]:
    """(checkpoint, model directory, the run's final state) of two steps of ``adapter`` on
    ``config``'s model directory, one process under ``ThreeDStrategy`` (checksums recorded)."""
    base = _model_dir(root, config)
    model = {"adapter": adapter, "lr": 1e-2, "path": str(base), "deferred_init": False}
    run = Run(
        strategy={},
        steps=2,
        seed=SEED,
        arch="hf_llama",
        model=model,
        save_to=str(root / "adapter.ckpt"),
    )
    state = run_world(fit_gpt, 1, run)[0]["state"]
    return root / "adapter.ckpt", base, state


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("lora"), LORA, tiny_hf_config("llama"))


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    pytest.importorskip("torchao")
    return _train(tmp_path_factory.mktemp("qlora"), QLORA, tiny_hf_config("llama", **WIDE))


def _error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _no_temps(*directories: Path) -> None:
    for directory in directories:
        assert not list(directory.glob(".*.tmp-*")), list(directory.iterdir())


def _trained(base: Path, adapter: dict, state: dict) -> HFCausalLM:
    """The trained module: the base read from its directory (QLoRA: quantized as in training),
    the run's final adapters."""
    module = HFCausalLM(path=str(base), adapter=adapter, deferred_init=False)
    module.load_state_dict({k: v for k, v in state.items() if is_adapter_name(k)}, strict=False)
    return module.eval()


def _dequantized_base(module: HFCausalLM) -> torch.nn.Module:
    """A plain ``transformers`` model holding ``module``'s base (NF4 weights dequantized)."""
    base = transformers.AutoModelForCausalLM.from_config(module.model.config)
    plain = {}
    for name, value in module.state_dict().items():
        if is_adapter_name(name):
            continue
        if hasattr(value, "get_original_weight"):
            value = value.get_original_weight()
        plain[name[len("model.") :].replace(".base_layer", "")] = value.float()
    base.load_state_dict(plain)
    return base.eval()


# ------------------------------------------------------------------------------ checksums
def test_flipped_bytes_in_an_adapter_are_refused_naming_file_and_tensor(lora, tmp_path, capsys):
    """Broken variant caught (seen failing): the checkpoint read with ``torch.load`` unverified:
    the damaged ``lora_B`` was exported, exit code 0."""
    ckpt, _, _ = lora
    name = "model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    weight = load_lightning_checkpoint(ckpt)["state_dict"][name]
    assert weight.abs().max() > 0  # trained: B is no longer its zero init
    copy = copy_checkpoint(ckpt, tmp_path / "damaged.ckpt")
    file = flip_in_tensor(copy, weight)
    for merged in ([], ["--merged"]):
        assert main([str(copy), str(tmp_path / "out"), *merged]) == 2
        line = _error_line(capsys)
        assert line.startswith(f"error: {file}: checksum mismatch in tensor state_dict.{name}"), (
            line
        )
        assert not (tmp_path / "out").exists()
    _no_temps(tmp_path)


# ------------------------------------------------------------------------------ overwriting
@pytest.mark.parametrize("merged", [False, True], ids=["peft", "merged"])
def test_a_non_empty_target_is_refused_and_force_keeps_the_users_files(
    lora, tmp_path, capsys, merged
):
    """Without ``--force``: exit 2 naming the directory, nothing in it changed. With it: the
    export's files written, the user's README.md and other files kept (peft's model card is not
    written over a README.md). Broken variant caught (seen failing): the export wrote into any
    directory (README.md replaced by peft's model card, exit 0)."""
    ckpt, _, _ = lora
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my notes\n")
    (out / "keep.txt").write_text("mine\n")
    before = _listing(out)
    flag = ["--merged"] if merged else []
    assert main([str(ckpt), str(out), *flag]) == 2
    line = _error_line(capsys)
    assert f"{out}" in line and "not empty" in line and "--force" in line, line
    assert _listing(out) == before

    assert main([str(ckpt), str(out), *flag, "--force"]) == 0
    after = _listing(out)
    assert after["README.md"] == b"my notes\n" and after["keep.txt"] == b"mine\n"
    wrote = {"config.json", "model.safetensors"} if merged else {"adapter_model.safetensors"}
    assert wrote <= set(after), sorted(after)
    _no_temps(tmp_path)


def test_a_merged_export_onto_another_model_is_refused_without_force(lora, tmp_path, capsys):
    """The model directory the run came from (or any other model's) is not overwritten."""
    ckpt, base, _ = lora
    other = tmp_path / "other"
    copy_checkpoint(base, other)
    before = _listing(other)
    assert main([str(ckpt), str(other), "--merged"]) == 2
    assert f"{other}" in _error_line(capsys)
    assert _listing(other) == before


# ------------------------------------------------------------------------------ unpickling
class _Payload:
    """Unpickling it (``weights_only=False``) writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_a_pickle_payload_is_not_executed_and_is_refused(lora, tmp_path, capsys):
    """Broken variant caught (seen failing): ``torch.load(weights_only=False)`` ran the payload
    (the marker file written) and exported the checkpoint, exit code 0."""
    ckpt, _, _ = lora
    marker = tmp_path / "marker"
    checkpoint = load_lightning_checkpoint(ckpt, verify=None)  # its checksums kept
    checkpoint["callbacks"] = {"innocent": _Payload(marker)}
    torch.save(checkpoint, tmp_path / "payload.ckpt")
    assert main([str(tmp_path / "payload.ckpt"), str(tmp_path / "out")]) == 2
    line = _error_line(capsys)
    assert "payload.ckpt" in line and "refusing to unpickle" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ QLoRA
def test_qlora_exports_load_in_peft_and_transformers_with_the_trained_logits(qlora, tmp_path):
    """The PEFT directory (adapters only) on the dequantized base, and the merged directory
    (the NF4 base dequantized, the adapters merged into it), give the trained QLoRA model's
    logits. Broken variant caught (seen failing): both exports crashed on the NF4 base
    (``'Parameter' object has no attribute 'block_size'``)."""
    ckpt, base, state = qlora
    assert main([str(ckpt), str(tmp_path / "adapter")]) == 0
    assert main([str(ckpt), str(tmp_path / "merged"), "--merged"]) == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all("lora_" in n for n in names), names  # the adapters only

    module = _trained(base, QLORA, state)
    ids = torch.randint(3, 256, (2, 16))
    with torch.no_grad():
        want = module(ids)
        plain = _dequantized_base(module)
        base_logits = plain(input_ids=ids).logits
        got = peft.PeftModel.from_pretrained(plain, str(tmp_path / "adapter")).eval()
        got = got(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
        got_merged = merged.eval()(input_ids=ids).logits
    assert (want - base_logits).abs().max() > 1e-3  # the adapters matter: the check can fail
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_merged, want, rtol=1e-4, atol=1e-4)
    assert not any("lora" in k for k in merged.state_dict())
    assert all(p.dtype == torch.float32 for p in merged.parameters())


def test_bitsandbytes_qlora_exports_load_in_peft_and_transformers(tmp_path):
    """bitsandbytes' 4-bit base (``model.adapter.quantization=bitsandbytes``): its
    ``Params4bit`` writes the packed codes and its quant state as extra entries, which neither
    export took (seen failing: "the state does not fit LlamaForCausalLM ... unexpected
    [...weight.absmax, ...]"). Both exports now hold a plain base, dequantized; the PEFT adapters
    on it and the merged model agree, and give the trained model's logits within its 4-bit
    kernel's bf16 arithmetic on a CPU."""
    pytest.importorskip("bitsandbytes")
    adapter = {**QLORA, "quantization": "bitsandbytes"}
    ckpt, base, state = _train(tmp_path / "run", adapter, tiny_hf_config("llama", **WIDE))
    assert main([str(ckpt), str(tmp_path / "adapter")]) == 0
    assert main([str(ckpt), str(tmp_path / "merged"), "--merged"]) == 0
    module = _trained(base, adapter, state)
    ids = torch.randint(3, 256, (2, 16))
    with torch.no_grad():
        want = module(ids)
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
        got_merged = merged.eval()(input_ids=ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
        plain.load_state_dict(_unmerged(merged.state_dict(), tmp_path / "adapter"))
        got = peft.PeftModel.from_pretrained(plain, str(tmp_path / "adapter")).eval()
        got = got(input_ids=ids).logits
    assert not any("absmax" in k or "lora" in k for k in merged.state_dict())
    torch.testing.assert_close(got, got_merged, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_merged, want, rtol=0, atol=2e-2)


def _unmerged(merged: dict, adapter_dir: Path) -> dict:
    """The base weights of a merged export: each adapted weight minus its LoRA delta."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    adapters = load_file(str(adapter_dir / "adapter_model.safetensors"))
    base = dict(merged)
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        b = adapters[name.replace(".lora_A.", ".lora_B.")]
        target = name.split("base_model.model.", 1)[-1].replace(".lora_A.weight", ".weight")
        base[target] = base[target] - scale * b @ a
    return base


# ------------------------------------------------------------------------------ merged: a whole model
def test_merged_export_has_the_tokenizer_chat_template_and_use_cache(lora, tmp_path):
    """The merged directory loads with ``AutoTokenizer`` (the run's model directory had one),
    keeps its chat template, and its config says ``use_cache: true`` as transformers writes it.
    Broken variant caught (seen failing): no tokenizer files (``AutoTokenizer`` raised) and
    ``use_cache: false`` (the training setting) in config.json."""
    ckpt, base, state = lora
    assert main([str(ckpt), str(tmp_path / "merged"), "--merged"]) == 0
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["use_cache"] is True
    want = transformers.AutoTokenizer.from_pretrained(str(base))
    got = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    text = "the quick brown fox jumps over a lazy dog"
    assert got(text)["input_ids"] == want(text)["input_ids"]
    chat = [{"role": "user", "content": "the quick fox"}]
    assert got.chat_template and got.apply_chat_template(chat, tokenize=False) == (
        want.apply_chat_template(chat, tokenize=False)
    )
    module = _trained(base, LORA, state)
    ids = torch.randint(3, 256, (2, 16))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
        torch.testing.assert_close(
            merged.eval()(input_ids=ids).logits, module(ids), rtol=1e-5, atol=1e-5
        )


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("case", ["missing", "no adapter", "truncated", "target is a file"])
def test_bad_input_is_one_error_line_and_exit_2_before_anything_is_written(
    lora, tmp_path, capsys, case
):
    ckpt, _, _ = lora
    out = tmp_path / "out"
    if case == "missing":
        source, named = tmp_path / "nope.ckpt", f"not found: {tmp_path / 'nope.ckpt'}"
    elif case == "no adapter":  # a full model's checkpoint: its checksums intact
        checkpoint = load_lightning_checkpoint(ckpt, verify=None)
        del checkpoint["adapter"]
        source = tmp_path / "full.ckpt"
        torch.save(checkpoint, source)
        named = f"{source} holds no adapter"
    elif case == "truncated":
        source = tmp_path / "short.ckpt"
        source.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
        named = f"{source}: corrupted or truncated"
    else:
        source, named = ckpt, f"{out} exists and is not a directory"
        out.write_text("a file\n")
    before = out.read_bytes() if out.is_file() else None
    for merged in ([], ["--merged"]):
        assert main([str(source), str(out), *merged]) == 2
        line = _error_line(capsys)
        assert named in line, line
        assert (out.read_bytes() if out.is_file() else None) == before and not out.is_dir()
    _no_temps(tmp_path)


def test_a_failed_write_leaves_the_target_as_it_was(lora, tmp_path, capsys, monkeypatch):
    """A disk that fills up halfway through the export: exit code 3, one ``error:`` line naming
    the target (not the temporary directory), the target's files as they were, no temporary
    left. Broken variant caught (seen failing): peft wrote straight into the target (the half
    written file stayed) and the ``OSError`` escaped as a traceback."""
    import errno
    import os

    import lightning_3d.adapters.export as export

    def full_disk(hf_config, state, options, directory, merged=False):
        Path(directory, "adapter_model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))

    monkeypatch.setattr(export, "save_peft", full_disk)
    ckpt, _, _ = lora
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my notes\n")
    assert main([str(ckpt), str(out), "--force"]) == 3
    lines = capsys.readouterr().err.strip().splitlines()  # transformers' progress bars before it
    assert [line for line in lines if "error" in line] == lines[-1:], lines
    line = lines[-1]
    assert f"{out}" in line and "no space left on device" in line and ".tmp-" not in line, line
    assert _listing(out) == {"README.md": b"my notes\n"}
    _no_temps(tmp_path)


def test_a_sharded_checkpoint_exports_its_adapters_and_is_verified(tmp_path, capsys):
    """A sharded adapter checkpoint (a directory, read whole as ``export-hf`` reads one): the
    PEFT file holds exactly its adapters; a flipped byte in a ``.distcp`` file is refused naming
    the tensor. (The command read only ``.ckpt`` files before.)"""
    from safetensors.torch import load_file

    HFCausalLM(config=tiny_hf_config("llama")).model.save_pretrained(tmp_path / "base")
    model = {"adapter": LORA, "lr": 1e-2, "path": str(tmp_path / "base"), "deferred_init": False}
    strategy = {"checkpoint_format": "sharded"}
    run = Run(strategy=strategy, steps=2, seed=SEED, arch="hf_llama", model=model)
    run_world(fit_gpt, 1, dataclasses.replace(run, save_to=str(tmp_path / "sharded.ckpt")))
    ckpt = tmp_path / "sharded.ckpt"
    assert ckpt.is_dir()
    assert main([str(ckpt), str(tmp_path / "adapter")]) == 0
    saved = load_lightning_checkpoint(ckpt)["state_dict"]
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert written.keys() == {
        "base_model.model." + name[len("model.") :].replace(".default", "") for name in saved
    }
    for name, value in saved.items():
        key = "base_model.model." + name[len("model.") :].replace(".default", "")
        assert torch.equal(written[key], value), name

    name = "model.model.layers.1.mlp.down_proj.lora_B.default.weight"
    copy = copy_checkpoint(ckpt, tmp_path / "damaged.ckpt")
    flip_in_tensor(copy, saved[name])
    capsys.readouterr()
    assert main([str(copy), str(tmp_path / "out")]) == 2
    line = _error_line(capsys)
    assert "checksum mismatch in tensor" in line and name in line, line
    assert not (tmp_path / "out").exists()
