"""The layout planner (lightning_3d.planner): its memory model against the ZeRO formula and
against what real runs measure, its activation bytes against the runs' meter, its ranking, and
the CLI's bad-input exit.

Plain unit tests, except: one single-process Lightning run (calibration of the default run),
one ``python -m lightning_3d.planner`` subprocess, and (``-m slow``) gloo worlds of the layouts
``dp2 ZeRO 0-3``, ``tp2``, ``pp2`` and checkpointed ``dp2`` for the calibration of every rank.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_3d.observe.memory import zero_formula_bytes
from lightning_3d.options import Plan
from lightning_3d.planner import Choice, Cluster, PlannerOptions, model_facts, plan_layouts
from lightning_3d.planner.memory import model_state, stage_parts
from tools.calibration.layouts import LAYOUTS, choice_of
from tools.calibration.memory import compare, run_layout, tiny_facts
from tools.harness.runs import TINY_DATA
from tools.harness.world import run_world

ROOT = Path(__file__).resolve().parents[1]
BATCH = TINY_DATA["batch_size"]


@pytest.fixture(scope="module")
def facts():
    return tiny_facts()


def test_cluster_names_bad_values():
    with pytest.raises(
        ValueError, match=r"cluster\.nodes=0 must be a positive integer.*device_memory_gb=-1"
    ):
        Cluster(nodes=0, device_memory_gb=-1)
    with pytest.raises(ValueError, match=r"unknown cluster key\(s\) \['gpus'\]"):
        Cluster.from_mapping({"gpus": 8})
    assert Cluster(nodes=2, devices_per_node=4).world_size == 8


def test_options_name_bad_values():
    with pytest.raises(ValueError, match=r"efficiency=1.5 must be in.*ac_policies=\['every_n'\]"):
        PlannerOptions(efficiency=1.5, ac_policies=["every_n"])


def test_facts_count_the_model(facts):
    """Parameters from the meta model (each once), the tp-split share from the GPT plan."""
    from lightning_3d.models import LitGPT
    from tools.harness.runs import TINY_MODEL

    with torch.device("meta"):
        module = LitGPT(**TINY_MODEL)
    assert facts.num_params == sum(p.numel() for p in module.parameters())
    block = facts.blocks[0]
    d = TINY_MODEL["n_embd"]
    assert block.split == 12 * d * d  # q, k, v, o and the MLP's two 4d linears; norms replicated
    assert (
        facts.first.split == TINY_MODEL["vocab_size"] * d
    )  # vocab-parallel token embedding, not positions
    assert facts.last.split == TINY_MODEL["vocab_size"] * d  # the head; the final norm replicated


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("data", [1, 2, 8])
def test_memory_is_the_zero_formula(facts, stage, data):
    """fp32 Adam on one stage without tensor parallelism is exactly the paper's 16Ψ / 8Ψ+8Ψ/N / ..."""
    ((part, _),) = stage_parts(facts, 1)
    params, grads, optimizer, host, _ = model_state(facts, Choice(data, 1, 1, stage), part)
    assert host == 0
    assert math.isclose(
        params + grads + optimizer, zero_formula_bytes(facts.num_params, stage, data), rel_tol=1e-12
    )


def test_tensor_and_pipeline_split_the_model_state(facts):
    ((whole, _),) = stage_parts(facts, 1)
    params, *_ = model_state(facts, Choice(1, 2, 1), whole)
    assert params == 4 * (whole.params - whole.split / 2)
    stages = stage_parts(facts, 2)
    assert sum(part.params for part, _ in stages) == facts.num_params  # no tied weights in the GPT
    assert [blocks for _, blocks in stages] == [1, 1]
    assert stages[0][0].params == facts.first.params + facts.blocks[0].params


@pytest.mark.parametrize("rows, data", [(36, 5), (7, 5), (3, 8), (256, 8), (1, 2)])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_zero3_shards_are_torch_chunks_of_dim_0(rows, data, dim):
    """What each data rank holds of one (rows x 6) parameter under ZeRO-3 at tensor 2: its tensor
    rank's part (dim 0 or 1 split, or whole), cut by ``torch.chunk`` on dim 0 as FSDP2 cuts it."""
    from lightning_3d.planner.facts import Part

    rows = rows * 2 if dim == 0 else rows  # a dim that tensor parallelism splits divides by 2
    weight = torch.empty(rows, 6)
    local = weight.chunk(2, dim=dim)[0] if dim >= 0 else weight
    chunks = [c.numel() for c in local.chunk(data, dim=0)]
    chunks += [0] * (data - len(chunks))  # torch.chunk returns fewer chunks when dim 0 is short
    part = Part(
        weight.numel(),
        weight.numel() if dim >= 0 else 0,
        weight.numel(),
        (((rows, weight.numel(), dim), 1),),
    )
    assert [part.sharded(2, data, r) for r in range(data)] == chunks
    three = part + part + part  # a model's blocks: shapes counted, not listed
    assert (
        three.tensors == (((rows, weight.numel(), dim), 3),)
        and three.sharded(2, data) == 3 * chunks[0]
    )
    assert (three - part - part - part).tensors == () and Part(6, 0, 6).sharded(
        2, 3
    ) == 2  # counts alone: even


def test_offload_moves_optimizer_state_to_the_host(facts):
    """fp32 parameters on the device: moments and a separate master (12 B), pinned as the store
    pins them (blocks, the last rounded up to a power of two); ZeRO-3's shards in host memory
    (``+params``) are their own master: 8 B of state, 4 + 4 of shard and gradient."""
    from lightning_3d.offload.storage import pinned_bytes

    ((part, _),) = stage_parts(facts, 1)
    _, _, device_optim, host, disk = model_state(facts, Choice(2, 1, 1, 1, offload="cpu"), part)
    state = 12 * facts.num_params / 2
    assert device_optim == 0 and host == pinned_bytes(state) > state and disk == 0
    params, grads, _, host3, _ = model_state(facts, Choice(2, 1, 1, 3, offload="cpu+params"), part)
    state3 = 8 * facts.num_params / 2
    assert params == grads == 0 and host3 == pinned_bytes(state3) + 8 * facts.num_params / 2


@pytest.mark.parametrize(
    "dtype, device, on_host",
    [
        (torch.float32, "cpu", True),
        (torch.bfloat16, "cpu", True),
        (torch.float32, "meta", False),
        (torch.bfloat16, "meta", False),
    ],
    ids=["fp32_host", "bf16_host", "fp32_device", "bf16_device"],
)
def test_the_offloaded_state_term_is_what_the_store_keeps(dtype, device, on_host):
    """The planner's bytes per parameter against the store's own layout (``plan_chunks``, what
    ``OffloadedAdam`` allocates): 8 B for an fp32 host parameter, 12 B with a separate master
    (bf16, or any parameter off the host: ``meta`` stands in for an accelerator). Broken variant
    caught (seen failing): the old term, a master only for non-fp32 parameters (8 B for fp32 ones
    on the device, a third under the store)."""
    from lightning_3d.offload.storage import ELEMENT_BYTES, plan_chunks
    from lightning_3d.planner.facts import offloaded_state_bytes

    param = torch.nn.Parameter(torch.zeros(1000, dtype=dtype, device=device))
    slots, chunks = plan_chunks([{"params": [param]}], chunk_bytes=1 << 16)
    stored = sum(c.numel for c in chunks) * ELEMENT_BYTES * slots[0].fields
    assert (
        offloaded_state_bytes(param.element_size(), params_on_host=on_host) * param.numel()
        == stored
    )


def test_the_store_of_a_delayed_update_keeps_a_master_for_every_parameter():
    """Not modelled by the planner (see ``offloaded_state_bytes``): 12 B even for fp32 host parameters."""
    from lightning_3d.offload.storage import ELEMENT_BYTES, plan_chunks

    slots, chunks = plan_chunks(
        [{"params": [torch.nn.Parameter(torch.zeros(1000))]}], 1 << 16, always_separate=True
    )
    assert sum(c.numel for c in chunks) * ELEMENT_BYTES * slots[0].fields == 12 * 1000


def test_calibration_single_process(facts):
    """Predicted model-state and activation bytes of a real one-process run within 10%."""
    strategy, world = LAYOUTS["single"]
    rows = compare(facts, choice_of(strategy, world, BATCH), run_layout("single"))
    assert {row["key"] for row in rows} == {
        "param_bytes",
        "grad_bytes",
        "optimizer_state_bytes",
        "activation_bytes_per_block",
    }
    for row in rows:
        assert abs(row["ratio"] - 1) < 0.10, row


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single"])
def test_calibration_every_rank(facts, layout):
    """Every rank of dp2 ZeRO 0-3, tp2, pp2 and checkpointed dp2: predicted within 10% of measured."""
    strategy, world = LAYOUTS[layout]
    summary = run_layout(layout)
    rows = compare(facts, choice_of(strategy, world, BATCH), summary)
    assert len({row["rank"] for row in rows}) == world
    for row in rows:
        assert abs(row["ratio"] - 1) < 0.10, row


def test_activations_follow_the_policies(facts):
    """Measured per block: checkpointing keeps less, tensor parallelism splits part of it."""
    seq = facts.seq_len
    none, selective, full = (
        facts.activation(p, 1).bytes_per_sample(seq) for p in ("none", "selective", "full")
    )
    assert full < selective < none
    assert full == seq * facts.d_model * 4  # a fully checkpointed block keeps its fp32 input
    split = facts.activation("none", 2).bytes_per_sample(seq)
    assert none / 2 < split < none  # norm inputs and the residual stream stay whole


def test_more_memory_fits_more(facts):
    small, large = (
        Cluster(nodes=1, devices_per_node=4, device_memory_gb=gb, host_memory_gb=1)
        for gb in (0.0012, 1)
    )
    options = PlannerOptions(reserve_gb=0, offloads=("none",))
    few = plan_layouts(facts, small, options)
    many = plan_layouts(facts, large, options)
    fits = lambda cands: {c.choice for c in cands if c.fits}  # noqa: E731
    assert fits(few) and fits(few) < fits(many)
    memory = [c for c in few if c.kind == "device memory"]
    assert memory and all(
        " per rank > 0.0012 GB" in c.reason and c.memory.total > 0.0012e9 for c in memory
    )
    tokens = [c.tokens_per_s for c in many if c.fits]
    assert tokens == sorted(tokens, reverse=True)
    for c in many[:5]:  # what the planner proposes, the strategy accepts
        assert Plan.from_options(**c.choice.options()).layout.tensor == c.choice.tensor


def test_tensor_parallelism_stays_inside_a_node(facts):
    cluster = Cluster(nodes=2, devices_per_node=2, device_memory_gb=1)
    cands = plan_layouts(facts, cluster, PlannerOptions(reserve_gb=0))
    crossing = [c for c in cands if c.choice.tensor == 4]
    assert len(crossing) == 1 and crossing[0].kind == "tensor > devices per node"
    assert (
        crossing[0].reason == "tp=4 > 2 devices per node (tensor parallelism is kept inside a node)"
    )
    assert all(c.choice.tensor <= 2 for c in cands if c.fits)


def test_the_models_own_check_rejects_with_its_message():
    """A vocabulary tensor=2 cannot split: model_check.check's sentence is the reason."""
    from functools import partial

    from lightning_3d.models import LitGPT
    from lightning_3d.options.model_check import check

    with torch.device("meta"):
        module = LitGPT(vocab_size=255, block_size=16, n_layer=2, n_head=2, n_embd=16)
    facts = model_facts(module, precision="32-true", tp_sizes=(1, 2), policies=("none",))
    cands = plan_layouts(
        facts,
        Cluster(nodes=1, devices_per_node=2, device_memory_gb=1),
        PlannerOptions(ac_policies=("none",), reserve_gb=0),
        check=partial(check, module),
    )
    refused = [c for c in cands if c.choice.tensor == 2]
    assert refused and all(
        c.kind == "plan check" and "tensor=2 does not divide the model" in c.reason for c in refused
    )
    assert any(c.fits for c in cands)


def _plan_app(*overrides):
    from lightning_3d.planner.__main__ import plan
    from tools.harness.apps import compose_config

    return plan(compose_config("plan", "model=gpt_tiny", *overrides))


def test_app_prints_a_ranked_table(capsys):
    assert _plan_app("cluster=workstation_24gb") == 0
    out = capsys.readouterr().out
    assert "| 1 | none | 1×1×1 |" in out and "first choice: ThreeDStrategy(" in out


@pytest.mark.parametrize(
    "override, said",
    [
        ("cluster.devices_per_node=0", "cluster.devices_per_node=0 must be a positive integer"),
        ("planner.precision=fp8", "precision='fp8' must be one of"),
        ("cluster.device_memory_gb=0.00001", "the least memory any layout needs is"),
    ],
)
def test_app_bad_input_is_one_error_line(capsys, override, said):
    assert _plan_app("planner.reserve_gb=0", override) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err


def test_cli_exit_code_2():
    """The real entry point: a bad value is one error line and exit code 2."""
    done = subprocess.run(
        [sys.executable, "-m", "lightning_3d.planner", "model=gpt_tiny", "cluster.nodes=0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == ["error: cluster.nodes=0 must be a positive integer"]


def test_step_time_terms(facts):
    """The bubble is (p-1)/m of compute; full recomputation adds compute; a data-parallel group
    across nodes talks over the slower link."""
    from lightning_3d.planner import step_time

    node = Cluster(nodes=1, devices_per_node=16, device_memory_gb=80)
    options = PlannerOptions(overlap=0.0)
    piped = step_time(facts, Choice(1, 1, 2, micro_batches=4, batch_per_rank=8), node, options)
    assert math.isclose(piped.bubble, piped.compute / 4)
    plain, full = (
        step_time(facts, Choice(2, 1, 1, ac_policy=ac, batch_per_rank=4), node, options)
        for ac in ("none", "full")
    )
    assert full.compute > plain.compute and plain.bubble == 0
    two_nodes = Cluster(nodes=2, devices_per_node=8, device_memory_gb=80, inter_node_gbps=10)
    inside, across = (
        step_time(facts, Choice(16, 1, 1, batch_per_rank=1), cluster, options)
        for cluster in (node, two_nodes)
    )
    assert across.comm > inside.comm > 0


def _gathered_blocks_at_once(rank: int) -> int:
    """The most blocks FSDP2 holds gathered at once (all-gather issued, not yet resharded) in
    two steps of the tiny GPT at dp2 ZeRO-3, counted by wrapping its ``unshard`` / ``reshard``."""
    import lightning as L
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group

    from lightning_3d import ThreeDStrategy
    from lightning_3d.data import TextDataModule
    from lightning_3d.models import LitGPT
    from tools.harness.runs import TINY_DATA, TINY_MODEL

    alive, most = set(), [0]
    unshard, reshard = fsdp_group.FSDPParamGroup.unshard, fsdp_group.FSDPParamGroup.reshard

    def counted_unshard(group, *args, **kwargs):
        out = unshard(group, *args, **kwargs)
        if (
            group._all_gather_result is not None or group.is_unsharded
        ) and ".blocks." in f".{group._module_fqn}":
            alive.add(group._module_fqn)
            most[0] = max(most[0], len(alive))
        return out

    def counted_reshard(group, *args, **kwargs):
        out = reshard(group, *args, **kwargs)
        if not group.is_unsharded:
            alive.discard(group._module_fqn)
        return out

    fsdp_group.FSDPParamGroup.unshard, fsdp_group.FSDPParamGroup.reshard = (
        counted_unshard,
        counted_reshard,
    )
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ThreeDStrategy(zero_stage=3),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(LitGPT(**{**TINY_MODEL, "n_layer": 4}), TextDataModule(seed=0, **TINY_DATA))
    return most[0]


def test_zero3s_gathered_block_buffer_counts_the_blocks_fsdp2_holds_at_once(facts):
    """Measured: FSDP2 holds 2 blocks gathered at once (in backward, the block under way and the
    one prefetched), and the planner's ZeRO-3 buffer counts 2 gathered blocks (in the compute
    dtype) plus one block's unsharded gradients. Broken variant caught (seen failing):
    ``memory.buffer_bytes`` counting one gathered block."""
    from lightning_3d.planner.memory import buffer_bytes

    measured = max(run_world(_gathered_blocks_at_once, 2))
    p_b, g_b, _, _ = facts.bytes
    largest = max(b.local(1) for b in facts.blocks)
    term = buffer_bytes(facts, Choice(2, 1, 1, 3), PlannerOptions()) - facts.buffer_bytes
    assert facts.precision == "32-true" and measured == 2
    assert (term - largest * g_b) / (largest * p_b) == measured
