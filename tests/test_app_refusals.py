"""Configurations the app refuses before launch: one ``error:`` line, exit code 2, no run directory.

Tiny Hugging Face model directories are built here (no downloads): a Llama with a chat
tokenizer, a Qwen3-MoE, a Phi-3, a Mamba, the Llama with its ``model.safetensors`` cut in half,
and a chat file with a lone surrogate in one message. Every case is the app's CLI, started
together (each pays the imports once); the adapters' resume comparison is tested in this process.

Before (seen failing on each case with today's code, 2026-12-05): the ranks started and refused
(exit 1, a run directory left): QLoRA at ``tensor=2``, bitsandbytes at ZeRO-3, ZeRO-3 with
``offload.params=true`` under QLoRA, chat data with ``trainer.val_check_interval`` beyond an
epoch (the chat module inherited the byte corpus's window count), NF4 projections too small and
a truncated ``model.safetensors`` under QLoRA ("InstantiationException: Error in call to target
...HFCausalLM"), Phi-3's fused ``qkv_proj`` split plain ``colwise`` ("Couldn't swap
Linear.weight"); a lone surrogate and ``context=2`` on Mamba were a traceback from the launcher.
``tensor=3`` on a 4-head model was refused before launch already (kept as a guard). Qwen3-MoE's
shipped plan at ``tensor=2`` was refused here too; it trains now (its dense-MLP entries are
skipped where every layer is an MoE block), so its directory is built but no case uses it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tools.harness.apps import start_app, wait_all  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"


def _save(root: Path, name: str, config: dict, tokenizer: str) -> Path:
    import torch
    from transformers import AutoTokenizer

    from lightning_3d.models.hf import build_hf_model

    torch.manual_seed(0)
    build_hf_model(None, config).save_pretrained(root / name)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(root / name)
    return root / name


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from support.chat_files import write_model_dir
    from tools.harness.hf_configs import tiny_hf_config

    root = tmp_path_factory.mktemp("refusals")
    llama = Path(write_model_dir(root))  # root/model, root/tokenizer, root/chats.jsonl
    tokenizer = str(root / "tokenizer")
    moe = dict(
        model_type="qwen3_moe",
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    mamba = dict(
        model_type="mamba",
        vocab_size=32,
        hidden_size=32,
        state_size=4,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        time_step_rank=4,
    )
    truncated = root / "truncated"
    truncated.mkdir()
    for file in llama.iterdir():
        data = file.read_bytes()
        (truncated / file.name).write_bytes(
            data[: len(data) // 2] if file.name == "model.safetensors" else data
        )
    lines = (root / "chats.jsonl").read_text().splitlines()
    record = json.loads(lines[3])
    record["messages"][0]["content"] = "the SURROGATE fox"
    lines[3] = json.dumps(record).replace("SURROGATE", "\\ud800")  # valid JSON, invalid text
    surrogate = root / "surrogate.jsonl"
    surrogate.write_text("\n".join(lines) + "\n")
    return {
        "llama": llama,
        "moe": _save(root, "moe", moe, tokenizer),
        "phi3": _save(root, "phi3", tiny_hf_config("phi3", vocab_size=32), tokenizer),
        "mamba": _save(root, "mamba", mamba, tokenizer),
        "truncated": truncated,
        "chats": root / "chats.jsonl",
        "surrogate": surrogate,
        "runs": root / "runs",
    }


def _cases(p: dict[str, Path]) -> dict[str, tuple[list[str], list[str]]]:
    """id -> (overrides, substrings of the one error line). Each is valid but for one thing:
    57 conversations give 48 training rows of 32 tokens (24 batches of 2 in one process)."""
    chat = [
        "model=hf",
        "data=chat",
        f"data.path={p['chats']}",
        "data.block_size=32",
        "data.batch_size=2",
        "data.val_fraction=0.2",
        "trainer.max_steps=1",
        "trainer.val_check_interval=5",
    ]
    llama, two = f"model.path={p['llama']}", "trainer.devices=2"
    return {
        "qlora_at_tensor2": (
            [*chat, llama, two, "parallelism.tensor=2", "adapter=qlora"],
            ["adapter=qlora with parallelism.tensor=2", "DTensor"],
        ),
        "bitsandbytes_at_zero3": (
            [*chat, llama, two, "parallelism=zero3", "adapter=qlora"]
            + ["model.adapter.quantization=bitsandbytes"],
            ["model.adapter.quantization=bitsandbytes with parallelism.zero_stage=3"],
        ),
        "qlora_zero3_offloaded_params": (
            [*chat, llama, two, "parallelism=zero3", "adapter=qlora", "offload=cpu"]
            + ["offload.params=true"],
            ["parallelism.zero_stage=3 with offload.params=true", "NF4"],
        ),
        "chat_val_check_interval_beyond_an_epoch": (
            [*chat, llama, "trainer.val_check_interval=1000"],
            ["trainer.val_check_interval=1000", "the 24 batches of an epoch"],
        ),
        "qlora_projections_nf4_cannot_split": (
            [*chat, llama, "adapter=qlora"],
            ["model.layers.0.self_attn.q_proj (Linear, (32, 32))", "16384"],
        ),
        "qlora_truncated_safetensors": (
            [*chat, f"model.path={p['truncated']}", "adapter=qlora"],
            [str(p["truncated"] / "model.safetensors"), "truncated"],
        ),
        "tensor3_on_4_heads": (
            [*chat, llama, "trainer.devices=3", "parallelism.tensor=3"],
            ["tensor=3", "heads 4 is not divisible"],
        ),
        "phi3_fused_qkv_split_colwise": (
            [*chat, f"model.path={p['phi3']}", two, "parallelism.tensor=2"]
            + [
                "parallelism.tp_plan={model.model.layers.*.self_attn.qkv_proj: colwise, "
                "model.model.layers.*.self_attn.o_proj: rowwise}"
            ],
            [
                "model.model.layers.*.self_attn.qkv_proj 'colwise'",
                "the fused projection needs its own style, 'colwise_gather_output'",
            ],
        ),
        "lone_surrogate_in_a_chat_message": (
            [*chat, llama, f"data.path={p['surrogate']}"],
            [f"{p['surrogate']}:4", "lone surrogate"],
        ),
        "context2_on_mamba": (
            [*chat, f"model.path={p['mamba']}", two, "parallelism.context=2"]
            + ["data.packing=false"],
            ["parallelism.context", "MambaMixer"],
        ),
    }


@pytest.fixture(scope="module")
def runs(files):
    started = {
        name: start_app(TRAIN, [*overrides, f"hydra.run.dir={files['runs'] / name}"], REPO)
        for name, (overrides, _) in _cases(files).items()
    }
    return wait_all(started, timeout=600)


FILES = ("llama", "moe", "phi3", "mamba", "truncated", "chats", "surrogate", "runs")
CASES = list(_cases({name: Path(name) for name in FILES}))  # the ids, without building files


@pytest.mark.parametrize("case", CASES)
def test_refused_before_launch_with_one_error_line(case, files, runs):
    _, named = _cases(files)[case]
    proc = runs[case]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    described = f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2 and len(errors) == 1, described
    assert all(part in errors[0] for part in named), errors[0]
    assert "Traceback" not in proc.stderr and not errors[0].startswith("error: rank "), described
    assert not (files["runs"] / case).exists()  # refused before Hydra's directory was kept


def test_a_resume_names_every_lora_option_that_differs():
    """``lora_alpha`` and ``lora_dropout`` are compared with the checkpoint's too (before: only
    method, r and targets; a resume with another alpha trained on under another scale), the
    launcher's sentence and the ranks' load check naming each value on both sides."""
    import torch

    from lightning_3d.adapters import AdapterOptions
    from lightning_3d.adapters.checkpoint import adapter_mismatch, check_adapter_checkpoint

    saved = AdapterOptions(method="lora", lora_alpha=16, lora_dropout=0.0)
    mine = AdapterOptions(method="lora", lora_alpha=32, lora_dropout=0.1)
    message = adapter_mismatch(saved, mine)
    assert message is not None
    assert "lora_alpha 16 in the checkpoint, 32 in this run" in message, message
    assert "lora_dropout 0 in the checkpoint, 0.1 in this run" in message, message
    assert "model.adapter.lora_alpha=16 model.adapter.lora_dropout=0.0" in message, message
    assert "r 8" not in message  # what agrees is not listed
    assert adapter_mismatch(saved, AdapterOptions(method="lora", lora_alpha=16.0)) is None

    class Module(torch.nn.Module):
        adapter = mine

    with pytest.raises(ValueError, match="lora_alpha 16 in the checkpoint, 32 in this run"):
        check_adapter_checkpoint(Module(), {"adapter": saved.as_dict(), "state_dict": None})
