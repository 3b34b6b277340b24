"""The chunked head and loss (``loss_chunks``, parallel/chunked_loss.py): the same losses and the
same update of every weight as whole logits and ``F.cross_entropy``, with no tensor of tokens x
vocabulary alive at once.

What these catch: a chunk's rows or ignored targets dropped or counted twice, a gradient of the
head's weight taken from the last chunk only, a loss that skips the objective (each rank's own
token mean: chat rows on two data ranks then train another objective, as tests/test_token_mean.py
shows), a tied or frozen head handled as a free one, and a model or layout that cannot chunk
accepted silently. ``SGD`` without clipping: a uniform scale of the gradient cannot hide."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_3d.parallel.chunked_loss import (
    ChunkedLossOptions,
    chunked_cross_entropy,
    chunked_loss_problems,
)
from lightning_3d.parallel.objective import TokenMean, token_mean


def _inputs(dtype=torch.float64, tied=False, frozen=False):
    torch.manual_seed(0)
    emb = torch.randn(50, 16, dtype=dtype, requires_grad=not frozen)
    ids = torch.randint(50, (3, 7))
    hidden = (emb[ids] * 0.5 + torch.randn(3, 7, 16, dtype=dtype)).detach().requires_grad_()
    weight = emb if tied else torch.randn(50, 16, dtype=dtype, requires_grad=not frozen)
    targets = torch.randint(50, (3, 7))
    targets[0, :3] = -100  # ignored positions (a chat row's prompt)
    targets[2, -1] = -100
    return emb, ids, hidden, weight, targets


@pytest.mark.parametrize("chunks", [1, 4, 7, 21, 40])
@pytest.mark.parametrize("head", ["free", "bias", "tied", "frozen"])
def test_chunks_give_the_value_and_gradients_of_whole_logits(chunks, head):
    """Chunk counts that divide the 21 tokens, do not, and exceed them; a bias; a head tied to
    an embedding that the hidden states also came from (both gradients summed in one
    parameter); a frozen head (no weight gradient made)."""
    emb, ids, _, weight, targets = _inputs(tied=head == "tied", frozen=head == "frozen")
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True) if head == "bias" else None
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    leaves = [t for t in (x, emb, weight, bias) if t is not None and t.requires_grad]
    leaves = list({id(t): t for t in leaves}.values())

    def grads(loss_of):
        hidden = torch.tanh(x + emb[ids])  # the head's input depends on the tied embedding too
        loss = loss_of(hidden)
        return loss, torch.autograd.grad(loss * 1.7, leaves)

    got, got_grads = grads(lambda h: chunked_cross_entropy(h, weight, targets, chunks, bias=bias))
    want, want_grads = grads(
        lambda h: F.cross_entropy(F.linear(h, weight, bias).flatten(0, 1), targets.flatten())
    )
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12)
    if head == "frozen":
        assert not weight.requires_grad and len(leaves) == 1


def test_no_tokens_by_vocabulary_tensor_exists():
    """Forward and backward of the reference GPT's chunked loss create no tensor as large as one
    chunk's logits times two; the whole-logits path does create the tokens x vocabulary one."""
    from lightning_3d.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=1, n_head=2, n_embd=16))
    idx, targets = torch.randint(512, (2, 64)), torch.randint(512, (2, 64))
    whole = 2 * 64 * 512

    def largest(chunks):
        model.loss_chunks = chunks
        with _Largest() as seen:
            model(idx, targets).backward()
        return seen.numel

    assert largest(1) >= whole
    assert largest(8) <= 2 * whole // 8


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op made inside."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_the_objective_sees_the_chunked_sum_and_count():
    """Inside a training step the chunked loss is what ``F.cross_entropy`` is there (the token
    mean of the whole step): two micro-batches of 5 and 2 counted targets, each loss divided by
    2 and the gradient scaled by ``factor``, give the gradient of one mean over all 7."""
    _, _, hidden, weight, _ = _inputs(dtype=torch.float32)
    hidden = hidden.flatten(0, 1)[:12].detach().requires_grad_()
    targets = torch.tensor([0, 1, 2, 3, 4, -100, 1, -100, -100, -100, 2, -100])
    objective = TokenMean()
    total = torch.zeros(())
    for window, part in ((True, slice(0, 6)), (False, slice(6, 12))):
        objective.begin(window=window)
        with objective.training():
            loss = chunked_cross_entropy(hidden[part], weight, targets[part], chunks=4)
        total = total + loss / 2
    (grad,) = torch.autograd.grad(total, hidden)
    grad = grad * objective.factor(divisor=2)
    expected = F.cross_entropy(F.linear(hidden, weight), targets)
    (want,) = torch.autograd.grad(expected, hidden)
    assert torch.allclose(grad, want, atol=1e-6)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert token_mean(torch.tensor(6.0), torch.tensor(0)).item() == 6.0  # no target: no NaN


def test_the_ignored_target_is_the_label_conventions():
    from lightning_3d.data.labels import IGNORE_INDEX
    from lightning_3d.parallel import chunked_loss

    assert chunked_loss.IGNORE_INDEX == IGNORE_INDEX


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loss_chunks": 0}, "loss_chunks=0 must be a whole number >= 1"),
        ({"loss_chunks": -2}, "loss_chunks=-2 must be a whole number >= 1"),
        ({"loss_chunks": True}, "loss_chunks=True must be a whole number >= 1"),
    ],
)
def test_bad_chunk_counts_are_refused_with_the_plan(options, message):
    from lightning_3d.options import Plan

    with pytest.raises(ValueError, match=message):
        Plan.from_options(**options)


def test_models_and_layouts_that_cannot_chunk_are_refused_before_launch():
    """On ``meta`` (the app's check before launch): a module with no splittable head, a
    soft-capped Hugging Face head; a pipeline, also under ZeRO-3, is not refused
    (tests/test_chunked_loss_pipeline.py)."""
    pytest.importorskip("transformers")
    import lightning.pytorch as pl

    from lightning_3d.layout import Layout
    from lightning_3d.models import LitGPT
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.options import Plan
    from lightning_3d.options.model_check import check

    class NoHead(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 4)

    with torch.device("meta"):
        no_head = NoHead()
    with pytest.raises(ValueError, match="loss_chunks=4: NoHead has no head that can be split"):
        check(no_head, Plan.from_options(loss_chunks=4), 1)
    check(no_head, Plan.from_options(loss_chunks=1), 1)  # nothing asked: nothing refused

    capped = HFCausalLM(
        config={
            "model_type": "gemma2",
            "vocab_size": 64,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "final_logit_softcapping": 30.0,
        }
    )
    problems = chunked_loss_problems(capped, ChunkedLossOptions(4), Layout(pipeline=2))
    assert any("final_logit_softcapping=30.0" in p for p in problems), problems
    assert not any("pipeline" in p for p in problems), problems
    gpt = LitGPT(n_layer=2, deferred_init=True)
    assert chunked_loss_problems(gpt, ChunkedLossOptions(4), Layout(pipeline=2)) == []
    assert chunked_loss_problems(gpt, ChunkedLossOptions(4), Layout(pipeline=2, zero_stage=3)) == []


def test_auto_chunks_by_vocabulary_over_width_where_the_chunked_loss_is_built():
    """``loss_chunks="auto"``: ``ceil(vocabulary / width)`` chunks (the reference GPT at 256 x 32:
    8, at tp2 of its 128 rows per rank: 4; a Hugging Face model at 64 x 16: 4; a vocabulary
    narrower than the model: 1), and whole logits, not a refusal, where a count would be refused
    (a soft-capped head). The fine-tune app's default."""
    pytest.importorskip("transformers")
    from omegaconf import OmegaConf

    from lightning_3d.app.config import CONF_DIR
    from lightning_3d.layout import Layout
    from lightning_3d.models import LitGPT
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.options import Plan
    from lightning_3d.parallel.chunked_loss import AUTO, apply_chunked_loss, auto_chunks

    assert (auto_chunks(256, 32), auto_chunks(128_256, 4096), auto_chunks(50, 64)) == (8, 32, 1)
    assert (auto_chunks(128_256, 4096, 2), auto_chunks(257, 32, 2)) == (16, 5)  # ceil(V/tp) / H
    assert Plan.from_options(loss_chunks="auto", tensor=2).loss.chunks == AUTO  # no refusal
    auto = ChunkedLossOptions(AUTO)

    def applied(module, layout):
        apply_chunked_loss(module, auto, layout)
        return [m.loss_chunks for _, m in module.named_modules() if hasattr(m, "loss_chunks")]

    gpt = LitGPT(n_layer=2, n_embd=32, n_head=2, vocab_size=256, deferred_init=True)
    assert applied(gpt, Layout()) == [8]
    assert applied(gpt, Layout(tensor=2)) == [4]
    hf = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    with torch.device("meta"):
        llama = HFCausalLM(config={"model_type": "llama", **hf})
        capped = HFCausalLM(config={"model_type": "gemma2", "final_logit_softcapping": 30.0, **hf})
    assert applied(llama, Layout()) == [4]
    assert applied(llama, Layout(pipeline=2)) == [4]  # the last stage ends at the norm
    assert applied(capped, Layout()) == [1]
    finetune = OmegaConf.load(CONF_DIR / "finetune.yaml")
    assert finetune.parallelism.loss_chunks == AUTO


def test_the_strategy_makes_the_model_chunk():
    """``ThreeDStrategy(loss_chunks=4)`` reaches the model: no op of the training step makes a
    tensor of the step's tokens x vocabulary (a strategy that dropped the option would)."""
    from tools.harness.world import run_world

    ((chunks, largest, whole),) = run_world(_fit_watched, 1)
    assert chunks == 4 and largest < whole


def _fit_watched(rank: int) -> tuple[int, int, int]:
    import tempfile

    import lightning.pytorch as pl

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import LitGPT

    seen = []

    class Watched(LitGPT):
        def training_step(self, batch, batch_idx):
            with _Largest() as largest:
                loss = super().training_step(batch, batch_idx)
            seen.append((largest.numel, batch[0].numel() * self.config.vocab_size))
            return loss

    torch.manual_seed(0)
    module = Watched(vocab_size=512, block_size=32, n_layer=1, n_head=2, n_embd=16)
    data = [(torch.randint(512, (4, 32)), torch.randint(512, (4, 32)))] * 2
    trainer = pl.Trainer(
        strategy=ThreeDStrategy(loss_chunks=4),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(),
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return module.model.loss_chunks, *seen[0]


# ---------------------------------------------------------------- against one process, gloo
STEPS = 3
BLOCK = 48
LORA = {"method": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    pytest.importorskip("transformers")
    from support.chat_files import write_chat_files

    return write_chat_files(tmp_path_factory.mktemp("chat"))


_REFERENCES: dict = {}


def _chat_run(chat_files, model=None, arch="hf_llama", batch_size=8, **changes):
    from tools.harness.runs import Run

    chat = {**chat_files, "block_size": BLOCK, "batch_size": batch_size, "packing": False}
    chat["val_fraction"] = 0.2
    model = {"optimizer": "sgd", "lr": 0.1, **(model or {})}
    return Run(arch=arch, steps=STEPS, data={"chat": chat}, model=model, **changes)


def _matches_one_process(
    chat_files, strategy, world, model=None, only_adapters=False, arch="hf_llama", **changes
):
    """Chat rows under ``strategy`` with the chunked loss against one process with whole logits
    on the global batch: the same losses and updates of every weight (or every adapter)."""
    from lightning_3d.adapters import is_adapter_name
    from tools.harness.parity import loss_mismatches, update_mismatches
    from tools.harness.runs import fit_gpt
    from tools.harness.world import run_world

    key = (repr(model), arch)
    if key not in _REFERENCES:
        _REFERENCES[key] = fit_gpt(0, _chat_run(chat_files, model=model, arch=arch))
    expected = _REFERENCES[key]
    run = _chat_run(chat_files, model=model, arch=arch, strategy=strategy, devices=world, **changes)
    result = run_world(fit_gpt, world, run)[0]
    state = result["state"]
    if only_adapters:
        state = {k: v for k, v in state.items() if is_adapter_name(k)}
        assert state
    problems = loss_mismatches(result["losses"], expected["losses"], rtol=1e-5)
    problems += update_mismatches(state, expected["state"], expected["initial_state"], rtol=1e-4)
    assert not problems, "differs from one process with whole logits:\n  " + "\n  ".join(problems)


def test_chat_rows_on_two_data_ranks_train_the_global_token_mean(chat_files):
    """The two data ranks hold different numbers of answer tokens: only the objective's global
    sum and count give one process's loss and update (Qwen2's head is tied to its embedding)."""
    strategy = {"data": 2, "zero_stage": 1, "loss_chunks": 3}
    _matches_one_process(chat_files, strategy, 2, arch="hf_qwen2")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, world, strategy",
    [
        ("zero3", 2, {"data": 2, "zero_stage": 3, "loss_chunks": 5}),
        ("cp2", 2, {"context": 2, "loss_chunks": 4}),
        ("accumulated", 1, {"loss_chunks": 2}),
    ],
)
def test_layouts_with_the_chunked_loss_match_one_process(chat_files, name, world, strategy):
    """ZeRO-3 (the head gathered inside the model's forward), context parallelism (the mean
    over dp x cp), two accumulated micro-batches of 4 rows (the step's factor)."""
    changes = {}
    if name == "accumulated":
        changes = {"batch_size": 4, "trainer": {"accumulate_grad_batches": 2}}
    _matches_one_process(chat_files, strategy, world, **changes)


@pytest.mark.slow
def test_lora_at_dp2_zero3_with_the_chunked_loss_matches_one_process(chat_files):
    """A frozen head (LoRA on attention): no weight gradient, the adapters' updates alike."""
    model = {"adapter": LORA}
    _matches_one_process(chat_files, {"data": 2, "zero_stage": 3, "loss_chunks": 3}, 2, model, True)


@pytest.mark.slow
def test_qlora_at_dp2_zero1_with_the_chunked_loss_matches_one_process(chat_files):
    pytest.importorskip("torchao")
    from support.qlora import WIDE

    model = {"adapter": {"method": "qlora", "r": 4, "lora_alpha": 8}, "hf": WIDE}
    _matches_one_process(chat_files, {"data": 2, "zero_stage": 1, "loss_chunks": 3}, 2, model, True)


@pytest.mark.slow
def test_reference_gpt_pipeline_ends_at_the_norm_and_matches_one_process():
    """LitGPT at pipeline=2 (the last stage's loss is the chunked head) and at dp2 ZeRO-3 (the
    head's weight gathered inside GPT's forward), against one process with whole logits."""
    from tools.harness.parity import loss_mismatches, update_mismatches
    from tools.harness.runs import Run, fit_gpt
    from tools.harness.world import run_world

    model = {"optimizer": "sgd", "lr": 0.1}
    expected = fit_gpt(0, Run(steps=STEPS, model=model))
    for strategy in (
        {"pipeline": 2, "loss_chunks": 5},
        {"data": 2, "zero_stage": 3, "loss_chunks": 3},
    ):
        result = run_world(fit_gpt, 2, Run(steps=STEPS, model=model, strategy=strategy, devices=2))[
            0
        ]
        problems = loss_mismatches(result["losses"], expected["losses"], rtol=1e-5)
        problems += update_mismatches(
            result["state"], expected["state"], expected["initial_state"], rtol=1e-4
        )
        assert not problems, f"{strategy}:\n  " + "\n  ".join(problems)


def test_the_planner_counts_one_chunk_of_logits():
    """The planner's head term: whole logits hold tokens x vocabulary twice over (the logits
    and their fp32 softmax); 16 chunks hold one chunk's, at 2,048 tokens of a 128k vocabulary
    at least 8x less; the choice passes the option on to the strategy."""
    from lightning_3d.planner.activations import head_loss_bytes
    from lightning_3d.planner.choice import Choice

    whole = head_loss_bytes(2048, 128256, 4096, 2)
    assert whole == 2048 * (128256 * (2 + 4) + 4096 * 2)
    chunked = head_loss_bytes(2048, 128256, 4096, 2, chunks=16)
    assert chunked == 128 * 128256 * (2 * 2 + 4) + 2048 * 4096 * 2
    assert whole / chunked >= 8
    assert head_loss_bytes(2048, 128256, 4096, 2, tensor=2) < whole
    assert Choice(data=1, tensor=1, pipeline=1, loss_chunks=16).options()["loss_chunks"] == 16
    assert "loss_chunks" not in Choice(data=1, tensor=1, pipeline=1).options()


def test_the_planner_memory_model_uses_the_chunked_head_term():
    """The last stage's activation bytes drop by the head term's difference, and only there."""
    from lightning_3d.models import LitGPT
    from lightning_3d.planner.activations import head_loss_bytes
    from lightning_3d.planner.choice import Choice
    from lightning_3d.planner.facts import model_facts
    from lightning_3d.planner.memory import activation_bytes

    with torch.device("meta"):
        module = LitGPT(vocab_size=4096, block_size=64, n_layer=2, n_head=2, n_embd=32)
    facts = model_facts(module, precision="32-true", policies=("none",), name="head")
    whole = activation_bytes(facts, Choice(1, 1, 1, batch_per_rank=2), 0, 2)
    chunked = activation_bytes(facts, Choice(1, 1, 1, batch_per_rank=2, loss_chunks=8), 0, 2)
    drop = head_loss_bytes(128, 4096, 32, 4) - head_loss_bytes(128, 4096, 32, 4, chunks=8)
    assert whole - chunked == pytest.approx(drop) and drop > 0


def test_auto_may_choose_tensor_parallel_layouts_with_the_chunked_loss():
    """``auto=True`` with ``loss_chunks`` > 1: tensor-parallel layouts stay open (the chunked loss
    is vocabulary-parallel there); the chosen plan keeps ``loss_chunks``."""
    from lightning_3d.options import Plan
    from lightning_3d.planner.choice import Choice
    from lightning_3d.strategy.auto import allowed, constraints, planned

    plan = Plan.from_options(auto=True, loss_chunks=4)
    fixed = constraints(plan)
    assert allowed(Choice(data=1, tensor=2, pipeline=1), fixed, 1)
    assert allowed(Choice(data=2, tensor=1, pipeline=1), fixed, 1)
    assert planned(plan, Choice(data=2, tensor=1, pipeline=1)).loss.chunks == 4
    assert planned(plan, Choice(data=1, tensor=2, pipeline=1)).loss.chunks == 4


def test_the_bench_counts_the_drop(tmp_path, capsys):
    """``python -m tools.bench.chunked_loss`` at a tiny size: the whole-logits peak holds the
    logits several times over, the chunked one a chunk's; bad sizes are one error."""
    import json

    from tools.bench import chunked_loss as bench

    out = tmp_path / "bench.json"
    argv = ["--tokens", "128", "--vocab", "1024", "--width", "16", "--chunks", "8"]
    result = bench.main([*argv, "--repeats", "1", "--out", str(out)])
    whole = result["rows"]["whole logits"]["peak_bytes"]
    assert whole >= 2 * 128 * 1024 * 4 and result["peak_drop"] > 4
    assert json.loads(out.read_text())["chunks"] == 8
    assert "peak drop" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--chunks", "0"])
    assert "sizes must be positive, got {'chunks': 0}" in capsys.readouterr().err
