"""The two GPU targets of the adapters bench, judged from its rows: met, missed or not measured.

1. **LoRA speed**: LoRA's tokens/s at least ``LORA_SPEEDUP`` (1.5) times the full fine-tune's, on
   one CUDA device at ``bf16-mixed``, on a Llama-3-8B block (``LLAMA3_8B``'s width, MLP, heads,
   key/value heads and vocabulary; any number of layers: the ratio is per block, and a full
   fine-tune of all 32 layers with fp32 Adam does not fit one device).
2. **QLoRA memory**: QLoRA of the whole 8B shape (32 layers) trains under ``QLORA_LIMIT_BYTES``
   (10 GB = 10^10 bytes, the stricter reading) of device memory, judged on the peak allocated by
   training (``torch.cuda.max_memory_allocated`` at the end of training); the peak reserved by
   the caching allocator is shown beside it. One verdict per NF4 backend row (``qlora``:
   torchao; ``qlora-bnb``: bitsandbytes).

Example::

    >>> verdicts([], {"accelerator": "cpu"})[0]
    'LoRA >= 1.5x full fine-tune tokens/s: not measured (CPU run)'
"""

from __future__ import annotations

from typing import Any

LORA_SPEEDUP = 1.5
QLORA_LIMIT_BYTES = 10**10
# Llama-3-8B's block and vocabulary, under the bench's flag names (config.json of the release).
LLAMA3_8B = {"hidden": 4096, "mlp": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256}
LLAMA3_8B_LAYERS = 32


def block_of(settings: dict[str, Any]) -> dict[str, Any]:
    """The bench's block and vocabulary sizes (``None`` for a flag left to its default)."""
    return {k: settings.get(k) for k in LLAMA3_8B}


def is_8b_block(settings: dict[str, Any]) -> bool:
    return block_of(settings) == LLAMA3_8B


def verdicts(records: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """One line per target (and per QLoRA backend row): ``met`` / ``missed`` with the figures,
    or ``not measured`` with the reason."""
    by = {r["method"]: r for r in records}
    return [_speed(by, settings), *_memory(by, settings)]


def _why_not(settings: dict[str, Any], layers: bool) -> str:
    if settings.get("accelerator") != "gpu":
        return "CPU run"
    if not is_8b_block(settings):
        return f"block {block_of(settings)} is not Llama-3-8B's {LLAMA3_8B}"
    if layers and settings.get("layers") != LLAMA3_8B_LAYERS:
        return f"{settings.get('layers')} layers, not {LLAMA3_8B_LAYERS}"
    return ""


def _speed(by: dict[str, dict[str, Any]], settings: dict[str, Any]) -> str:
    name = f"LoRA >= {LORA_SPEEDUP}x full fine-tune tokens/s"
    why = _why_not(settings, layers=False)
    if not why and settings.get("precision") != "bf16-mixed":
        why = f"precision {settings.get('precision')}, not bf16-mixed"
    if not why and not ("full" in by and "lora" in by):
        why = f"needs rows full and lora, got {sorted(by)}"
    if why:
        return f"{name}: not measured ({why})"
    ratio = by["lora"]["tokens_per_s"] / by["full"]["tokens_per_s"]
    verdict = "met" if ratio >= LORA_SPEEDUP else "missed"
    return (
        f"{name}: {verdict} ({ratio:.2f}x: LoRA {by['lora']['tokens_per_s']:,.0f}, full "
        f"{by['full']['tokens_per_s']:,.0f} tokens/s, {settings.get('layers')} layers)"
    )


def _memory(by: dict[str, dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    limit_gb = QLORA_LIMIT_BYTES / 1e9
    out = []
    for method, backend in (("qlora", "torchao"), ("qlora-bnb", "bitsandbytes")):
        name = f"QLoRA ({backend}) 8B under {limit_gb:.0f} GB device peak"
        why = _why_not(settings, layers=True)
        row = by.get(method)
        if not why and row is None:
            why = "no row: " + settings.get("skipped", {}).get(method, "not asked for")
        if why:
            out.append(f"{name}: not measured ({why})")
            continue
        peak = row["device_peak_mb"] * 2**20
        reserved = row["device_reserved_mb"] * 2**20
        verdict = "met" if peak < QLORA_LIMIT_BYTES else "missed"
        out.append(
            f"{name}: {verdict} (allocated {peak / 1e9:.2f} GB, reserved {reserved / 1e9:.2f} GB"
            f", {settings.get('batch')} x {settings.get('seq')} tokens, ac {settings.get('ac')})"
        )
    return out
