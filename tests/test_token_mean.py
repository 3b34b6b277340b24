"""One objective in every layout: on chat rows, where only the answers have targets and each
rank, micro-batch and accumulation step holds a different number of them, every layout trains
on the token mean over the whole global batch, as one process does with that batch: the same
logged losses and the same update of every weight (LoRA: every adapter), tensor by tensor.

The failure these catch (each seen on the code before ``parallel/objective.py``): a data rank's
loss was the mean over its own answer tokens and the ranks' gradients then averaged, a
pipeline's the mean of its micro-batches' means, an accumulated step the mean of its
micro-batches' means: at the first step 6.198 at dp2 against one process's 6.232, and after a
few steps weights apart by far more than float error. ``SGD`` without clipping: a uniform scale
of the gradient cannot hide (AdamW would normalise most of it away)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from tools.harness.parity import loss_mismatches, update_mismatches  # noqa: E402
from tools.harness.runs import Run, fit_gpt  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

STEPS = 3
BLOCK = 48
LORA = {"method": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    from support.chat_files import write_chat_files

    return write_chat_files(tmp_path_factory.mktemp("chat"))


def chat_run(chat_files, batch_size=8, model=None, **changes) -> Run:
    chat = {**chat_files, "block_size": BLOCK, "batch_size": batch_size, "packing": False}
    chat["val_fraction"] = 0.2
    model = {"optimizer": "sgd", "lr": 0.1, **(model or {})}
    return Run(arch="hf_llama", steps=STEPS, data={"chat": chat}, model=model, **changes)


_REFERENCES: dict = {}


def reference(chat_files, model=None) -> dict:
    """One process, the whole global batch of 8 rows in one step."""
    key = repr(model)
    if key not in _REFERENCES:
        _REFERENCES[key] = fit_gpt(0, chat_run(chat_files, model=model))
    return _REFERENCES[key]


def assert_one_objective(result: dict, expected: dict, rtol: float = 1e-4) -> None:
    problems = loss_mismatches(result["losses"], expected["losses"], rtol=1e-5)
    problems += update_mismatches(
        result["state"], expected["state"], expected["initial_state"], rtol=rtol
    )
    assert not problems, "differs from one process on the global batch:\n  " + "\n  ".join(problems)


def test_answer_counts_differ_between_ranks_and_micro_batches(chat_files):
    """The premise: the two data ranks' rows (and a row's halves) hold different numbers of
    answer tokens, so a mean of means differs from the token mean."""
    from lightning_3d.data import ChatDataModule
    from lightning_3d.data.labels import IGNORE_INDEX

    chat = {**chat_files, "block_size": BLOCK, "batch_size": 8, "packing": False}
    chat["val_fraction"] = 0.2
    data = ChatDataModule(seed=1234, **chat)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    counted = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
    assert counted[:4].sum() != counted[4:].sum()
    assert counted[0::2].sum() != counted[1::2].sum()


@pytest.mark.parametrize(
    "name, world, strategy",
    [
        ("dp2_zero1", 2, {"data": 2, "zero_stage": 1}),
        ("dp2_zero3", 2, {"data": 2, "zero_stage": 3}),
        ("pp2", 2, {"pipeline": 2}),
    ],
)
def test_layouts_train_the_token_mean_of_the_global_batch(chat_files, name, world, strategy):
    expected = reference(chat_files)
    ranks = run_world(fit_gpt, world, chat_run(chat_files, strategy=strategy, devices=world))
    assert_one_objective(ranks[0], expected)


@pytest.mark.parametrize("strategy", [{}, {"data": 2, "zero_stage": 2}, {"pipeline": 2}])
def test_accumulated_steps_train_the_token_mean_of_the_whole_step(chat_files, strategy):
    """Accumulation 2 of 4 rows (on one device, on two data ranks of 2 rows each, and through a
    pipeline of 2 micro-batches each: 4 losses a step, on the last stage only, whose factor the
    first stage takes from the broadcast) against one step of 8 rows: Lightning divides each
    micro-batch's loss by 2, which weighs the rows of the micro-batch with fewer answer tokens
    more."""
    expected = reference(chat_files)
    world = 2 if strategy else 1
    run = chat_run(
        chat_files,
        batch_size=4,
        strategy=strategy,
        devices=world,
        trainer={"accumulate_grad_batches": 2},
    )
    run = dataclasses.replace(run, steps=STEPS)
    result = run_world(fit_gpt, world, run)[0]
    assert_one_objective(result, expected)


def test_lora_at_dp2_zero3_trains_the_token_mean_of_the_global_batch(chat_files):
    from lightning_3d.adapters import is_adapter_name

    expected = reference(chat_files, model={"adapter": LORA})
    run = chat_run(
        chat_files, model={"adapter": LORA}, strategy={"data": 2, "zero_stage": 3}, devices=2
    )
    result = run_world(fit_gpt, 2, run)[0]
    adapters = {k: v for k, v in result["state"].items() if is_adapter_name(k)}
    assert adapters
    problems = loss_mismatches(result["losses"], expected["losses"], rtol=1e-5)
    problems += update_mismatches(adapters, expected["state"], expected["initial_state"], rtol=1e-4)
    assert not problems, "\n  ".join(problems)


def test_a_step_with_two_losses_weighs_each_by_its_own_tokens():
    """Two ``F.cross_entropy`` calls in one step (two heads): no shared factor, each call the
    token mean of its own targets; on one process that is plain ``F.cross_entropy``."""
    import torch.nn.functional as F

    from lightning_3d.parallel.objective import TokenMean

    logits = torch.randn(6, 5, requires_grad=True)
    first, second = torch.tensor([0, 1, -100, 2, 3, 4]), torch.tensor([-100, -100, 1, 2, 3, 4])
    objective = TokenMean()
    objective.begin(window=True)
    with objective.training():
        loss = F.cross_entropy(logits, first) + F.cross_entropy(logits, second)
    expected = F.cross_entropy(logits, first) + F.cross_entropy(logits, second)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logits)
    (want,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(grad, want, atol=1e-7)
    assert objective.factor(divisor=2) is None


def test_accumulated_micro_batches_add_up_to_the_step_token_mean():
    """Two micro-batches of 5 and 2 counted targets, each loss divided by 2 (as Lightning does)
    and the sum scaled by ``factor``: the gradient of one mean over all 7; the value returned at
    the last micro-batch is that mean."""
    import torch.nn.functional as F

    from lightning_3d.parallel.objective import TokenMean

    logits = torch.randn(12, 5, requires_grad=True)
    targets = torch.tensor([0, 1, 2, 3, 4, -100, 1, -100, -100, -100, 2, -100])
    objective = TokenMean()
    total = torch.zeros(())
    for window, part in ((True, slice(0, 6)), (False, slice(6, 12))):
        objective.begin(window=window)
        with objective.training():
            loss = F.cross_entropy(logits[part], targets[part])
        total = total + loss / 2
    (grad,) = torch.autograd.grad(total, logits)
    grad = grad * objective.factor(divisor=2)
    expected = F.cross_entropy(logits, targets)
    (want,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(grad, want, atol=1e-7)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_qlora_at_dp2_zero1_trains_the_token_mean_of_the_global_batch(chat_files):
    """QLoRA (NF4 base, torchao) on chat rows, two data ranks against one process."""
    pytest.importorskip("torchao")
    from lightning_3d.adapters import is_adapter_name
    from support.qlora import WIDE

    model = {"adapter": {"method": "qlora", "r": 4, "lora_alpha": 8}, "hf": WIDE}
    expected = reference(chat_files, model=model)
    run = chat_run(chat_files, model=model, strategy={"data": 2, "zero_stage": 1}, devices=2)
    result = run_world(fit_gpt, 2, run)[0]
    adapters = {k: v for k, v in result["state"].items() if is_adapter_name(k)}
    assert adapters
    problems = loss_mismatches(result["losses"], expected["losses"], rtol=1e-5)
    problems += update_mismatches(adapters, expected["state"], expected["initial_state"], rtol=1e-4)
    assert not problems, "\n  ".join(problems)
