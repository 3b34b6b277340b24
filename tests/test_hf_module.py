"""``HFCausalLM`` in one process: the three ways to build it, batch forms, padding, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from lightning_3d.models.hf import IGNORE_INDEX, HFCausalLM  # noqa: E402
from lightning_3d.testing.hf_configs import tiny_hf_config  # noqa: E402


def test_config_builds_deterministically_and_model_instance_is_kept():
    torch.manual_seed(0)
    a = HFCausalLM(config=tiny_hf_config("llama"))
    torch.manual_seed(0)
    b = HFCausalLM(config=tiny_hf_config("llama"))
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name
    inner = a.model
    c = HFCausalLM(model=inner)
    assert c.model is inner and "model" not in c.hparams


def test_path_loads_the_saved_weights(tmp_path):
    source = HFCausalLM(config=tiny_hf_config("qwen2"))
    source.model.save_pretrained(tmp_path)
    loaded = HFCausalLM(path=str(tmp_path))
    for name, value in source.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight  # tied as saved


def test_dict_batch_shifts_labels_and_ignores_padding():
    module = HFCausalLM(config=tiny_hf_config("llama"))
    ids = torch.randint(0, 256, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding on the second sequence
    out_ids, out_mask, targets = module.split_batch({"input_ids": ids, "attention_mask": mask})
    assert out_ids is ids and out_mask is mask
    assert torch.equal(targets[0, :-1], ids[0, 1:]) and targets[0, -1] == IGNORE_INDEX
    assert (targets[1, 4:] == IGNORE_INDEX).all() and torch.equal(targets[1, :4], ids[1, 1:5])
    # The loss is the mean over real targets only: padding changes nothing.
    loss, tokens = module._loss({"input_ids": ids, "attention_mask": mask})
    assert tokens == 7 + 4
    logits = module(ids, mask)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, expected)
    # The pair form gives the same loss for the same targets.
    pair_loss, _ = module._loss((ids[:1], targets[:1]))
    single, _ = module._loss({"input_ids": ids[:1]})
    torch.testing.assert_close(pair_loss, single)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give exactly one of path= or config="),
    ({"path": "/nonexistent/model"}, "is not a model directory: it has no config.json"),
    ({"config": {"hidden_size": 8}}, "config= needs a 'model_type'"),
    ({"config": tiny_hf_config("llama"), "optimizer": "lion"}, "optimizer must be 'adamw' or 'sgd', got 'lion'"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HFCausalLM(**kwargs)


def test_pipeline_spec_for_each_family_and_refusal_for_others():
    from lightning_3d import PipelineSpec

    for family, blocks in [("llama", "model.model.layers"), ("qwen2", "model.model.layers"),
                           ("gpt2", "model.transformer.h")]:
        module = HFCausalLM(config=tiny_hf_config(family))
        spec = module.pipeline_spec()
        assert isinstance(spec, PipelineSpec) and spec.blocks == blocks
        # Stage by stage equals the whole model: embed, each block, head.
        ids = torch.randint(0, 256, (2, 8))
        x = spec.embed(ids)
        for block in module.get_submodule(spec.blocks):
            x = spec.block_forward(block, x)
        torch.testing.assert_close(spec.head(x), module(ids), rtol=1e-5, atol=1e-6)
    bert = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "bert", vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        is_decoder=True))
    with pytest.raises(ValueError, match="no pipeline spec for BertLMHeadModel"):
        HFCausalLM(model=bert).pipeline_spec()
