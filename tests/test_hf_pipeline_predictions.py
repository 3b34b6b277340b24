"""Predictions of a ``transformers`` model on right-padded chat rows, pipeline against one process.

Two differences were found, each seen failing this file's pipeline test:

* A pipeline's stages see no attention mask (``models/hf_pipeline.py``: every layer gets the
  model's causal mask), so a padded position attends to the padding before it there and only to
  the conversation in one process: its logits differ by layout. No real position does (right
  padding comes after every real token), so losses, updates, validation and test agreed; a
  padded position predicts nothing, and ``HFCausalLM.predict_step`` now says so with ``-100``.
  Before: 48 of the first predict batch's 384 tokens (12.5 %) differed at pipeline=2 (Llama),
  every one at a padded position.
* Lightning's predict keeps a last, partial batch (4 rows after 8 here); torch's stages had
  inferred the shapes they exchange from the first batch, and returned 8 rows of logits from
  stale receive buffers for it. ``PipelineRuntime.outputs`` now runs such a batch in pieces of
  the first shape (padded, cut back); a training batch of another shape is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from tools.harness.runs import Run

BLOCK = 48


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    pytest.importorskip("transformers")
    from support.chat_files import write_chat_files

    return write_chat_files(tmp_path_factory.mktemp("chat"))


def test_padded_positions_predict_nothing():
    """One process, a right-padded batch: ``-100`` where the attention mask is 0, the most likely
    next token everywhere else. Catches predictions at padding, which depend on the layout."""
    pytest.importorskip("transformers")
    from lightning_3d.data.labels import IGNORE_INDEX
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    torch.manual_seed(0)
    module = HFCausalLM(config=tiny_hf_config("llama"))
    ids = torch.randint(0, 64, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 6:] = 0  # right padding
    with torch.no_grad():
        got = module.predict_step({"input_ids": ids, "attention_mask": mask}, 0)
        expected = module.model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    assert torch.equal(got[mask.bool()], expected[mask.bool()])
    assert (got[0, 6:] == IGNORE_INDEX).all(), got


@pytest.mark.parametrize(
    "arch, strategy, world",
    [
        ("hf_llama", {"pipeline": 2}, 2),
        pytest.param("hf_qwen2", {"pipeline": 2}, 2, marks=pytest.mark.slow),
        # vocabulary-sharded logits (DTensors) cut back and joined
        pytest.param("hf_llama", {"pipeline": 2, "tensor": 2}, 4, marks=pytest.mark.slow),
    ],
    ids=["llama-pp2", "qwen2-pp2", "llama-pp2-tp2"],
)
def test_pipeline_on_padded_chat_rows_matches_one_process(chat_files, arch, strategy, world):
    """A pipeline against one process on chat rows (prompts ``-100``, one conversation a row,
    right padded), SGD, 2 steps: the losses, every tensor's update, validation and test losses,
    and every position of both predict batches (8 rows, then Lightning's partial 4)."""
    from tools.harness.parity import loss_mismatches, update_mismatches
    from tools.harness.runs import fit_gpt
    from tools.harness.world import run_world

    chat = {**chat_files, "block_size": BLOCK, "batch_size": 8, "packing": False}
    chat["val_fraction"] = 0.2
    common = dict(arch=arch, steps=2, data={"chat": chat}, validate=True)
    common["model"] = {"optimizer": "sgd", "lr": 0.1}
    one = fit_gpt(0, Run(**common))
    pp = run_world(fit_gpt, world, Run(**common, strategy=strategy, devices=world))[0]
    problems = loss_mismatches(pp["losses"], one["losses"], rtol=1e-5)
    problems += update_mismatches(pp["state"], one["state"], one["initial_state"], rtol=1e-4)
    assert not problems, "\n".join(problems)
    for key in ("val", "test"):
        for name, value in one[key].items():
            assert pp[key][name] == pytest.approx(value, rel=1e-5), (key, name)
    assert [p.shape for p in pp["all_predictions"]] == [(8, BLOCK), (4, BLOCK)]
    for got, expected in zip(pp["all_predictions"], one["all_predictions"]):
        differ = got != expected
        assert not differ.any(), f"{int(differ.sum())} of {differ.numel()} predictions differ"
    assert (one["predictions"] == -100).any()  # the rows were padded


def _runtime_after(first: tuple[int, ...]):
    """A ``PipelineRuntime`` whose schedule ran a first batch of inputs of shape ``first`` (no
    stages: the checks below run before any)."""
    from lightning_3d.parallel.pipeline import PipelineSpec
    from lightning_3d.parallel.pipeline_runtime import PipelineRuntime

    runtime = object.__new__(PipelineRuntime)
    runtime.micro_batches = 2
    runtime._first_shape = first
    runtime.spec = PipelineSpec(
        blocks="blocks",
        first=(),
        last=(),
        loss=lambda outputs, targets: outputs.sum(),
        stage_forward=lambda stage, x: x,
        split_batch=lambda batch: (batch, batch),
        inputs=lambda batch: batch,
    )
    return runtime


def test_a_batch_of_another_shape_is_refused_by_name_where_it_cannot_be_cut():
    """Training on a batch of another shape than the first (a partial last batch, rows padded
    to their longest) would run on receive buffers of the first one's: refused, both shapes
    named; so is an evaluation batch of longer rows (no piece of the first shape holds it)."""
    with pytest.raises(ValueError, match=r"training batch of inputs \(4, 48\) after batches of "):
        _runtime_after((8, 48)).run(torch.zeros(4, 48, dtype=torch.long))
    with pytest.raises(ValueError, match=r"evaluation batch of inputs \(8, 64\) after batches"):
        _runtime_after((8, 48)).outputs(torch.zeros(8, 64, dtype=torch.long))
