"""Manual optimization (``automatic_optimization = False``) under ZeRO 0-3 trains the weights
one process trains.

A generator / discriminator pair of token-wise networks with two optimizers (the generator's
loss runs through the discriminator, so its backward reaches the other optimizer's parameters
unless that one is toggled off), and one optimizer that accumulates two backwards per step,
each trained 4 steps on 2 gloo ranks: over data ranks (each rank its own samples) and over
context ranks (each rank half of every sample's tokens) and over tensor ranks (each rank half of
every layer, the discriminator's last layer a loss-parallel head). Every rank's weights are compared,
tensor by tensor, with one process that trains the same program on the global batch (Lightning's
``ddp`` on the same 2 ranks matches that process to 3e-8). SGD without momentum moves the
weights by the gradient itself, so a gradient that kept another backward's share, or was
reduced twice, shows; Adam runs the toggled pair once more.

One 2-rank world runs every case and layout in turn (one Trainer after another); each reference
runs once."""

from __future__ import annotations

from typing import Any

import pytest

from tools.harness.parity import weight_mismatches
from tools.harness.world import run_world

STAGES = (0, 1, 2, 3)
RANKS = 2
BATCH = 4  # per data-parallel rank; the reference process reads both ranks' samples as one batch
TOKENS = 4  # per sample: a context-parallel rank holds 2 of each sample's tokens
FEATURES = 6
# The generator split over 2 tensor ranks (column then row parallel); the discriminator's last
# layer a loss-parallel head (its logits a DTensor sharded on the classes, its input whole), so
# manual_backward runs the backward of a vocab-parallel cross-entropy.
TP_PLAN = {"generator.0": "colwise", "generator.2": "rowwise", "discriminator.2": "head"}
# name: the strategy's options besides zero_stage. "data": each rank its own samples; "context":
# both ranks every sample, each its half of every sample's tokens (load-balanced chunks);
# "tensor": both ranks every sample, each half of every layer's features.
LAYOUTS = {
    "data": {},
    "context": {"context": 2},
    "tensor": {"tensor": 2, "tp_plan": TP_PLAN},
}
# name: (how the program steps, optimizer, batches per rank)
CASES = {
    # toggle_optimizer around each optimizer's backward and step (Lightning's GAN recipe)
    "toggle_sgd": ("toggle", "sgd", 4),
    # no toggle; each optimizer's zero_grad() before its backward (Lightning's manual example):
    # the generator's backward leaves gradients in the discriminator's parameters, which the
    # discriminator's zero_grad() before its own backward must clear
    "zero_grad_first_sgd": ("zero_grad_first", "sgd", 4),
    # one optimizer, step and zero_grad every 2 batches: two synchronising backwards per step
    "accumulate_sgd": ("accumulate", "sgd", 8),
    "toggle_adam": ("toggle", "adam", 4),
}


def _token_loss(logits: Any, label: int) -> Any:
    """Cross-entropy of every token's two logits against ``label``: under context parallelism
    the strategy makes it the mean over the whole sequence (``parallel/objective.py``)."""
    import torch
    import torch.nn.functional as F

    targets = torch.full(logits.shape[:-1], label, dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _module(mode: str, optimizer: str) -> Any:
    import lightning as L
    import torch
    from torch import nn

    class GeneratorDiscriminator(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            # Every token on its own, no attention: context parallelism has nothing to route,
            # but takes the module where it names its (absent) attention.
            self.context_attention = None
            self.generator = nn.Sequential(
                nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, FEATURES)
            )
            self.discriminator = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 2))

        def _generator_loss(self, noise):
            fake = self.generator(noise)
            return _token_loss(self.discriminator(fake), 1), fake

        def _discriminator_loss(self, real, fake):
            real_loss = _token_loss(self.discriminator(real), 1)
            return real_loss + _token_loss(self.discriminator(fake.detach()), 0)

        def training_step(self, batch, batch_idx):
            real, noise = batch
            if mode == "accumulate":
                opt = self.optimizers()
                loss, fake = self._generator_loss(noise)
                loss = loss + self._discriminator_loss(real, fake)
                self.manual_backward(loss / 2)
                if batch_idx % 2 == 1:
                    opt.step()
                    opt.zero_grad()
                return
            opt_g, opt_d = self.optimizers()
            if mode == "toggle":
                self.toggle_optimizer(opt_g)
                loss_g, fake = self._generator_loss(noise)
                self.manual_backward(loss_g)
                opt_g.step()
                opt_g.zero_grad()
                self.untoggle_optimizer(opt_g)
                self.toggle_optimizer(opt_d)
                self.manual_backward(self._discriminator_loss(real, fake))
                opt_d.step()
                opt_d.zero_grad()
                self.untoggle_optimizer(opt_d)
            else:  # zero_grad first, nothing toggled
                loss_g, fake = self._generator_loss(noise)
                opt_g.zero_grad()
                self.manual_backward(loss_g)
                opt_g.step()
                if mode == "zero_grad_first":  # "keep_grad": the sharpness check's slip
                    opt_d.zero_grad()
                self.manual_backward(self._discriminator_loss(real, fake))
                opt_d.step()

        def configure_optimizers(self):
            def make(params):
                if optimizer == "adam":
                    return torch.optim.Adam(params, lr=0.01)
                return torch.optim.SGD(params, lr=0.1)

            if mode == "accumulate":
                return make(self.parameters())
            return make(self.generator.parameters()), make(self.discriminator.parameters())

    torch.manual_seed(0)
    return GeneratorDiscriminator()


def _loader(batches: int, rank: int | None = None) -> Any:
    """The samples of ``batches`` steps: all of them in batches of 8 (``rank=None``: the reference
    process, and every rank under context parallelism) or data-parallel rank ``rank``'s half in
    batches of 4: batch k of the reference holds samples [8k, 8k + 8), rank r's batch k the
    samples 8k + r, 8k + r + 2, ... of it."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    n = batches * BATCH * RANKS
    real = torch.randn(n, TOKENS, FEATURES, generator=g) * 0.5 + 1.0
    noise = torch.randn(n, TOKENS, FEATURES, generator=g)
    if rank is None:
        return DataLoader(TensorDataset(real, noise), batch_size=BATCH * RANKS)
    own = slice(rank, None, RANKS)
    return DataLoader(TensorDataset(real[own], noise[own]), batch_size=BATCH)


def _fit(
    case: str, strategy: Any, devices: int, rank: int | None = None, mode: str = ""
) -> tuple[Any, Any]:
    import lightning as L

    case_mode, optimizer, batches = CASES[case]
    module = _module(mode or case_mode, optimizer)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # each rank the samples _loader gives it, in order
    )
    trainer.fit(module, _loader(batches, rank))
    return trainer, module


def _reference(case: str) -> dict:
    """One process, both ranks' samples in each batch."""
    trainer, module = _fit(case, "auto", 1)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fit_layouts(rank: int, runs: list[tuple[str, int, str]]) -> dict:
    """Every (case, stage, layout) of ``runs`` in turn on this rank (one Trainer after another);
    each rank's own full weights."""
    from lightning_3d import ThreeDStrategy
    from lightning_3d.checkpoint.view import full_state_dict

    out: dict[Any, Any] = {}
    for case, stage, layout in runs:
        strategy = ThreeDStrategy(zero_stage=stage, **LAYOUTS[layout])
        trainer, module = _fit(case, strategy, RANKS, rank if layout == "data" else None)
        out[case, stage, layout] = full_state_dict(module)  # a collective under ZeRO-3
    out["first_real"] = next(iter(_loader(1, rank)))[0].sum().item()  # data: its own samples
    return out


@pytest.fixture(scope="module")
def world() -> list[dict]:
    """One 2-rank world trains every case, stage and layout in turn (48 small fits)."""
    runs = [(c, s, layout) for c in CASES for s in STAGES for layout in LAYOUTS]
    return run_world(_fit_layouts, RANKS, runs)


@pytest.fixture(scope="module")
def reference():
    cache: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in cache:
            cache[case] = _reference(case)
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_manual_optimization_matches_one_process(world, reference, case, stage, layout):
    """Catches (stages 0-2, the ZeRO 0-2 engines, over data or context ranks): an optimizer's
    ``zero_grad()`` that leaves what its engine accumulated in place (zero_grad_first: the
    discriminator steps with the generator loss's gradient still in it); a backward that feeds
    engines whose optimizer is toggled off (toggle, stages 1-2: ``toggle_optimizer`` freezes
    the engine's slices, not the model's parameters, so the discriminator took the generator
    loss's gradient); a second reduction before a step that reduces the first one's
    already-reduced slice again (accumulate, stage 1); under tensor parallelism, every stage: a
    ``manual_backward`` that entered the vocab-parallel loss context a second time, inside
    ``training_step``'s, and on leaving it removed torch's loss-parallel ops for the rest of the
    step (the next loss failed, or ``KeyError: aten._log_softmax`` at the step's end). Every
    rank's own copy is compared; under data parallelism the ranks read different samples."""
    ranks = world
    assert ranks[0]["first_real"] != ranks[1]["first_real"]
    expected = reference(case)
    for rank, out in enumerate(ranks):
        problems = weight_mismatches(out[case, stage, layout], expected, rtol=1e-5, atol=1e-6)
        assert problems == [], f"rank {rank}: {problems}"


def test_the_comparison_sees_a_skipped_zero_grad(reference):
    """The comparison above is sharp enough to see the bug it is for: the same program on one
    process, but with the discriminator's ``zero_grad()`` left out (its step then applies the
    generator loss's gradient too), differs from the reference."""
    trainer, module = _fit("zero_grad_first_sgd", "auto", 1, mode="keep_grad")
    slipped = {k: v.detach() for k, v in module.state_dict().items()}
    problems = weight_mismatches(slipped, reference("zero_grad_first_sgd"), rtol=1e-5, atol=1e-6)
    assert any(name.startswith("discriminator.") for name in problems), problems


def test_manual_optimization_under_a_pipeline_is_refused():
    """A pipeline schedule runs forward and backward inside ``training_step``, so a module that
    steps its own optimizers cannot run under one: refused by name before any process group."""
    from lightning_3d import ThreeDStrategy

    strategy = ThreeDStrategy(pipeline=2)
    with pytest.raises(ValueError, match="manual optimization.*pipeline=2"):
        strategy.connect(_module("toggle", "sgd"))
