"""The guard against silent divergence (``parallel/replicas.py``): replicas of a parameter —
on every tensor rank, or a tied weight's copies on pipeline stages — must have the same
gradient and the same updated value; at the first optimizer step a mismatch stops the run,
naming the parameter, the ranks and the plan entry to change."""

from __future__ import annotations

import pytest
import torch

from lightning_3d.parallel.replicas import fingerprint, replicated_over
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world

transformers = pytest.importorskip("transformers")

# Qwen3's plan as a user would write it by module names, forgetting the per-head norms.
QWEN3_WITHOUT_NORM_SUMS = {
    "*embed_tokens": "vocab",
    "*.self_attn.q_proj": "colwise",
    "*.self_attn.k_proj": "colwise",
    "*.self_attn.v_proj": "colwise",
    "*.self_attn.o_proj": "rowwise",
    "*.mlp.gate_proj": "colwise",
    "*.mlp.up_proj": "colwise",
    "*.mlp.down_proj": "rowwise",
    "*lm_head": "head",
}


def test_fingerprints_tell_moved_values_apart():
    t = torch.randn(5, 7)
    assert torch.equal(fingerprint(t), fingerprint(t.clone()))
    swapped = t.clone().reshape(-1)
    swapped[[0, 1]] = swapped[[1, 0]]  # same sum and sum of squares: the weighted sum differs
    assert not torch.equal(fingerprint(t), fingerprint(swapped.view(5, 7)))


def _qwen3_tp2(rank: int, plan: dict | None, check: str) -> dict:
    strategy = {"tensor": 2, "replica_check": check, **({"tp_plan": plan} if plan else {})}
    return fit_gpt(rank, Run(strategy=strategy, devices=2, steps=2, seed=1234, arch="hf_qwen3"))


def test_a_per_head_norm_without_its_gradient_sum_stops_the_run(capfd):
    """Catches (and the run without the guard shows): q_norm / k_norm kept replicated without
    summing their gradients over tp, so each rank steps them with its own heads' gradient —
    the losses agree, the norms' updates are 100 % off. The guard names both and the plan entry."""
    with pytest.raises(RuntimeError) as failed:
        run_world(_qwen3_tp2, 2, QWEN3_WITHOUT_NORM_SUMS, "first")
    text = str(failed.value)
    assert (
        "ReplicaMismatch" in text
        and "the gradient of model.model.layers.0.self_attn.q_norm.weight, "
        "model.model.layers.0.self_attn.k_norm.weight"
        in text
        and "differs across the tensor ranks" in text
    )
    assert "No tensor-parallel plan entry splits them" in text
    assert (
        "tp_plan={'model.model.layers.*.self_attn.q_norm': 'replicated_with_grad_allreduce', "
        "'model.model.layers.*.self_attn.k_norm': 'replicated_with_grad_allreduce', ...}" in text
    )
    fixed = {
        **QWEN3_WITHOUT_NORM_SUMS,
        "*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "*.self_attn.k_norm": "replicated_with_grad_allreduce",
    }
    # The advice, taken, works.
    assert len(run_world(_qwen3_tp2, 2, fixed, "first")[0]["losses"]) == 2
    unguarded = run_world(_qwen3_tp2, 2, QWEN3_WITHOUT_NORM_SUMS, "off")  # silently another model
    assert len(unguarded[0]["losses"]) == 2


def _tied_pipeline_unsummed(rank: int, zero_stage: int) -> dict:
    # In this rank's process only: the bug the guard catches. ZeRO 0-2 engines sum a tie's
    # copies in their buckets; under ZeRO-3 the pipeline runtime sums them in hand_back_grads.
    from lightning_3d.parallel.pipeline_runtime import PipelineRuntime
    from lightning_3d.parallel.zero import ZeroDataParallel

    ZeroDataParallel._sum_tied = lambda self: None
    original = PipelineRuntime.hand_back_grads
    PipelineRuntime.hand_back_grads = lambda self, tied_copies=(): original(self, ())
    run = Run(
        strategy={"pipeline": 2, "zero_stage": zero_stage},
        devices=2,
        steps=2,
        seed=1234,
        arch="hf_qwen2",
    )
    return fit_gpt(rank, run)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_a_tied_weight_stepped_apart_on_two_stages_stops_the_run(zero_stage):
    """Catches: a tied embedding / head whose copies on the two pipeline stages are not given
    the summed gradient, so each stage steps its copy with its own half."""
    with pytest.raises(RuntimeError) as failed:
        run_world(_tied_pipeline_unsummed, 2, zero_stage)
    text = str(failed.value)
    assert "ReplicaMismatch" in text and "pipeline stages holding the tie" in text
    assert "model.model.embed_tokens.weight" in text


def test_replicated_over_reads_the_layout():
    assert replicated_over(torch.zeros(2), "tp")  # a plain tensor: every rank holds all of it


@pytest.mark.parametrize("value", ["sometimes", 0, -3, 2.5, True])
def test_replica_check_values_are_checked_before_any_process(value):
    from lightning_3d.options import Plan

    with pytest.raises(
        ValueError, match=r"replica_check=.* must be 'first', 'off' or a positive number of steps"
    ):
        Plan.from_options(replica_check=value)
    assert Plan.from_options(replica_check=50).replicas.due(
        100
    ) and not Plan.from_options().replicas.due(1)


def _checked_on_demand(rank: int) -> dict:
    from lightning_3d.models.hf import HFCausalLM

    calls = []

    def on_train_batch_end(self, *args):  # the public call, as a user's hook would make it
        self.trainer.strategy.check_replicas()
        calls.append(1)

    HFCausalLM.on_train_batch_end = on_train_batch_end  # this rank's process only
    out = fit_gpt(rank, Run(strategy={"tensor": 2}, devices=2, steps=2, seed=1234, arch="hf_qwen3"))
    return {**out, "calls": len(calls)}


def test_replicas_checked_on_demand_agree_for_the_shipped_plan():
    assert [rank["calls"] for rank in run_world(_checked_on_demand, 2)] == [2, 2]


def _one_group_apart(rank: int) -> str:
    """Two groups of 2 ranks, ({0, 1}, {2, 3}); only group {0, 1} holds replicas that differ.
    What ``compare`` raised on this rank (every rank must raise)."""
    import torch.distributed as dist

    from lightning_3d.parallel.replicas import ReplicaCheck, ReplicaMismatch

    dist.init_process_group("gloo")
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    mine = groups[rank // 2]
    weight = torch.ones(4, 3)
    if rank == 1:
        weight[0, 0] = 2.0  # a replica that parted ways, on rank 1 only
    try:
        ReplicaCheck(torch.device("cpu")).compare(
            "value", [("tensor ranks", mine, [("net.norm.weight", weight)])]
        )
    except ReplicaMismatch as err:
        return str(err)
    return "no ReplicaMismatch"


def test_a_mismatch_in_one_group_stops_every_rank_of_the_world():
    """Catches: the verdict not agreed over the world (the flag's all-reduce dropped, or made
    over the replica group only), so only the ranks that saw the mismatch stop and the others
    go on into collectives nobody joins. Every rank raises; the other group's say why."""
    said = run_world(_one_group_apart, 4)
    for rank in (0, 1):
        assert "the value of net.norm.weight differs across the tensor ranks" in said[rank]
        assert "(global ranks [0, 1])" in said[rank]
    for rank in (2, 3):
        assert said[rank].startswith("replicas disagree on another rank"), said[rank]
