"""Sequence parallelism must save activation memory on Hugging Face blocks, not only move it.

Each column-parallel projection's input style gathers the sequence shard it is given, so a
plan that hands every projection the sharded stream gathers q, k and v's input three times
and gate and up's twice, and autograd saves each gathered copy: on a Llama block at tensor 2 the
bytes saved per token were the same with sequence parallelism as without (31.0 h each, ``h`` the
width). The translated plan gathers once per attention and once per MLP, as Megatron does: 25.0 h.
Measured with the planner's own meter (one rank of a fake world, no communication)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from lightning_3d.models.hf import HFCausalLM  # noqa: E402
from lightning_3d.planner.facts import model_facts  # noqa: E402

WIDTH, SEQ = 128, 64


def _llama() -> HFCausalLM:
    config = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=WIDTH,
        intermediate_size=336,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    with torch.device("meta"):
        return HFCausalLM(config=config)


def test_sequence_parallel_saves_the_gathered_stream_once():
    facts = model_facts(
        _llama(),
        seq_len=SEQ,
        precision="bf16-mixed",
        policies=("none",),
        tp_sizes=(1, 2),
        sequence_parallel=True,
    )
    per_token = {
        key: fit.bytes_per_sample(SEQ) / SEQ / WIDTH for key, fit in facts.activations.items()
    }
    whole, split, sequence = (
        per_token[("none", 1)],
        per_token[("none", 2)],
        per_token[("none", 2, "sp")],
    )
    assert split < whole
    # Norm inputs and outputs (6 h of fp32 and bf16 per norm) halve under sequence parallelism;
    # the one gathered input of attention and of the MLP (2 h each) stays whole.
    assert sequence < split - 4, (whole, split, sequence)
