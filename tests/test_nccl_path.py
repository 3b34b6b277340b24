"""The collectives' NCCL branch of every layout, through the Trainer, on CPUs (gloo worlds).

The engine branches on ``dist.get_backend(group) == "gloo"``: on gloo, ZeRO 1-2 and FSDP2
(ZeRO-3) reduce-scatter and all-gather point to point (``parallel/point_to_point.py``) and a
mean is reduced as SUM then a division (``strategy/collectives.py``); on NCCL the engine runs
``reduce_scatter_single`` / ``all_gather_single``, FSDP2's own communication and
``ReduceOp.AVG``. CI has gloo only, so every other parity test takes the gloo branch. Here the
world is built with ``process_group_backend="cpu:gloo"``: the same gloo transport, but a backend
name that is not ``"gloo"``, so the branch a GPU takes runs, and each layout must still
reproduce one process (losses, and weights tensor by tensor) with the configurations of its own
parity tests (tests/test_zero_parity.py, test_tensor_parallel.py, test_pipeline.py,
test_hf_models.py, test_context_parallel.py, test_adapters_parallel.py).

Each case also shows that the branch was taken, so that a run that silently fell back to the
gloo branch cannot pass: the default group's backend, a mean all-reduced with ``ReduceOp.AVG``,
and for data-parallel layouts the reduce-scatter / all-gather collectives called with no
point-to-point send or receive at all.
"""

from __future__ import annotations

import pytest

from tools.harness.parity import assert_same_run, rank_state_mismatches
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

BACKEND = "cpu:gloo"  # gloo underneath; any name but "gloo" takes the NCCL branch
STEPS, SEED = 5, 1234
CLIP = {"gradient_clip_val": 0.05}  # always hit, as in the parity tests: a local norm shows
PIPELINE_SGD = {"n_layer": 4, "optimizer": "sgd", "lr": 0.3}  # tests/test_pipeline.py's
LORA = {"method": "lora", "r": 4, "lora_alpha": 8}  # tests/test_adapters_parallel.py's
GATHER_SCATTER = ("reduce_scatter", "all_gather")
DP4_SGD = {"model": {"optimizer": "sgd", "lr": 0.3}, "trainer": {"accumulate_grad_batches": 2}}
# name: (world, strategy, run keywords of the reference and the layout, the collectives the
# NCCL branch must call (counts > 0), whether point-to-point traffic is the layout's own:
# pipeline hand-overs, the ring attention of context parallelism).
CASES = {
    "dp2_zero0": (2, {"zero_stage": 0}, {"trainer": CLIP}, (), False),
    "dp2_zero1": (2, {"zero_stage": 1}, {"trainer": CLIP}, GATHER_SCATTER, False),
    "dp2_zero2": (2, {"zero_stage": 2}, {"trainer": CLIP}, GATHER_SCATTER, False),
    "dp2_zero3": (2, {"zero_stage": 3}, {"trainer": CLIP}, GATHER_SCATTER, False),
    # momentum SGD, accumulation, no clipping (tests/test_zero_parity.py's dp4 setup): unlike
    # Adam, the update shows a gradient's scale, so a missing or doubled 1/N mean
    "dp4_sgd_zero1": (4, {"zero_stage": 1}, DP4_SGD, GATHER_SCATTER, False),
    "dp4_sgd_zero3": (4, {"zero_stage": 3}, DP4_SGD, GATHER_SCATTER, False),
    "dp2_tp2_zero1": (
        4,
        {"data": 2, "tensor": 2, "zero_stage": 1},
        {"trainer": CLIP},
        GATHER_SCATTER,
        False,
    ),
    "dp2_tp2_zero3": (
        4,
        {"data": 2, "tensor": 2, "zero_stage": 3},
        {"trainer": CLIP},
        GATHER_SCATTER,
        False,
    ),
    # Qwen2's embedding and head are one tied DTensor; the replica check gathers its fingerprints.
    "qwen2_tp2_tied": (2, {"tensor": 2}, {"trainer": CLIP, "arch": "hf_qwen2"}, (), False),
    "pp2_1f1b": (
        2,
        {"pipeline": 2, "schedule": "1f1b", "micro_batches": 4},
        {"model": PIPELINE_SGD},
        (),
        True,
    ),
    # The tie on both stages: its copies summed in their own ZeRO bucket (tests/test_hf_models.py).
    "qwen2_pp2_tied_zero2": (
        2,
        {"pipeline": 2, "zero_stage": 2},
        {
            "arch": "hf_qwen2",
            "model": {"optimizer": "sgd", "lr": 0.5},
            "trainer": {"gradient_clip_val": 0.5},
        },
        (),
        True,
    ),
    "cp2_ring": (2, {"context": 2, "context_scheme": "ring"}, {"trainer": CLIP}, (), True),
    "cp2_alltoall_zero2": (
        2,
        {"context": 2, "context_scheme": "alltoall", "zero_stage": 2},
        {"trainer": CLIP},
        GATHER_SCATTER,
        False,
    ),
    "lora_dp2_zero1": (
        2,
        {"data": 2, "zero_stage": 1},
        {"arch": "hf_llama", "model": {"adapter": LORA, "lr": 1e-2}, "trainer": CLIP},
        GATHER_SCATTER,
        False,
    ),
    "lora_dp2_zero3": (
        2,
        {"data": 2, "zero_stage": 3},
        {"arch": "hf_llama", "model": {"adapter": LORA, "lr": 1e-2}, "trainer": CLIP},
        GATHER_SCATTER,
        False,
    ),
}
HF = ("qwen2", "lora")  # need transformers (and peft)


def fit_off_the_gloo_branch(rank: int, run: Run) -> dict:
    """``fit_gpt`` with every rank's parameters (``rank_state``), the collectives it called
    counted, the all-reduces that averaged with ``ReduceOp.AVG`` counted, and the default
    group's backend."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from lightning_3d.strategy.collectives import _all_reduce
    from tools.bench.comm import count_collectives

    averaged = []
    with count_collectives() as counter:
        counted = dist.all_reduce  # the counter's wrapper; restored with the original at exit

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            averaged.append(op == dist.ReduceOp.AVG)
            return counted(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = all_reduce
        try:
            result = fit_gpt(rank, dataclasses.replace(run, rank_state=True))
            # A mean over the ranks, as self.log(..., sync_dist=True) asks of the strategy (the
            # training loss needs none: every rank holds the global batch's token mean).
            mean = _all_reduce(torch.tensor([float(rank)]), None, "mean")
            result["mean_of_ranks"] = mean.item()
        finally:
            dist.all_reduce = counted
        result["backend"] = dist.get_backend()
    result["calls"] = {name: c.calls for name, c in counter.by_op.items()}
    result["averaged"] = sum(averaged)
    return result


def _calls(rank: dict, *names: str) -> int:
    return sum(rank["calls"].get(f"dist.{name}", 0) for name in names)


def assert_off_the_gloo_branch(world: list[dict], collectives: tuple, point_to_point: bool):
    """Every rank ran the NCCL branch: a backend other than gloo, a mean averaged by the
    collective (``ReduceOp.AVG``), the data axis's reduce-scatter and all-gather as collectives (under
    the new or the old torch names), and no point-to-point message unless the layout sends its
    own."""
    for index, rank in enumerate(world):
        where = f"rank {index}: {rank['backend']}, {rank['calls']}"
        assert rank["backend"] == BACKEND, where
        assert rank["averaged"] > 0, where  # collectives.py's NCCL branch: ReduceOp.AVG
        assert rank["mean_of_ranks"] == (len(world) - 1) / 2, where
        if "reduce_scatter" in collectives:
            assert _calls(rank, "reduce_scatter_single", "reduce_scatter_tensor") > 0, where
        if "all_gather" in collectives:
            assert _calls(rank, "all_gather_single", "all_gather_into_tensor") > 0, where
        if not point_to_point:  # the gloo branch's exchange: isend / irecv
            assert _calls(rank, "isend", "irecv", "send", "recv") == 0, where


@pytest.fixture(scope="module")
def reference():
    """One process, per distinct reference run (several cases share one)."""
    cache: dict = {}

    def get(keywords: dict) -> dict:
        key = repr(sorted(keywords.items()))
        if key not in cache:
            cache[key] = fit_gpt(0, Run(steps=STEPS, seed=SEED, **keywords))
        return cache[key]

    return get


def _assert_matches(case: str, world: list[dict], ref: dict) -> None:
    """The comparison the layout's own parity test makes."""
    if case.startswith("lora"):
        from test_adapters_parallel import assert_same_lora_run

        assert_same_lora_run(world, ref)
    elif case.startswith("qwen2"):
        from test_hf_models import assert_matches, assert_ties_hold

        assert_matches(world[0], ref)
        assert_ties_hold(world)
        assert world[0]["ties"]  # the tie is there to be held
    else:
        assert_same_run(world[0], ref)
        assert rank_state_mismatches(world, ref) == []
        # together the ranks hold the whole model (pipeline stages: each its own part)
        assert set().union(*(r["rank_state"] for r in world)) == set(ref["state"])


@pytest.mark.parametrize("case", list(CASES))
def test_nccl_branch_matches_one_process(reference, case):
    """Catches, on the branch every GPU run takes and no other CPU test does: a reduce-scatter
    without the 1/N mean (or with it twice), a slice all-gathered into the wrong place of the
    bucket, FSDP2's own communication (ZeRO-3) disagreeing with the engine's layout, a tied
    bucket summed on one branch only, a mean reduced with AVG and then divided again, and any
    collective of the NCCL branch that the CPU path never calls."""
    if case.startswith(HF):
        pytest.importorskip("transformers")
        if case.startswith("lora"):
            pytest.importorskip("peft")
    world_size, strategy, keywords, collectives, point_to_point = CASES[case]
    run = Run(
        strategy={**strategy, "process_group_backend": BACKEND},
        devices=world_size,
        steps=STEPS,
        seed=SEED,
        **keywords,
    )
    world = run_world(fit_off_the_gloo_branch, world_size, run)
    assert_off_the_gloo_branch(world, collectives, point_to_point)
    _assert_matches(case, world, reference(keywords))
