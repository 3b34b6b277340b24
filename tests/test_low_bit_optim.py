"""Low-precision optimizer states: bytes, refusals, ZeRO 1-2 against one process, checkpoints.

torchao's low-bit AdamW steps through ``torch.compile`` (tens of seconds of compiling on 2 cores
per shape), so its tests run eagerly (``torch.compiler.set_stance("force_eager")``): the same quantized
arithmetic, op by op. bitsandbytes' 8-bit AdamW runs its own CPU kernels.
"""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_3d.parallel.optimizers import (
    build_optimizer,
    optimizer_problems,
    quantization_block,
    refuse_sharded_quantized,
    state_bytes_by_dtype,
)
from tools.harness.world import run_world

torchao = pytest.importorskip("torchao")
# (in, out) of three bias-free linears: 24 + 24 + 17 = 65 blocks of 256 elements, so two ranks'
# equal slices of one unaligned bucket would cut a block in two.
SHAPES = ((64, 96), (96, 64), (64, 68))
STEPS = 3


@pytest.fixture
def eager():
    with torch.compiler.set_stance("force_eager"):
        yield


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(i, o, bias=False) for i, o in SHAPES))


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(8, SHAPES[0][0], generator=gen) for _ in range(STEPS)]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, engine=None) -> list[float]:
    losses = []
    for x in _batches():
        if engine is not None:
            engine.prepare_backward(sync=True)
        loss = model(x).square().mean()
        loss.backward()
        if engine is not None:
            engine.finish_backward()
        optimizer.step()
        if engine is not None:
            engine.after_step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _groups(model: nn.Module) -> list[dict]:
    return [{"params": list(model.parameters()), "weight_decay": 0.1}]


@pytest.mark.parametrize(
    "name, ratio", [("adamw8bit_bnb", 0.27), ("adamw8bit", 0.27), ("adamw4bit", 0.14)]
)
def test_state_bytes_against_fp32_adamw(name, ratio, eager):
    """Counted from the state tensors after one step (codes, scales and code maps)."""
    pytest.importorskip("bitsandbytes" if name.endswith("bnb") else "torchao")
    sizes = {}
    for kind in ("adamw", name):
        torch.manual_seed(0)  # 256K parameters: the 1 KiB code map per state is amortised
        model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False))
        optimizer = build_optimizer(kind, _groups(model), 1e-3, (0.9, 0.95))
        model(torch.randn(4, 256)).square().mean().backward()
        optimizer.step()
        sizes[kind] = state_bytes_by_dtype(optimizer)
    total = {kind: sum(by_dtype.values()) for kind, by_dtype in sizes.items()}
    assert total[name] <= ratio * total["adamw"], sizes
    assert sizes[name]["uint8"] >= 0.8 * total[name]  # the moments themselves are the codes


def test_refusals_name_the_values():
    assert optimizer_problems("adam9") == [
        "optimizer must be one of ['adamw', 'sgd', 'adamw8bit', 'adamw4bit', 'adamw8bit_bnb', "
        "'adamw_bf16sr'], got 'adam9'"
    ]
    (problem,) = optimizer_problems("adamw8bit", offload="cpu")
    assert "optimizer='adamw8bit' with offload='cpu'" in problem
    (problem,) = optimizer_problems("adamw8bit_bnb", zero_stage=2)
    assert "optimizer='adamw8bit_bnb' with zero_stage=2" in problem
    assert optimizer_problems("adamw4bit", zero_stage=3) == []
    with pytest.raises(ValueError, match="got 'adam9'"):
        build_optimizer("adam9", [nn.Parameter(torch.zeros(1))], 1e-3, (0.9, 0.95))


def test_lit_gpt_refuses_an_unknown_optimizer_before_building():
    from lightning_3d.models import LitGPT

    with pytest.raises(ValueError, match="optimizer must be one of"):
        LitGPT(optimizer="adam8")


def _zero_rank(rank: int) -> dict:
    """ZeRO 1 and 2 (block-aligned) and ZeRO 1 unaligned, on 2 gloo ranks, in one world; every
    rank the same batches, so the reduced gradient is the one-process gradient exactly."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.parallel import zero

    torch.compiler.set_stance("force_eager")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    out = {}
    for stage, align in ((1, True), (2, True), (1, False)):
        model = _model()
        optimizer = build_optimizer("adamw8bit", _groups(model), 1e-2, (0.9, 0.95))
        engine = zero.ZeroDataParallel(mesh, stage)
        if not align:  # the engine as it was before it aligned to quantization blocks
            optimizer.block_size, block = 1, optimizer.block_size
        engine.attach(optimizer)
        if not align:
            optimizer.block_size = block
        losses = _train(model, optimizer, engine)
        try:  # what a checkpoint save runs first: quantized slices cannot be gathered
            refuse_sharded_quantized(optimizer)
            refused = ""
        except ValueError as err:
            refused = str(err)
        out[stage, align] = {
            "refused": refused,
            "losses": losses,
            "weights": [p.detach().clone() for p in model.parameters()],
            "slices": [type(s["exp_avg"].to_local()).__name__ for s in optimizer.state.values()],
        }
    return out


def _one_process() -> dict:
    model = _model()
    optimizer = build_optimizer("adamw8bit", _groups(model), 1e-2, (0.9, 0.95))
    losses = _train(model, optimizer)
    return {
        "losses": losses,
        "weights": [p.detach().clone() for p in model.parameters()],
    }


def test_zero_slices_quantize_as_one_process(eager):
    """With every parameter quantizable in one process, ZeRO 1-2's block-aligned slices give the
    same losses and weights bit for bit. Catches: buckets not aligned to the quantization blocks
    (a slice whose size the block does not divide is not quantized at all; a block straddling
    two parameters or two ranks would get another scale). Unaligned, the run moves off."""
    reference = _one_process()
    world = run_world(_zero_rank, 2)
    for rank in world:
        for stage in (1, 2):
            run = rank[stage, True]
            assert run["slices"] == ["OptimState8bit"], stage  # the slice really is quantized
            assert "OptimState8bit states are split across ZeRO shards" in run["refused"]
            assert run["losses"] == reference["losses"], stage
            torch.testing.assert_close(run["weights"], reference["weights"], rtol=0, atol=0)
        unaligned = rank[1, False]
        assert any(
            not torch.equal(a, b) for a, b in zip(unaligned["weights"], reference["weights"])
        )


def test_checkpoint_round_trip_is_exact(eager):
    """The consolidated checkpoint's optimizer state (``full_optimizer_state``: quantized tensor
    subclasses as they are) through ``torch.save`` into a fresh optimizer: the next steps equal
    those of the run that went on. Catches: states cast (dequantized) or cloned on load."""
    from lightning_3d.checkpoint.consolidated import (
        full_optimizer_state,
        load_full_optimizer_state,
    )

    for name in ("adamw8bit", "adamw4bit"):
        model = _model()
        optimizer = build_optimizer(name, _groups(model), 1e-2, (0.9, 0.95))
        _train(model, optimizer)
        buffer = io.BytesIO()
        optim = full_optimizer_state(model, optimizer)
        torch.save({"model": model.state_dict(), "optim": optim}, buffer)
        went_on = _train(model, optimizer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        resumed = _model()
        resumed.load_state_dict(saved["model"])
        again = build_optimizer(name, _groups(resumed), 1e-2, (0.9, 0.95))
        load_full_optimizer_state(resumed, again, saved["optim"])
        state = again.state[next(iter(resumed.parameters()))]["exp_avg"]
        assert type(state).__name__.startswith("OptimState"), type(state)
        assert _train(resumed, again) == went_on, name
        torch.testing.assert_close(
            list(resumed.parameters()), list(model.parameters()), rtol=0, atol=0
        )


def test_quantization_block():
    model = _model()
    assert quantization_block(build_optimizer("adamw", _groups(model), 1e-3, (0.9, 0.9))) == 1
    assert quantization_block(build_optimizer("adamw8bit", _groups(model), 1e-3, (0.9, 0.9))) == 256


@pytest.mark.slow
def test_app_refuses_before_launch(tmp_path):
    """One ``error:`` line naming the keys, exit code 2, no rank started: a low-bit optimizer
    with offload, bitsandbytes under ZeRO, torchao's states under ZeRO with periodic checkpoints,
    an unknown name."""
    from pathlib import Path

    from tools.harness.apps import start_app, wait_all

    train = Path(__file__).resolve().parents[1] / "examples" / "train.py"
    base = ["model=gpt_tiny", "trainer.max_steps=2"]
    cases = {
        "offload": (["model.optimizer=adamw8bit", "offload=cpu"], "with offload='cpu'"),
        "bnb_zero": (
            ["model.optimizer=adamw8bit_bnb", "parallelism=zero2", "trainer.devices=2"],
            "with zero_stage=2",
        ),
        "checkpoints": (
            ["model.optimizer=adamw4bit", "parallelism=zero1", "trainer.devices=2"],
            "checkpoint.every_n_steps=null",
        ),
        "unknown": (["model.optimizer=adam9"], "got 'adam9'"),
    }
    procs = {name: start_app(train, base + args, tmp_path) for name, (args, _) in cases.items()}
    done = wait_all(procs, timeout=600)
    for name, (_, expected) in cases.items():
        errors = [line for line in done[name].stderr.splitlines() if line.startswith("error:")]
        assert done[name].returncode == 2 and len(errors) == 1, (name, done[name].stderr[-2000:])
        assert expected in errors[0], (name, errors[0])
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no run directory kept


def test_planner_counts_state_by_dtype_and_offloaded_activations():
    """The planner's optimizer bytes per state dtype, and activation offload moving the stored
    blocks' bytes from the device to the host. Catches: a planner that ignores either option."""
    from lightning_3d.models import LitGPT
    from lightning_3d.planner.choice import Choice, PlannerOptions
    from lightning_3d.planner.facts import model_facts, optimizer_state_bytes
    from lightning_3d.planner.memory import rank_memory

    assert optimizer_state_bytes("adamw", 8) == {"float32": 8}
    assert optimizer_state_bytes("adamw8bit", 8) == {"uint8": 2, "float32": 8 / 256}
    assert optimizer_state_bytes("adamw4bit", 12) == {"uint8": 1, "float32": 4 + 8 / 128}
    with torch.device("meta"):
        module = LitGPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)
    facts = model_facts(module, precision="32-true", policies=("none", "full"))
    options = PlannerOptions(reserve_gb=0)
    base = Choice(data=1, tensor=1, pipeline=1, batch_per_rank=4, micro_batches=1)
    adam = rank_memory(facts, base, options)
    low = rank_memory(facts, replace(base, optimizer="adamw8bit"), options)
    assert low.optimizer <= 0.27 * adam.optimizer and low.params == adam.params
    for policy in ("none", "full"):
        kept = rank_memory(facts, replace(base, ac_policy=policy), options)
        moved = rank_memory(
            facts, replace(base, ac_policy=policy, activation_offload=True), options
        )
        assert moved.activations < kept.activations and moved.host > kept.host, policy
        assert moved.host - kept.host <= kept.activations


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_trainer_with_8bit_states_follows_one_process(zero_stage):
    """The Trainer (``LitGPT(optimizer="adamw8bit")`` and ``strategy="3d"``) on two ranks at ZeRO 1
    (bucket slices) and ZeRO 3 (FSDP2 shards) against one process: the tiny GPT's matrices are
    quantized in other blocks than one process's (or, under 4096 elements, not at all there),
    so the runs are not equal bit for bit; their losses stay within 1 %. Catches: the strategy
    not stepping torchao's optimizer on its slices or shards."""
    from tools.harness.runs import Run, fit_layout

    model = {"optimizer": "adamw8bit"}
    reference = fit_layout(Run(steps=5, model=model), 1)
    run = fit_layout(Run(steps=5, model=model, strategy={"zero_stage": zero_stage}), 2)
    for got, expected in zip(run["losses"], reference["losses"]):
        assert abs(got / expected - 1) < 0.01, (run["losses"], reference["losses"])
    assert run["losses"][-1] < run["losses"][0]


def test_checkpoint_checksums_cover_quantized_states(eager):
    """The checkpoint file's CRCs (``checkpoint/integrity.py``) read a quantized state's codes,
    scales and map: a changed code changes its CRC. Catches: a save failing on the subclass."""
    from lightning_3d.checkpoint.integrity import tensor_crc, with_checksums

    model = _model()
    optimizer = build_optimizer("adamw8bit", _groups(model), 1e-2, (0.9, 0.95))
    _train(model, optimizer)
    state = optimizer.state[next(iter(model.parameters()))]["exp_avg"]
    checked = with_checksums({"optimizer_states": [optimizer.state_dict()]})
    assert "optimizer_states.0.state.0.exp_avg" in checked["checksums"]["tensors"]
    before = tensor_crc(state)
    state.codes[0] += 1
    assert tensor_crc(state) != before


@pytest.mark.slow
def test_app_resume_with_8bit_states_is_exact(tmp_path):
    """``model.optimizer=adamw8bit`` on the app's default layout (2 ranks, ZeRO 0): 4 steps in
    one go against 2 steps, then a resume from their ``last.ckpt`` to 4: the same weights and
    the same quantized states (codes and scales), bit for bit. Catches: a checkpoint that
    cannot checksum, unpickle (``weights_only``) or load the quantized states, or casts them."""
    from pathlib import Path

    from lightning_3d.checkpoint.files import load_weights_only
    from tools.harness.apps import start_app, wait_all

    train = Path(__file__).resolve().parents[1] / "examples" / "train.py"
    base = ["model=gpt_tiny", "model.optimizer=adamw8bit", "checkpoint.every_n_steps=2"]
    runs = {
        "whole": ["trainer.max_steps=4"],
        "half": ["trainer.max_steps=2"],
        "resumed": ["trainer.max_steps=4", f"resume={tmp_path / 'half' / 'last.ckpt'}"],
    }
    saved = {}
    for name, args in runs.items():  # one after the other: the resume needs the half's file
        out = tmp_path / name
        done = wait_all(
            {name: start_app(train, [*base, *args, f"hydra.run.dir={out}"], tmp_path)}, 600
        )
        assert done[name].returncode == 0, done[name].stderr[-3000:]
        saved[name] = load_weights_only(out / "last.ckpt", mmap=False)
    whole, resumed = saved["whole"], saved["resumed"]
    assert resumed["global_step"] == whole["global_step"] == 4
    torch.testing.assert_close(resumed["state_dict"], whole["state_dict"], rtol=0, atol=0)
    quantized = 0
    for index, state in whole["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            other = resumed["optimizer_states"][0]["state"][index][key]
            if hasattr(value, "codes"):
                quantized += 1
                assert torch.equal(value.codes, other.codes) and torch.equal(
                    value.scale, other.scale
                )
            else:
                assert torch.equal(value, other), (index, key)
    assert quantized > 0
