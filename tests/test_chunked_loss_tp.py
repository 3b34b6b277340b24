"""The chunked head and loss under tensor parallelism (``parallel/chunked_loss_tp.py``) against
one process with whole logits: the same losses and the same update of every weight (SGD, so a
gradient off by a uniform factor shows), with the vocabulary sharded over tp and no rank holding
a token's whole logits.

Each test names the broken engine it catches; each was seen failing with the bugs planted:
the hidden states' gradient not summed over tp (``grad_placements=[Replicate()]``: every parity
test, through its updates or the replica check), every rank taking its rows for the first
vocabulary rows (offset 0: every parity test), the sums of exponentials not all-reduced (the
sharded unit test, the tp2+sp Qwen2 test), the row maxima not all-reduced (the sharded unit
test), and the planner keeping tensor
parallel layouts off the chunked loss or counting a chunk's whole vocabulary (the kit test, the
unit test's count), a host copy of the row maxima before their all-reduce (the device-guard
test).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tools.harness.world import run_world

# An odd vocabulary: tp2 splits it 19 / 18 (torch's Shard), so the owner of a target and the
# offset of rank 1's rows are both exercised.
VOCAB, WIDTH, TOKENS = 37, 8, 24


def _case(dtype=torch.float64):
    """Hidden states, a head with a bias, targets with uneven ignored positions (-100)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, TOKENS // 2, WIDTH, generator=g, dtype=dtype)
    weight = torch.randn(VOCAB, WIDTH, generator=g, dtype=dtype)
    bias = torch.randn(VOCAB, generator=g, dtype=dtype)
    targets = torch.randint(VOCAB, (2, TOKENS // 2), generator=g)
    targets[0, :7] = -100  # chat labels: the prompt is not trained
    targets[1, 3] = -100
    targets[1, 5] = VOCAB - 1  # the last row of the last rank's shard
    targets[1, 6] = 18  # the last row of rank 0's shard
    targets[1, 7] = 19  # the first row of rank 1's
    return hidden, weight, bias, targets


def _whole(hidden, weight, bias, targets):
    """One process: whole logits and ``F.cross_entropy``'s mean, and its gradients."""
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss = F.cross_entropy(F.linear(h, w, b).flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), h.grad, w.grad, b.grad


def _sharded(rank: int, sequence_parallel: bool, chunks: int) -> dict:
    """The chunked loss of :func:`_case` on a tp2 mesh: the head's weight and bias sharded on the
    vocabulary as the tensor plans shard them, the hidden states replicated (or, with sequence
    parallelism, sharded on the sequence), under the device guard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_3d.parallel.chunked_loss import chunked_cross_entropy
    from support.device_guard import DeviceGuard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    hidden, weight, bias, targets = _case()
    w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(bias, mesh, [Shard(0)]).requires_grad_()
    placement = Shard(1) if sequence_parallel else Replicate()
    h = distribute_tensor(hidden, mesh, [placement]).requires_grad_()
    with DeviceGuard() as guard, _Shapes() as made:
        loss = chunked_cross_entropy(
            h if sequence_parallel else h.to_local(), w, targets, chunks, b
        )
        loss.backward()
    grad_h = h.grad.full_tensor() if sequence_parallel else h.grad.to_local()
    # A weight sharded over data ranks (ZeRO-3 between gathers) is no vocabulary split: refused.
    data = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    on_data = distribute_tensor(weight, data, [Shard(0)])
    try:
        chunked_cross_entropy(hidden, on_data, targets, chunks)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "refused": refused,
        "loss": loss.detach(),
        "grads": (grad_h, w.grad.full_tensor(), b.grad.full_tensor()),
        "local_rows": w.to_local().shape[0],
        "shapes": made.shapes,
        "violations": [str(v) for v in guard.violations],
    }


class _Shapes(TorchDispatchMode):
    """The shape of every plain tensor an op made inside (a DTensor's shape is the whole one;
    its local tensors, what memory holds, are seen as its ops run on them)."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2+sp"])
def test_vocabulary_sharded_chunks_give_whole_logits_value_and_gradients(sequence_parallel):
    """Loss, hidden-state, weight and bias gradients of 5 chunks of 24 tokens on two tp ranks
    (37 rows: 19 and 18) equal one process's whole logits, on both ranks; the collectives take
    device tensors only. Catches an h-gradient left partial (not summed over tp), a target
    logit from the wrong rank, a log-sum-exp over one rank's columns, a wrong row offset."""
    from lightning_3d.planner.activations import head_loss_bytes

    expected = _whole(*_case())
    ranks = run_world(_sharded, 2, sequence_parallel, 5)
    assert [r["local_rows"] for r in ranks] == [19, 18]
    names = ("hidden", "weight", "bias")
    for rank, result in enumerate(ranks):
        assert not result["violations"], "\n".join(result["violations"])
        assert "on mesh axes ('dp',)" in result["refused"], result["refused"]
        # No tensor spans the vocabulary; the largest logits are one chunk's of this rank's rows:
        # what the planner counts per rank (its chunked head term less the hidden states'
        # gradient, over the logits' 4 + 4 + 4 bytes: rows x V / tp), within the uneven split.
        assert not [s for s in result["shapes"] if VOCAB in s], result["shapes"]
        rows = result["local_rows"]
        per_token = [s for s in result["shapes"] if len(s) == 2 and s[1] == rows]
        # (tokens, V/tp): logits and their gradient; (WIDTH, V/tp) is the weight's gradient.
        logits = max(s[0] * s[1] for s in per_token if s[0] != WIDTH)
        assert logits == -(-TOKENS // 5) * rows
        counted = (head_loss_bytes(TOKENS, VOCAB, WIDTH, 4, 5, 2) - TOKENS * WIDTH * 4) / 12
        assert logits == pytest.approx(counted, rel=0.05)
        torch.testing.assert_close(result["loss"], expected[0], msg=f"rank {rank}: loss")
        for name, got, want in zip(names, result["grads"], expected[1:]):
            torch.testing.assert_close(got, want, msg=f"rank {rank}: {name} gradient")


# ---------------------------------------------------------------- against one process, gloo
STEPS = 3
BLOCK = 48


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    pytest.importorskip("transformers")
    from support.chat_files import write_chat_files

    return write_chat_files(tmp_path_factory.mktemp("chat"))


def _mismatches(result: dict, expected: dict, only_adapters: bool = False) -> list[str]:
    from lightning_3d.adapters import is_adapter_name
    from tools.harness.parity import loss_mismatches, update_mismatches

    state = result["state"]
    if only_adapters:
        state = {k: v for k, v in state.items() if is_adapter_name(k)}
        assert state
    problems = loss_mismatches(result["losses"], expected["losses"], rtol=1e-5)
    problems += update_mismatches(state, expected["state"], expected["initial_state"], rtol=1e-4)
    return problems


def _chat_run(chat_files, arch="hf_qwen2", model=None, **changes):
    from tools.harness.runs import Run

    chat = {**chat_files, "block_size": BLOCK, "batch_size": 8, "packing": False}
    chat["val_fraction"] = 0.2
    model = {"optimizer": "sgd", "lr": 0.1, **(model or {})}
    return Run(arch=arch, steps=STEPS, data={"chat": chat}, model=model, **changes)


_REFERENCES: dict = {}


def _hf_matches_one_process(chat_files, strategy, world, model=None, only_adapters=False):
    """Chat rows (prompts ignored, -100) of tiny Qwen2 (head tied to the embedding; or the
    strategy's ``arch``) under ``strategy`` with the chunked loss, against one process with
    whole logits."""
    from tools.harness.runs import fit_gpt

    strategy = dict(strategy)
    arch = strategy.pop("arch", "hf_qwen2")
    key = (repr(model), arch)
    if key not in _REFERENCES:
        _REFERENCES[key] = fit_gpt(0, _chat_run(chat_files, arch, model=model))
    run = _chat_run(chat_files, arch, model=model, strategy=strategy, devices=world)
    result = run_world(fit_gpt, world, run)[0]
    problems = _mismatches(result, _REFERENCES[key], only_adapters)
    assert not problems, f"{strategy}:\n  " + "\n  ".join(problems)


def test_hf_tied_head_at_tp2_with_sequence_parallelism_matches_one_process(chat_files):
    """Tiny Qwen2 at tp2 with sequence parallelism and ``loss_chunks=3``: the head's input taken
    from the model's own forward (gathered over tp by the head's plan), the tied weight's
    gradient from both the embedding and the chunked head. Catches an h-gradient not summed
    over tp (every update below the head differs) and a wrong target owner (the losses differ)."""
    strategy = {"tensor": 2, "sequence_parallel": True, "loss_chunks": 3}
    _hf_matches_one_process(chat_files, strategy, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, world, strategy",
    [
        ("tp2", 2, {"tensor": 2, "loss_chunks": 4}),
        # Two data ranks with different numbers of answer tokens: the token mean over dp.
        ("dp2 x tp2", 4, {"data": 2, "tensor": 2, "zero_stage": 1, "loss_chunks": 3}),
        # FSDP2 over tp: the head's weight read after the model's forward, gathered.
        ("dp2 x tp2 zero3", 4, {"data": 2, "tensor": 2, "zero_stage": 3, "loss_chunks": 3}),
        # The token mean over data x context: each cp rank's share of every sequence.
        ("cp2 x tp2", 4, {"context": 2, "tensor": 2, "loss_chunks": 4}),
        # The last stage's loss is the chunked head (models/hf_pipeline.py); Llama: untied.
        ("pp2 x tp2", 4, {"pipeline": 2, "tensor": 2, "loss_chunks": 3, "arch": "hf_llama"}),
    ],
)
def test_hf_layouts_at_tp2_match_one_process(chat_files, name, world, strategy):
    _hf_matches_one_process(chat_files, strategy, world)


@pytest.mark.slow
def test_hf_lora_at_tp2_with_a_plain_head_matches_one_process(chat_files):
    """LoRA on attention, the head frozen and not adapted: no weight gradient, the hidden
    states' gradient still summed over tp; the adapters' updates match."""
    lora = {"method": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    strategy = {"tensor": 2, "loss_chunks": 3}
    _hf_matches_one_process(chat_files, strategy, 2, {"adapter": lora}, only_adapters=True)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2+sp"])
def test_reference_gpt_at_tp2_matches_one_process(sequence_parallel):
    """LitGPT at tp2 (its norm's output replicated, or sequence-sharded and gathered here)."""
    from tools.harness.runs import Run, fit_gpt

    model = {"optimizer": "sgd", "lr": 0.1}
    expected = fit_gpt(0, Run(steps=STEPS, model=model))
    strategy = {"tensor": 2, "sequence_parallel": sequence_parallel, "loss_chunks": 5}
    result = run_world(fit_gpt, 2, Run(steps=STEPS, model=model, strategy=strategy, devices=2))[0]
    problems = _mismatches(result, expected)
    assert not problems, f"{strategy}:\n  " + "\n  ".join(problems)


# ---------------------------------------------------------------- the planner
def test_the_kit_ladder_chunks_the_loss_under_tensor_parallelism():
    """At tp2 the planner counts the chunked head per rank (a chunk's rows x V / tp) and the kit's
    first rung is the chunked loss at ``ceil(ceil(V / tp) / H)`` chunks: a tp2 layout that only
    fits with it climbs to it. Catches a planner that keeps tp layouts off the chunked loss or
    counts a chunk's logits over the whole vocabulary."""
    from dataclasses import replace

    from lightning_3d.models import LitGPT
    from lightning_3d.parallel.chunked_loss import auto_chunks
    from lightning_3d.planner.activations import head_loss_bytes
    from lightning_3d.planner.choice import MEMORY_KIT, Choice, PlannerOptions
    from lightning_3d.planner.facts import model_facts
    from lightning_3d.planner.kit import climb, kit_rungs
    from lightning_3d.planner.memory import rank_memory

    vocab, width, seq, batch = 512, 64, 256, 8
    with torch.device("meta"):
        module = LitGPT(vocab_size=vocab, block_size=seq, n_layer=4, n_head=2, n_embd=width)
    facts = model_facts(module, precision="bf16-mixed", tp_sizes=(1, 2), policies=("none",))
    opts = PlannerOptions(
        batch_size=batch,
        zero_stages=(0,),
        ac_policies=("none",),
        offloads=("none",),
        reserve_gb=0.0,
        max_micro_batches=1,
        memory_kit=MEMORY_KIT,
    )
    tp2 = Choice(1, 2, 1, batch_per_rank=batch)
    chunks = auto_chunks(vocab, width, 2)
    assert chunks == 4 and kit_rungs(tp2, facts, opts)[0].loss_chunks == chunks
    whole = rank_memory(facts, tp2, opts).total
    chunked = rank_memory(facts, replace(tp2, loss_chunks=chunks), opts).total
    act, tokens = facts.bytes[3], seq * batch
    drop = head_loss_bytes(tokens, vocab, width, act, 1, 2)
    drop -= head_loss_bytes(tokens, vocab, width, act, chunks, 2)
    assert whole - chunked == pytest.approx(drop) and drop > 0
    rows = -(-tokens // chunks)
    assert head_loss_bytes(tokens, vocab, width, act, chunks, 2) == pytest.approx(
        rows * vocab / 2 * (2 * act + 4) + tokens * width * act
    )
    climbed, memory = climb(tp2, facts, opts, chunked + 1, lambda choice: True)
    assert climbed.loss_chunks == chunks and climbed.tensor == 2
    assert memory.total == pytest.approx(chunked)


@pytest.mark.slow
def test_reference_gpt_at_pp2_x_tp2_with_sequence_parallelism_matches_one_process():
    """Four ranks: the last pipeline stage ends at the norm (its output sequence-sharded) and its
    loss is the vocabulary-parallel chunked head."""
    from tools.harness.runs import Run, fit_gpt

    model = {"optimizer": "sgd", "lr": 0.1}
    expected = fit_gpt(0, Run(steps=STEPS, model=model))
    strategy = {"pipeline": 2, "tensor": 2, "sequence_parallel": True, "loss_chunks": 3}
    result = run_world(fit_gpt, 4, Run(steps=STEPS, model=model, strategy=strategy, devices=4))[0]
    problems = _mismatches(result, expected)
    assert not problems, f"{strategy}:\n  " + "\n  ".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt", "hf_llama"])
def test_a_tp2_sp_step_with_the_chunked_loss_is_device_faithful(arch):
    """Under the device guard (``tests/test_device_faithful.py``): every collective of a tp2 +
    sequence-parallel fit with the chunked loss takes device tensors only."""
    from support.guarded_runs import guarded_fit
    from tools.harness.runs import Run

    strategy = {"tensor": 2, "sequence_parallel": True, "loss_chunks": 3}
    for rank, result in enumerate(
        run_world(guarded_fit, 2, Run(arch=arch, strategy=strategy, devices=2, steps=2))
    ):
        assert not result["violations"], f"rank {rank}:\n" + "\n".join(result["violations"])
        assert result["collectives"], "the guard saw no collective"


@pytest.mark.slow
def test_tied_hf_model_at_pp2_x_tp2_is_refused_with_its_reason(chat_files):
    """Qwen2's tied embedding and head on two stages under tp2: the tie groups are built (one per
    tensor coordinate, read off every mesh axis after the pipeline's: a 3-axis reading crashed
    with ``int()`` of a row of ranks), then the plan's different splits of the two copies are
    refused by name."""
    with pytest.raises(RuntimeError, match=r"tied parameters model.model.embed_tokens.weight"):
        _hf_matches_one_process(chat_files, {"pipeline": 2, "tensor": 2, "loss_chunks": 3}, 4)
