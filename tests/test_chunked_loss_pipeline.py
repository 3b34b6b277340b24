"""The chunked loss on a pipeline's last stage: Hugging Face models, and under ZeRO-3.

With ``loss_chunks`` > 1 a pipeline's last stage ends at the final norm and the pipeline's loss
runs the head and cross-entropy by chunks of tokens (``models/hf_pipeline.py`` for a
``transformers`` model, ``LitGPT.pipeline_spec`` for the reference GPT). Under ZeRO-3 the last
stage's outer unit stays gathered after its forward (``parallel/fsdp.py``
``keep_head_gathered``), so the loss reads the head's whole weight and its gradient is
reduce-scattered with the unit's others.

Each run is checked against one process with whole logits (SGD, same seed): the same losses
and the same update of every tensor. The rows are chat rows whose prompts are ``-100``: the two
micro-batches of a step hold different numbers of trained tokens, so only the global token mean
gives one process's loss.
"""

from __future__ import annotations

import pytest
import torch

STEPS = 3
BLOCK = 48
_REFERENCES: dict = {}


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    pytest.importorskip("transformers")
    from support.chat_files import write_chat_files

    return write_chat_files(tmp_path_factory.mktemp("chat"))


def _run(chat_files, arch, hf=None, **changes):
    """A run of ``arch`` (``hf``: keys of the tiny transformers config changed)."""
    from tools.harness.runs import Run

    if arch == "gpt":  # the reference GPT on the embedded text (no ignored targets)
        return Run(steps=STEPS, model={"optimizer": "sgd", "lr": 0.1}, **changes)
    chat = {**chat_files, "block_size": BLOCK, "batch_size": 8, "packing": False}
    chat["val_fraction"] = 0.2
    model = {"optimizer": "sgd", "lr": 0.1, **({"hf": hf} if hf else {})}
    return Run(arch=arch, steps=STEPS, data={"chat": chat}, model=model, **changes)


def _mismatches(chat_files, arch, strategy, world, hf=None):
    """What differs between ``strategy`` on ``world`` ranks and one process with whole logits."""
    from tools.harness.parity import loss_mismatches, update_mismatches
    from tools.harness.runs import fit_gpt
    from tools.harness.world import run_world

    key = (arch, repr(hf))
    if key not in _REFERENCES:
        _REFERENCES[key] = fit_gpt(0, _run(chat_files, arch, hf))
    expected = _REFERENCES[key]
    run = _run(chat_files, arch, hf, strategy=strategy, devices=world)
    result = run_world(fit_gpt, world, run)[0]
    assert set(result["state"]) == set(expected["state"])
    problems = loss_mismatches(result["losses"], expected["losses"], rtol=1e-5)
    problems += update_mismatches(
        result["state"], expected["state"], expected["initial_state"], rtol=1e-4
    )
    return problems


def _assert_matches(chat_files, arch, strategy, world=2, hf=None):
    problems = _mismatches(chat_files, arch, strategy, world, hf)
    assert not problems, f"{arch} {strategy} differs from one process:\n  " + "\n  ".join(problems)


def test_tied_hf_model_at_pp2_dp2_zero3_with_the_chunked_loss_matches_one_process(chat_files):
    """Four ranks, Qwen2 (its head tied to its embedding: a copy per stage, gradients summed)
    at pipeline=2 x data=2 under ZeRO-3: the last stage ends at the norm and the loss reads the
    head's weight gathered over the two data ranks; its gradient is reduce-scattered. Fails
    (every update off by 20-100 %) where FSDP2 reshards the head before the loss, since the
    loss then reads a data rank's shard; and where the micro-batches' means are averaged
    instead of the step's token mean."""
    strategy = {"pipeline": 2, "data": 2, "zero_stage": 3, "loss_chunks": 3}
    _assert_matches(chat_files, "hf_qwen2", strategy, world=4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, strategy, world",
    [
        ("hf_llama", {"pipeline": 2, "loss_chunks": 3}, 2),
        ("hf_qwen2", {"pipeline": 2, "zero_stage": 1, "loss_chunks": 4}, 2),
        ("hf_qwen2", {"pipeline": 2, "zero_stage": 3, "loss_chunks": 3}, 2),
        ("gpt", {"pipeline": 2, "zero_stage": 3, "loss_chunks": 5}, 2),
        ("gpt", {"pipeline": 2, "data": 2, "zero_stage": 3, "loss_chunks": 3}, 4),
        ("hf_qwen2", {"pipeline": 2, "schedule": "interleaved_1f1b", "zero_stage": 3}, 2),
    ],
)
def test_pipelines_with_the_chunked_loss_match_one_process(chat_files, arch, strategy, world):
    """Llama (untied head) at pipeline=2; tied Qwen2 with ZeRO-1's buckets, under ZeRO-3, and
    4 layers in two stages per rank (interleaved 1F1B, ZeRO-3); the reference GPT's last stage
    under ZeRO-3, alone and over two data ranks."""
    interleaved = strategy.get("schedule") == "interleaved_1f1b"
    strategy = {"loss_chunks": 3, **strategy}
    hf = {"num_hidden_layers": 4} if interleaved else None
    _assert_matches(chat_files, arch, strategy, world, hf)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt", "hf_llama"])
def test_evaluation_under_a_chunked_pipeline_matches_one_process(chat_files, arch):
    """Validation and test after training at pipeline=2 with the chunked loss: the forward-only
    schedule's last stage ends at the logits, which the module's own step reads (the reference
    GPT's predictions too). Fails where that stage still ends at the norm (the step reads
    hidden states as logits, or the reference GPT's step runs its split model)."""
    from tools.harness.runs import fit_gpt
    from tools.harness.world import run_world

    expected = fit_gpt(0, _run(chat_files, arch, validate=True))
    strategy = {"pipeline": 2, "loss_chunks": 3}
    run = _run(chat_files, arch, validate=True, strategy=strategy, devices=2)
    result = run_world(fit_gpt, 2, run)[0]
    for key in ("val", "test"):
        for name, value in expected[key].items():
            assert result[key][name] == pytest.approx(value, rel=1e-5), (key, name)
    if arch == "gpt":
        assert torch.equal(result["predictions"], expected["predictions"])


def test_the_chunked_pipeline_stage_ends_at_the_norm_in_training_only():
    """In one process, a tiny Llama split into two stages: with autograd the last stage returns
    the head's input (B, T, D) and the spec's loss gives the whole-logits loss and gradients
    from it; without autograd (validation, predict) the stage still returns the logits."""
    pytest.importorskip("transformers")
    import copy

    import torch.nn.functional as F

    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.parallel.stages import split_stages
    from tools.harness.hf_configs import tiny_hf_config

    torch.manual_seed(0)
    lit = HFCausalLM(config=tiny_hf_config("llama"))
    lit.load_weights()
    lit.loss_chunks = 3
    vocab = lit.model.config.vocab_size
    ids, targets = torch.randint(3, vocab, (2, 12)), torch.randint(vocab, (2, 12))
    targets[0, :5] = -100
    whole = lit.model(input_ids=ids).logits
    F.cross_entropy(whole.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    copies = [copy.deepcopy(lit) for _ in range(2)]
    specs = [c.pipeline_spec() for c in copies]
    stages = [split_stages(c, spec, r, 2, 1)[0] for r, (c, spec) in enumerate(zip(copies, specs))]
    hidden = stages[1](stages[0](ids))
    assert hidden.shape == (2, 12, lit.model.config.hidden_size)
    loss = specs[1].loss(hidden, targets)
    loss.backward()
    expected = F.cross_entropy(whole.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    head, head_copy = lit.model.lm_head.weight, copies[1].model.lm_head.weight
    torch.testing.assert_close(head_copy.grad, head.grad, rtol=1e-4, atol=1e-6)
    first, first_copy = lit.model.model.layers[0], copies[0].model.model.layers[0]
    grad = first.self_attn.q_proj.weight.grad
    torch.testing.assert_close(first_copy.self_attn.q_proj.weight.grad, grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        logits = stages[1](stages[0](ids))
    torch.testing.assert_close(logits, whole.detach(), rtol=1e-4, atol=1e-5)


def test_the_planner_takes_and_counts_chunked_pipelines_under_zero3():
    """The layout search on four devices with ``loss_chunks``: the pipeline=2 x data=2 ZeRO-3
    layouts of the reference GPT and of a Hugging Face model pass the plan check (both were
    refused before), and their last stage counts one chunk's logits and the head held gathered
    in the compute dtype (``parallel/fsdp.py`` keeps it so for the loss)."""
    pytest.importorskip("transformers")
    import functools

    from lightning_3d.models import LitGPT
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.options.model_check import check
    from lightning_3d.planner import Cluster, PlannerOptions, plan_layouts
    from lightning_3d.planner.facts import model_facts
    from lightning_3d.planner.memory import buffer_bytes, rank_memory
    from tools.harness.hf_configs import tiny_hf_config

    with torch.device("meta"):
        gpt = LitGPT(vocab_size=512, block_size=64, n_layer=4, n_head=2, n_embd=32)
        qwen = HFCausalLM(config=tiny_hf_config("qwen2", num_hidden_layers=4))
    cluster = Cluster(nodes=1, devices_per_node=4, device_memory_gb=1e3)
    opts = PlannerOptions(
        batch_size=8, zero_stages=(3,), ac_policies=("none",), offloads=("none",),
        loss_chunks=4, sequence_parallel=False,
    )  # fmt: skip
    for module in (gpt, qwen):
        facts = model_facts(module, precision="bf16-mixed", policies=("none",), name="pp-chunks")
        found = plan_layouts(facts, cluster, opts, check=functools.partial(check, module))
        pp = [c for c in found if c.choice.pipeline == 2 and c.choice.data == 2]
        assert pp and all(c.fits for c in pp), [(c.choice.label(), c.reason) for c in pp]
        choice = pp[0].choice
        assert choice.loss_chunks == 4 and choice.zero_stage == 3
        memory = rank_memory(facts, choice, opts)
        assert memory.stage == 1  # the last stage is the largest: head, logits
        # Beside the buffers every layout has: the stage held gathered, the head whole in bf16.
        held = memory.buffers - buffer_bytes(facts, choice, opts)
        assert held >= facts.last.local(1) * 2
