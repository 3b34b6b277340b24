import math

import lightning
import pytest
import torch
import torch.nn as nn

from lightning_3d.data import TextDataModule
from lightning_3d.models import GPT, GPTConfig, LitGPT
from lightning_3d.models.lit_gpt import warmup_cosine_factor

SMALL = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_forward_shape():
    model = GPT(GPTConfig(**SMALL))
    idx = torch.randint(0, 256, (3, 16))
    assert model(idx).shape == (3, 16, 256)
    assert model(idx[:, :5]).shape == (3, 5, 256)  # shorter than block_size is fine


def test_too_long_sequence_raises():
    model = GPT(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_module_names():
    model = GPT(GPTConfig(**SMALL))
    names = dict(model.named_modules())
    for n in [
        "tok_emb",
        "pos_emb",
        "drop",
        "blocks",
        "norm",
        "lm_head",
        "blocks.0.attn_norm",
        "blocks.0.attn.wq",
        "blocks.0.attn.wk",
        "blocks.0.attn.wv",
        "blocks.0.attn.wo",
        "blocks.0.mlp_norm",
        "blocks.0.mlp.fc1",
        "blocks.0.mlp.fc2",
    ]:
        assert n in names, n
    assert model.lm_head.bias is None
    assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL)).eval()
    idx = torch.randint(0, 256, (2, 16))
    t = 9
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_init_deterministic_and_scaled():
    torch.manual_seed(123)
    a = GPT(GPTConfig(**SMALL))
    torch.manual_seed(123)
    b = GPT(GPTConfig(**SMALL))
    _assert_same(_state(a), _state(b))
    # Residual output projections get the depth-scaled std (256x256 samples).
    big = GPT(GPTConfig(block_size=8, n_layer=8, n_head=4, n_embd=256))
    expected = 0.02 / math.sqrt(2 * 8)
    assert big.blocks[0].attn.wo.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert big.blocks[0].mlp.fc2.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert big.blocks[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_meta_init_matches_direct():
    cfg = GPTConfig(**SMALL, bias=True)
    torch.manual_seed(7)
    direct = GPT(cfg)
    with torch.device("meta"):
        lazy = GPT(cfg)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(7)
    lazy.init_weights()
    _assert_same(_state(direct), _state(lazy))
    assert torch.all(direct.blocks[0].attn.wq.bias == 0)
    assert torch.all(direct.norm.weight == 1)


def test_local_heads_shapes():
    # Simulate a 2-way tensor-parallel shard: half the heads / half the MLP.
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg)
    d = cfg.n_embd
    for block in model.blocks:
        block.attn.wq = nn.Linear(d, d // 2, bias=False)
        block.attn.wk = nn.Linear(d, d // 2, bias=False)
        block.attn.wv = nn.Linear(d, d // 2, bias=False)
        block.attn.wo = nn.Linear(d // 2, d, bias=False)
        block.mlp.fc1 = nn.Linear(d, 2 * d, bias=False)
        block.mlp.fc2 = nn.Linear(2 * d, d, bias=False)
    out = model(torch.randint(0, 256, (2, 16)))
    assert out.shape == (2, 16, 256)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n_embd=30, n_head=4),
        dict(n_layer=0),
        dict(vocab_size=-1),
        dict(block_size=0),
        dict(n_head=0),
        dict(mlp_ratio=0),
        dict(dropout=1.0),
    ],
)
def test_config_errors(kwargs):
    with pytest.raises(ValueError):
        GPTConfig(**kwargs)


def test_config_error_names_values():
    with pytest.raises(ValueError, match=r"n_embd \(30\).*n_head \(4\)"):
        GPTConfig(n_embd=30, n_head=4)


def test_warmup_cosine_schedule():
    f = lambda s: warmup_cosine_factor(s, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)
    assert warmup_cosine_factor(50, 10, None, 0.1) == 1.0


def test_param_groups():
    lit = LitGPT(**SMALL, bias=True, max_steps=100)
    cfg = lit.configure_optimizers()
    decay, no_decay = cfg["optimizer"].param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(lit.parameters()))
    assert cfg["lr_scheduler"]["interval"] == "step"


def _trainer(**kw) -> lightning.Trainer:
    return lightning.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def test_lit_gpt_fit_smoke():
    torch.manual_seed(0)
    lit = LitGPT(block_size=32, n_layer=2, n_head=4, n_embd=32)
    dm = TextDataModule(max_bytes=200_000, block_size=32, batch_size=4)
    trainer = _trainer(max_steps=3)
    trainer.fit(lit, datamodule=dm)
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert dm.dp_size == 1 and dm.per_rank_batch_size == 4


def test_lit_gpt_validate_metrics():
    torch.manual_seed(0)
    lit = LitGPT(block_size=32, n_layer=1, n_head=2, n_embd=16)
    dm = TextDataModule(max_bytes=100_000, block_size=32, batch_size=4)
    (res,) = _trainer(limit_val_batches=3).validate(lit, datamodule=dm, verbose=False)
    # Untrained byte model: loss near ln(256).
    assert res["val_loss"] == pytest.approx(math.log(256), rel=0.05)
    assert res["val_ppl"] == pytest.approx(math.exp(res["val_loss"]), rel=1e-4)
