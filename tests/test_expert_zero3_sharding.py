"""ZeRO-3 with expert parallelism (``parallel/expert_fsdp.py``): each experts module an FSDP2
unit over the ranks that hold the same experts, so the expert weights, their gradients and their
optimizer state are split over all ``G`` data ranks (16 Ψ_e / G bytes of fp32 AdamW per rank),
not only over the ``ep`` ranks.

The layout is the reference MoE GPT at ``expert=2`` on 4 data ranks (two ranks per expert
slice), against one process: the same losses, the same update of every tensor (momentum SGD, an
update proportional to the gradient, and AdamW, whose moments are what the split moves), every
rank's own copy of every weight; the bytes each rank holds of the experts, counted from the
tensors; consolidated and sharded checkpoints resumed at other expert layouts.

Broken variants caught (each planted and reverted, seen failing): the gradient divide factor
left at FSDP2's default, the replica group's size (an average over the two replicas, not the
sum over them divided by G: the SGD, AdamW, accumulation, bf16-mixed, pipeline and Hugging Face
cases); the experts left out of ZeRO-3 as before (``ignored_params``: the bytes case); a
one-rank replica group sharded all the same (the ``expert`` = data case); a host read in the
experts' forward (the device case). The checkpoint cases were not seen failing on a planted bug:
the one tried (strided shards read as plain ones in ``checkpoint/sharded.py``'s piece offsets)
is not on this path, where DCP takes FSDP2's DTensors as they are.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tools.harness.parity import (
    loss_mismatches,
    rank_state_mismatches,
    update_mismatches,
    weight_mismatches,
)
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks
from tools.harness.world import run_world

SEED = 1234
STEPS = 3
MOE = {"lr": 0.3, "n_experts": 4, "top_k": 2, "shared_expert": True, "aux_loss_coef": 0.1}
LAYOUT = {"expert": 2, "zero_stage": 3}  # on 4 ranks: replica groups of 2
# AdamW at its usual rate: at 0.3 three steps move the weights so far that the ranks' other
# order of summation shows above the tolerance in dense weights (1e-4 to 3e-4 relative).
OPTIMIZERS = {"sgd": {"optimizer": "sgd"}, "adamw": {"optimizer": "adamw", "lr": 3e-3}}


@pytest.fixture(scope="module")
def references():
    cache: dict = {}

    def get(optimizer: str, trainer=None) -> tuple[dict, dict]:
        key = (optimizer, repr(trainer))
        if key not in cache:
            model = {**MOE, **OPTIMIZERS[optimizer]}
            run = Run(arch="moe", steps=STEPS, seed=SEED, model=model, trainer=trainer)
            one = fit_gpt(0, run)  # Lightning's own single device
            # One process under the strategy: its summary records losses as the layouts' do.
            one_3d = run_world(fit_gpt_ranks, 1, dataclasses.replace(run, strategy={}))[0]
            cache[key] = (one, one_3d)
        return cache[key]

    return get


def _layout_mismatches(references, optimizer: str, strategy=None, trainer=None) -> list[str]:
    one, one_3d = references(optimizer, trainer)
    run = Run(
        arch="moe",
        strategy={**LAYOUT, **(strategy or {})},
        devices=4,
        steps=STEPS,
        seed=SEED,
        model={**MOE, **OPTIMIZERS[optimizer]},
        rank_seeds=True,
        trainer=trainer,
    )
    world = run_world(fit_gpt_ranks, 4, run)
    problems = loss_mismatches(world[0]["losses"], one_3d["losses"])
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(world, one)
    return problems


@pytest.mark.parametrize(
    "optimizer", ["sgd", pytest.param("adamw", marks=pytest.mark.slow)], ids=["sgd", "adamw"]
)
def test_ep2_on_4_ranks_at_zero3_matches_one_process(references, optimizer):
    """ep=2 x 4 data ranks under ZeRO-3, the experts split over their 2 replicas too: losses,
    every tensor's update and every rank's copy as one process. Catches: the experts' gradient
    averaged over the replicas (FSDP2's default divide factor) instead of summed and divided by
    the data size; a second reduction (the old hook kept beside FSDP2's)."""
    problems = _layout_mismatches(references, optimizer)
    assert problems == [], "\n".join(problems)


@pytest.mark.slow
def test_zero3_experts_with_accumulation_checkpointing_and_clipping(references):
    """The same layout with 2 accumulated micro-batches (FSDP2 reduces each), full activation
    checkpointing (the experts' unit gathers again inside the recomputed block) and a clipping
    threshold every step hits (the global norm counts each expert element once, over the
    2-D mesh); and with ``zero3_keep_gathered`` (one reduction per step)."""
    trainer = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    problems = _layout_mismatches(references, "sgd", {"ac_policy": "full"}, trainer)
    problems += _layout_mismatches(references, "sgd", {"zero3_keep_gathered": True}, trainer)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    ("extra", "replica_axis"),
    [
        pytest.param({}, "dp_replica", id="dp4"),
        pytest.param({"context": 2}, "dp_replica_cp", id="dp2_cp2", marks=pytest.mark.slow),
    ],
)
def test_zero3_splits_expert_state_over_every_data_rank(extra, replica_axis):
    """Each of 4 ranks holds a quarter of the experts' weights, gradients and AdamW moments
    (16 Psi_e / 4 bytes), not half (16 Psi_e / ep): the weights are DTensors on the 2-D
    (replica, ep) mesh; under context parallelism (data 2 x context 2) the replicas are
    ``dp_replica`` x ``cp``. Catches: the experts left out of ZeRO-3 (``ignored_params``)."""
    from support.expert_bytes import fit_counting_experts

    strategy = {**LAYOUT, **extra}
    run = Run(arch="moe", strategy=strategy, devices=4, steps=2, seed=SEED, model=MOE)
    for rank, held in enumerate(run_world(fit_counting_experts, 4, run)):
        whole = held["elements"] * 4  # fp32 bytes of every expert weight
        got = (held["param"], held["grad"], held["state"])
        assert got == (whole / 4, whole / 4, whole / 2), (rank, held)
        assert {axes for axes, _ in held["meshes"].values()} == {(replica_axis, "ep")}, held


def test_replicas_split_whole_experts_when_they_divide_evenly():
    """Dim 0 (whole experts per rank) when this rank's experts divide over the replicas, else
    dim 1 (no padded expert, no rank without a part)."""
    from torch.distributed.tensor import Shard

    from lightning_3d.parallel.expert_fsdp import shard_placement

    assert shard_placement(torch.empty(2, 3, 4), 2) == Shard(0)
    assert shard_placement(torch.empty(1, 3, 4), 2) == Shard(1)
    assert shard_placement(torch.empty(3, 8, 4), 2) == Shard(1)


@pytest.mark.slow
def test_zero3_keeps_experts_whole_where_no_rank_shares_them():
    """``expert`` = data (2 of 2): a replica group of one rank, nothing to split; the experts
    keep their ``ep`` mesh and their own gradient hook, each rank half of them."""
    from support.expert_bytes import fit_counting_experts

    run = Run(arch="moe", strategy=LAYOUT, devices=2, steps=2, seed=SEED, model=MOE)
    for held in run_world(fit_counting_experts, 2, run):
        whole = held["elements"] * 4
        assert (held["param"], held["state"]) == (whole / 2, whole), held
        assert {axes for axes, _ in held["meshes"].values()} == {("ep",)}, held


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_format", ["consolidated", "sharded"])
def test_checkpoint_at_ep2_on_4_ranks_resumes_at_other_expert_layouts(tmp_path, checkpoint_format):
    """2 steps at ep=2 x 4 ranks (ZeRO-3, the experts 2-D sharded), saved, then 2 more at ep=1
    and at ep=2 x 2 ranks (1-D: read out of the 2-D pieces), and at the saved layout (read back
    into them); ZeRO-3 all: the uninterrupted run's losses and weights (momentum SGD: a lost or
    misplaced expert momentum shows)."""

    def fit(expert: int, world: int, steps: int, **kwargs) -> dict:
        strategy = {"expert": expert, "zero_stage": 3, "checkpoint_format": checkpoint_format}
        model = {**MOE, "optimizer": "sgd"}
        run = Run(arch="moe", strategy=strategy, devices=world, steps=steps, seed=SEED, model=model)
        return run_world(fit_gpt, world, dataclasses.replace(run, **kwargs))[0]

    straight = fit(2, 4, 4)
    first = fit(2, 4, 2, save_to=str(tmp_path / "run.ckpt"), save_every_n_steps=1)
    path = tmp_path / "run-step=2.ckpt"
    problems = []
    for expert, world in ((1, 2), (2, 2), (2, 4)):
        second = fit(expert, world, 4, resume_from=str(path))
        found = loss_mismatches(first["losses"] + second["losses"], straight["losses"])
        found += weight_mismatches(second["state"], straight["state"], 1e-5, 1e-6)
        problems += [f"resumed at ep{expert} on {world} ranks: {p}" for p in found]
    assert problems == [], "\n".join(problems)
    if checkpoint_format == "consolidated":
        saved = torch.load(path, weights_only=False)
        assert saved["state_dict"]["model.blocks.0.mlp.experts.w_in"].shape == (4, 32, 128)
        assert len(saved["optimizer_states"][0]["state"]) == len(saved["state_dict"])


@pytest.mark.slow
def test_hf_qwen3_moe_ep2_on_4_ranks_at_zero3_matches_one_process():
    """A Hugging Face family (qwen3_moe, tiny and random, 2 experts): its experts module, found
    by the config's ``base_model_ep_plan``, an FSDP2 unit over the replicas, split on dim 1 (one
    expert per ep rank, two replicas); its dispatch hooks swap in the gathered local weights.
    Losses, every update, every rank's copy as one process."""
    pytest.importorskip("transformers")
    from tools.harness.hf_configs import tiny_config

    def run(strategy, world: int) -> Run:
        # Two experts: one per ep rank, split over its two replicas on dim 1, not the expert's.
        hf = tiny_config("qwen3_moe", num_local_experts=2)
        model = {"optimizer": "sgd", "lr": 0.3, "hf": hf}
        return Run(
            arch="hf",
            strategy=strategy,
            devices=world,
            steps=STEPS,
            seed=SEED,
            model=model,
            rank_seeds=strategy is not None,
        )

    one = fit_gpt(0, run(None, 1))
    ranks = run_world(fit_gpt_ranks, 4, run(LAYOUT, 4))
    problems = loss_mismatches(ranks[0]["losses"], one["losses"], 1e-5)
    problems += update_mismatches(ranks[0]["state"], one["state"], one["initial_state"], 1e-4)
    problems += rank_state_mismatches(ranks, one, 1e-5)
    assert problems == [], "\n".join(problems)


def test_zero3_expert_units_take_device_tensors_and_read_once_a_layer():
    """Under the device guard (``tests/test_device_faithful.py``'s): every collective of the
    4-rank layout, the experts' gathers and reduce-scatters over their replicas and the clipping
    norm over the 2-D mesh included, takes tensors made on the device; from the second step on,
    lightning_3d reads one device value per MoE layer and forward besides the step agreement's."""
    from support.guarded_runs import check_moe_reads

    steps, layers = 3, 2
    run = Run(
        arch="moe",
        strategy=LAYOUT,
        devices=4,
        steps=steps,
        model=MOE,
        trainer={"gradient_clip_val": 0.5},
    )
    check_moe_reads(run, 4, layers)


@pytest.mark.slow
def test_zero3_experts_under_bf16_mixed_keep_fp32_masters_and_match_ep1():
    """bf16-mixed: the experts' unit takes the blocks' precision policy (gathered in bf16,
    reduced in fp32), its sharded weights stay the fp32 masters; every update within bf16's
    bound for ZeRO-3 (``tests/test_precision.py``: 2 x 2 k u for k steps) of the same 4 ranks
    at ``expert`` = 1, where the experts are ordinary ZeRO-3 weights of their blocks (one
    process under bf16-mixed does not run this MoE: its autocast output meets an fp32 sum)."""
    steps, unit = 3, 2.0**-8
    model = {**MOE, "optimizer": "sgd"}

    def fit(expert: int) -> list:
        strategy = {**LAYOUT, "expert": expert}
        run = Run(
            arch="moe",
            strategy=strategy,
            devices=4,
            steps=steps,
            seed=SEED,
            model=model,
            trainer={"precision": "bf16-mixed"},
        )
        return run_world(fit_gpt_ranks, 4, run)

    ep1, ep2 = fit(1), fit(2)
    rtol = 2 * 2 * steps * unit
    initial = ep1[0]["initial_state"]
    problems = update_mismatches(ep2[0]["state"], ep1[0]["state"], initial, rtol)
    for rank, result in enumerate(ep2):
        own = result["rank_state"]
        assert all(t.dtype == torch.float32 for t in own.values()), rank
        found = update_mismatches(own, ep1[0]["state"], initial, rtol)
        problems += [f"rank {rank}: {p}" for p in found]
    assert problems == [], "\n".join(problems)


@pytest.mark.slow
def test_ep2_pp2_on_8_ranks_at_zero3_matches_one_process():
    """Under a pipeline (2 stages of 2 blocks, 4 data ranks each, 2 micro-batches, 1F1B):
    torch's stages drive each experts unit inside the stage's units (gradient sync on the last
    micro-batch, resharding); against one process accumulating the same micro-batches."""
    micro = 2
    model = {**MOE, "optimizer": "sgd", "n_layer": 4}
    one = run_world(
        fit_gpt_ranks,
        1,
        Run(
            arch="moe",
            strategy={},
            steps=STEPS,
            seed=SEED,
            model=model,
            data={"batch_size": 8 // micro},
            trainer={"accumulate_grad_batches": micro},
        ),
    )[0]
    strategy = {**LAYOUT, "pipeline": 2, "micro_batches": micro}
    run = Run(arch="moe", strategy=strategy, devices=8, steps=STEPS, seed=SEED, model=model)
    world = run_world(fit_gpt_ranks, 8, run)
    problems = loss_mismatches(world[0]["losses"], one["losses"])
    problems += update_mismatches(world[0]["state"], one["state"], one["initial_state"], 1e-4)
    assert problems == [], "\n".join(problems)
