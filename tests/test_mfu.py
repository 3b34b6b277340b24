"""Model FLOPs per token, device peaks and MFU in ``RunSummary`` (``lightning_3d/observe/flops.py``)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import lightning
import pytest
import torch
from torch import nn

from lightning_3d.data import TextDataModule
from lightning_3d.models import LitGPT
from lightning_3d.observe.flops import (
    check_peak_tflops,
    device_peak,
    model_flops_per_token,
    precision_dtype,
)
from lightning_3d.observe.summary import RunSummary

V, BLOCK, L, D = 32, 8, 2, 16  # vocab, positions, layers, width of the hand-counted GPT


def _hand_count_gpt_params(vocab: int, block: int, layers: int, d: int) -> int:
    """LitGPT without biases: token and position tables, per block two LayerNorm weights, q/k/v/o
    (4 d²) and the 4x MLP (8 d²), the final norm and an untied head."""
    return vocab * d + block * d + layers * (2 * d + 4 * d * d + 8 * d * d) + d + d * vocab


def test_gpt_flops_match_hand_count():
    module = LitGPT(vocab_size=V, block_size=BLOCK, n_layer=L, n_head=2, n_embd=D)
    n = _hand_count_gpt_params(V, BLOCK, L, D)
    assert n == sum(p.numel() for p in module.parameters()) == 7376
    per_token, formula = model_flops_per_token(module, n)
    assert formula == "6N + 12*L*d*T"
    assert per_token(BLOCK) == 6 * 7376 + 12 * L * D * BLOCK == 47_328
    assert per_token(4) == 6 * 7376 + 12 * L * D * 4  # the attention term follows the sequence


def test_issue_table_model_gives_its_tflops():
    """The one-device benchmark's 12 x 768 GPT (docs/gpu.md) at seq 1024: 630 MFLOP per token,
    so the 478 673 tok/s of the issue's raw-loop row are the 302 TFLOP/s printed beside them."""
    with torch.device("meta"):
        module = LitGPT(vocab_size=256, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    n = sum(p.numel() for p in module.parameters())
    assert n == _hand_count_gpt_params(256, 1024, 12, 768)
    per_token, _ = model_flops_per_token(module, n)
    assert per_token(1024) == 6 * n + 12 * 12 * 768 * 1024
    assert per_token(1024) * 478_673 / 1e12 == pytest.approx(302, abs=0.5)


class _HFStyle(nn.Module):
    """A LightningModule-like wrapper whose ``model.config`` uses transformers' key names."""

    def __init__(self, **config) -> None:
        super().__init__()
        self.model = nn.Linear(2, 2)
        self.model.config = SimpleNamespace(**config)


def test_transformers_config_spelling_and_head_dim():
    plain = _HFStyle(num_hidden_layers=3, hidden_size=64, num_attention_heads=4)
    per_token, _ = model_flops_per_token(plain, 1000)
    assert per_token(10) == 6 * 1000 + 12 * 3 * 64 * 10
    # Qwen3-style: query width heads x head_dim (8 x 16 = 128) differs from the hidden size.
    wide = _HFStyle(num_hidden_layers=3, hidden_size=64, num_attention_heads=8, head_dim=16)
    per_token, _ = model_flops_per_token(wide, 1000)
    assert per_token(10) == 6 * 1000 + 12 * 3 * 128 * 10


def test_layers_of_different_widths_count_their_mean():
    """A config whose layers differ refuses a global read of a per-layer key (transformers'
    heterogeneous configs: Gemma-4's head_dim; the run summary stopped every run of it at its
    first step); the formula takes the layers' mean attention width."""

    class PerLayer(SimpleNamespace):
        def __getattribute__(self, key):
            # As transformers' AmbiguousGlobalPerLayerAttributeError, no AttributeError.
            if key == "head_dim":
                raise RuntimeError("'head_dim' is a per-layer attribute")
            return super().__getattribute__(key)

    config = PerLayer(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        per_layer_config=[
            SimpleNamespace(num_attention_heads=4, head_dim=8),
            SimpleNamespace(num_attention_heads=4, head_dim=24),
        ],
    )
    module = nn.Linear(1, 1)
    module.config = config
    per_token, _ = model_flops_per_token(module, 1000)
    assert per_token(10) == 6 * 1000 + 12 * 2 * 64 * 10  # mean of 32 and 96


def test_without_config_only_parameters_count():
    per_token, formula = model_flops_per_token(nn.Linear(3, 3), 12)
    assert per_token(100) == 72 and formula.startswith("6N ")


class _OwnCount(nn.Module):
    def __init__(self, result) -> None:
        super().__init__()
        self.result = result
        self.config = SimpleNamespace(n_layer=1, n_embd=4)  # ignored: the hook wins

    def flops_per_token(self, seq_len: int):
        return self.result(seq_len) if callable(self.result) else self.result


def test_module_hook_overrides_the_formula():
    per_token, formula = model_flops_per_token(_OwnCount(lambda t: 1000.0 + t), num_params=5)
    assert per_token(7) == 1007.0 and formula == "_OwnCount.flops_per_token"


@pytest.mark.parametrize("bad", [0, -3.0, float("nan"), None, "10"])
def test_module_hook_returning_nonsense_is_refused(bad):
    per_token, _ = model_flops_per_token(_OwnCount(bad), num_params=5)
    with pytest.raises(ValueError, match=r"flops_per_token\(7\)"):
        per_token(7)


@pytest.mark.parametrize("bad", [0, -1, -0.5, float("inf"), float("nan"), True, "989"])
def test_bad_peak_override_is_a_value_error(bad):
    with pytest.raises(ValueError, match="peak_tflops"):
        check_peak_tflops(bad)
    with pytest.raises(ValueError, match="peak_tflops"):
        RunSummary(peak_tflops=bad)


def test_peaks_from_the_table(monkeypatch):
    cuda = torch.device("cuda", 0)
    names = {
        "NVIDIA H200": 989.4,
        "NVIDIA H100 80GB HBM3": 989.4,
        "NVIDIA H100 PCIe": 756.5,
        "NVIDIA A100-SXM4-80GB": 312.0,
        "NVIDIA L4": 121.0,
        "NVIDIA L40S": 362.1,
        "NVIDIA GeForce RTX 4090": 165.2,
    }
    for name, bf16 in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        peak = device_peak(cuda, "bf16-mixed")
        assert peak.tflops == bf16, name
        assert peak.source.endswith("bf16 dense")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert device_peak(cuda, "32-true").tflops == 19.5  # fp32 matmuls: no tensor cores
    assert device_peak(cuda, "32-true", override=100.0) == device_peak(
        cuda, "bf16-mixed", override=100.0
    )
    assert device_peak(cuda, "64-true").tflops is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    assert (
        device_peak(cuda, "16-mixed").tflops == 125.0
        and device_peak(cuda, "bf16-mixed").tflops is None
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    unknown = device_peak(cuda, "bf16-mixed")
    assert unknown.tflops is None and "Some Future GPU" in unknown.source


def test_fp32_matmuls_count_as_tf32_when_allowed():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert precision_dtype("32-true") == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert precision_dtype("32-true") == "fp32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert precision_dtype("bf16-true") == "bf16" and precision_dtype("16-mixed") == "fp16"


def test_cpu_has_no_peak():
    peak = device_peak(torch.device("cpu"), "32-true")
    assert peak.tflops is None and "cpu" in peak.source


def _fit(tmp_path, peak_tflops):
    torch.manual_seed(0)
    module = LitGPT(
        vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, warmup_steps=1, max_steps=4
    )
    data = TextDataModule(max_bytes=50_000, block_size=16, batch_size=4)
    summary = RunSummary(out_dir=str(tmp_path), warmup_steps=1, peak_tflops=peak_tflops)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[summary],
    )
    trainer.fit(module, datamodule=data)
    return module, summary, trainer, json.loads((tmp_path / "summary.json").read_text())


def test_summary_reports_tflops_and_mfu_against_the_override(tmp_path):
    peak = 1e-4  # 100 MFLOP/s: a CPU's share, so the ratio is an ordinary number
    module, summary, trainer, written = _fit(tmp_path, peak)
    n = sum(p.numel() for p in module.parameters())
    per_token = 6 * n + 12 * 2 * 16 * 16
    assert written["num_params"] == n
    assert written["flops_per_token"] == per_token
    rates = [f / t for f, t in zip(summary.step_flops, summary.step_times)]
    assert summary.step_flops == [per_token * 4 * 16] * 4  # batch 4 x 16 tokens per step
    assert written["tflops"] == pytest.approx(sorted(rates[1:])[1] / 1e12)  # median after warm-up
    assert written["tflops"] > 0
    assert written["peak_tflops"] == peak and written["peak_source"] == "override"
    assert written["mfu"] == pytest.approx(written["tflops"] / peak)
    # the last step's figures are logged and on the progress bar
    bar = trainer.progress_bar_metrics
    assert bar["mfu"] == pytest.approx(bar["tflops"] / peak) and bar["tflops"] > 0
    assert bar["tflops"] == pytest.approx(rates[-1] / 1e12, rel=1e-5)


def test_summary_on_cpu_without_override_has_null_mfu(tmp_path):
    _, _, trainer, written = _fit(tmp_path, None)
    assert written["tflops"] > 0
    assert written["mfu"] is None and written["peak_tflops"] is None
    assert "cpu" in written["peak_source"] and "peak_tflops" in written["peak_source"]
    assert "mfu" not in trainer.progress_bar_metrics and "tflops" in trainer.progress_bar_metrics
    assert not math.isnan(written["flops_per_token"])
