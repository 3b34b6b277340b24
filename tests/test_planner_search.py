"""What the planner's search enumerates beyond dp × tp × pp: interleaved and zero-bubble pipeline
schedules, sequence parallelism and NVMe offload — their memory and time terms, and that each
layout is built as predicted (fake world, one process).

Plain unit tests on a 4-block tiny GPT; the sequence-parallel activation bytes are measured in a
fake world (and equal a real gloo run's meter: ``python -m tools.calibration.memory
--layouts tp2_sp``, and the ``-m slow`` calibration test in test_planner.py).
"""

from __future__ import annotations

import pytest
import torch

from lightning_3d.parallel.pipeline import pipeline_options
from lightning_3d.planner import Cluster, PlannerOptions, plan_layouts
from lightning_3d.planner.choice import Choice
from lightning_3d.planner.memory import NVME_RESIDENT_BYTES, model_state, rank_memory, stage_parts
from lightning_3d.planner.schedule import bubble_share, in_flight_chunks, messages
from lightning_3d.planner.timing import step_time
from lightning_3d.strategy.choice_check import rank_kinds, validate_layout

TINY = dict(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=32)


def _tiny():
    from lightning_3d.models import LitGPT

    with torch.device("meta"):
        return LitGPT(**TINY)


@pytest.fixture(scope="module")
def facts():
    from lightning_3d.planner.facts import model_facts

    return model_facts(
        _tiny(),
        precision="bf16-mixed",
        tp_sizes=(1, 2),
        policies=("none", "full"),
        name="tiny",
        sequence_parallel=True,
    )


def _alive_peak(order, freed_by):
    """Most chunk forwards alive at once in a rank's op order, each freed by its ``freed_by`` op."""
    alive = peak = 0
    for kind, _, _ in order:
        alive += 1 if kind == "F" else -1 if kind == freed_by else 0
        peak = max(peak, alive)
    return peak


def test_in_flight_chunks_are_what_torchs_own_op_order_keeps():
    """Replayed from the ops torch's schedules run on each rank (support.schedule_trace):
    interleaved 1F1B frees a chunk's activations at its backward; zero-bubble only at its weight
    backward (the input backward retains the graph), which rank r runs r micro-batches late, so
    every rank peaks where rank 0 does."""
    from support.schedule_trace import trace_rank

    for schedule, freed_by in (("interleaved_1f1b", "B"), ("zero_bubble", "W")):
        for p in (2, 4):
            for m in (p, 2 * p):
                for rank in range(p):
                    order = trace_rank(schedule, p, 2, m, rank)
                    assert in_flight_chunks(schedule, p, m, rank, 2) == _alive_peak(
                        order, freed_by
                    ), (schedule, p, m, rank)
    assert in_flight_chunks("1f1b", 4, 8, 0) == 4 and in_flight_chunks("1f1b", 4, 8, 3) == 1
    assert in_flight_chunks("gpipe", 4, 8, 3) == 8 and in_flight_chunks("1f1b", 1, 8, 0) == 1


def test_bubbles_shrink_with_interleaving_and_zero_bubble():
    one_f_one_b = bubble_share("1f1b", 4, 8)
    assert one_f_one_b == bubble_share("gpipe", 4, 8) == 3 / 8
    assert bubble_share("interleaved_1f1b", 4, 8, 2) == one_f_one_b / 2
    assert bubble_share("zero_bubble", 4, 8, 2) == one_f_one_b / 6
    assert bubble_share("1f1b", 1, 8) == 0 and messages(1, 8) == 0
    assert messages(4, 8, 2) == 2 * messages(4, 8)


def test_interleaved_ranks_hold_their_virtual_stages(facts):
    """pp 2 × v 2 over 4 blocks: rank 0 holds stages 0 and 2 (embeddings + 2 blocks), rank 1 stages 1
    and 3 (2 blocks + head), the same parameters in total as the plain split."""
    plain, interleaved = stage_parts(facts, 2), stage_parts(facts, 2, 2)
    assert [b for _, b in interleaved] == [2, 2]
    assert sum(p.params for p, _ in interleaved) == sum(p.params for p, _ in plain)
    assert (
        interleaved[0][0].params
        == facts.first.params + facts.blocks[0].params + facts.blocks[2].params
    )
    kinds = rank_kinds(Choice(1, 1, 2, virtual_stages=2), facts.n_layer)
    assert [k.stage for k in kinds] == [0, 1] and "2 blocks + embeddings" in kinds[0].label


def test_schedules_trade_memory_for_bubble(facts):
    """At equal micro-batches: interleaving keeps more in flight on rank 0 and idles less; zero-bubble
    idles least."""
    base = dict(data=1, tensor=1, pipeline=2, micro_batches=4, batch_per_rank=8)
    choices = {
        s: Choice(**base, schedule=s, virtual_stages=1 if s == "1f1b" else 2)
        for s in ("1f1b", "interleaved_1f1b", "zero_bubble")
    }
    cluster, options = Cluster(nodes=1, devices_per_node=2), PlannerOptions()
    act = {s: rank_memory(facts, c, options).activations for s, c in choices.items()}
    bubble = {s: step_time(facts, c, cluster, options).bubble for s, c in choices.items()}
    assert act["1f1b"] < act["interleaved_1f1b"]
    assert bubble["zero_bubble"] < bubble["interleaved_1f1b"] < bubble["1f1b"]


def test_the_search_enumerates_schedules_sequence_parallelism_and_nvme(facts):
    cands = plan_layouts(
        facts,
        Cluster(nodes=1, devices_per_node=4),
        PlannerOptions(offloads=("none", "nvme"), max_micro_batches=4),
    )
    fitting = [c.choice for c in cands if c.fits]
    assert {c.schedule for c in fitting if c.pipeline > 1} == {
        "1f1b",
        "gpipe",
        "interleaved_1f1b",
        "zero_bubble",
    }
    assert {c.virtual_stages for c in fitting if c.schedule == "zero_bubble"} == {2}
    assert any(c.sequence_parallel for c in fitting) and not any(
        c.sequence_parallel for c in fitting if c.tensor == 1
    )
    assert any(c.offload == "nvme" for c in fitting)
    # pp 4 × v 2 = 8 stages for 4 blocks: not enumerated.
    assert not any(c.pipeline == 4 and c.virtual_stages > 1 for c in fitting)
    # Fewer micro-batches than stages: 1F1B refuses them, the interleaved bubble is not modelled there.
    assert all(
        c.micro_batches >= c.pipeline for c in fitting if c.pipeline > 1 and c.schedule != "gpipe"
    )
    assert any(c.micro_batches < c.pipeline for c in fitting if c.schedule == "gpipe")


def test_the_model_check_is_asked_again_for_sequence_parallelism(facts):
    """A model whose check refuses only the sequence-parallel plan: those layouts are refused by
    the check itself, not taken from the verdict on the same sizes without it."""

    def check(plan, world):
        if plan.tp.sequence_parallel:
            raise ValueError("this model cannot be sequence-parallel")

    cands = plan_layouts(
        facts, Cluster(nodes=1, devices_per_node=2), PlannerOptions(offloads=("none",)), check=check
    )
    sp = [c for c in cands if c.choice.sequence_parallel]
    assert sp and all(
        c.kind == "plan check" and "cannot be sequence-parallel" in c.reason for c in sp
    )
    assert any(c.fits and c.choice.tensor == 2 for c in cands)


def test_zero3_parameter_offload_gathers_blocks_on_the_device_whatever_holds_adam(facts):
    """ZeRO-3 with its shards in host memory still gathers a block (and the next) on the device,
    whether Adam's state is in RAM or on the drive."""
    from lightning_3d.planner.memory import buffer_bytes

    cpu, nvme = (
        buffer_bytes(facts, Choice(1, 1, 1, 3, offload=o), PlannerOptions())
        for o in ("cpu+params", "nvme+params")
    )
    assert nvme == cpu > buffer_bytes(facts, Choice(1, 1, 1, 3, offload="cpu"), PlannerOptions())


def test_sequence_parallelism_keeps_less_in_the_same_time(facts):
    tp2, sp = (
        Choice(1, 2, 1, batch_per_rank=8),
        Choice(1, 2, 1, batch_per_rank=8, sequence_parallel=True),
    )
    options, cluster = PlannerOptions(), Cluster(nodes=1, devices_per_node=2)
    assert (
        rank_memory(facts, sp, options).activations < rank_memory(facts, tp2, options).activations
    )
    assert (
        step_time(facts, sp, cluster, options).total
        == step_time(facts, tp2, cluster, options).total
    )
    assert sp.options()["sequence_parallel"] is True and "sequence_parallel" not in tp2.options()


def test_nvme_keeps_adams_state_on_the_drive(facts):
    from lightning_3d.offload.storage import pinned_bytes

    ((part, _),) = stage_parts(facts, 1)
    cpu = model_state(facts, Choice(2, 1, 1, 1, offload="cpu"), part)
    nvme = model_state(facts, Choice(2, 1, 1, 1, offload="nvme"), part)
    assert nvme[2] == cpu[2] == 0  # no optimizer state on the device
    # The state on the drive, a window in RAM; in RAM, the same state as the pinned blocks hold.
    assert cpu[3] == pinned_bytes(nvme[4]) and nvme[3] == NVME_RESIDENT_BYTES
    params = model_state(facts, Choice(2, 1, 1, 3, offload="nvme+params"), part)
    assert params[0] == params[1] == 0 and params[3] > NVME_RESIDENT_BYTES  # shards in RAM
    assert Choice(2, 1, 1, 3, offload="nvme+params").options() | {} == {
        **Choice(2, 1, 1, 3).options(),
        "offload": "nvme",
        "offload_params": True,
    }
    cluster, options = Cluster(nodes=1, devices_per_node=2), PlannerOptions()
    nvme_time = step_time(
        facts, Choice(2, 1, 1, 1, offload="nvme", batch_per_rank=4), cluster, options
    ).offload
    cpu_time = step_time(
        facts, Choice(2, 1, 1, 1, offload="cpu", batch_per_rank=4), cluster, options
    ).offload
    assert nvme_time > cpu_time > 0


def test_a_host_too_small_for_cpu_offload_plans_nvme_and_a_full_drive_refuses_it():
    """A 15 M-parameter model whose offloaded Adam state (120 MB) does not fit the host's 80 MB, but
    the NVMe store's window does; with no room on the drive nothing fits."""
    from lightning_3d.models import LitGPT
    from lightning_3d.planner.facts import model_facts

    with torch.device("meta"):
        module = LitGPT(**{**TINY, "n_layer": 2, "n_embd": 768})
    wide = model_facts(module, precision="bf16-mixed", policies=("none",))
    options = PlannerOptions(
        reserve_gb=0, offloads=("cpu", "nvme"), zero_stages=(0,), ac_policies=("none",)
    )
    tight = dict(nodes=1, devices_per_node=1, device_memory_gb=1, host_memory_gb=0.08)
    cands = plan_layouts(wide, Cluster(**tight), options)
    assert cands[0].fits and cands[0].choice.offload == "nvme"
    assert any(c.kind == "host memory" and c.choice.offload == "cpu" for c in cands)
    full = plan_layouts(wide, Cluster(**tight, nvme_gb=0.01), options)
    assert not any(c.fits for c in full) and any(c.kind == "NVMe space" for c in full)


def test_interleaved_micro_batches_must_fill_torchs_rounds():
    with pytest.raises(ValueError, match=r"micro_batches=16 in 5 rounds .* use 15 or 20"):
        pipeline_options(3, 16, "zero_bubble", None)
    assert pipeline_options(3, 15, "interleaved_1f1b", None)["virtual_stages"] == 2


@pytest.mark.parametrize(
    "choice",
    [
        Choice(
            data=2,
            tensor=2,
            pipeline=2,
            zero_stage=1,
            micro_batches=2,
            schedule="interleaved_1f1b",
            batch_per_rank=2,
            virtual_stages=2,
        ),
        Choice(
            data=2, tensor=2, pipeline=1, zero_stage=3, batch_per_rank=2, sequence_parallel=True
        ),
    ],
    ids=["interleaved", "sequence_parallel"],
)
def test_interleaved_and_sequence_parallel_layouts_are_built_as_predicted(facts, choice):
    """Each rank kind built at world 8 in a fake world: its own stages' parameters, placements and
    bytes as the planner predicts."""
    result = validate_layout(_tiny, facts, choice, "bf16-mixed")
    assert not result.problems, result.problems
    assert len(result.built) == 2 * (choice.pipeline if choice.pipeline > 1 else 1)


def test_the_fake_world_measurement_equals_the_local_shape_copy(facts):
    """Without sequence parallelism, the block measured as one rank of a fake world under the plain
    tensor-parallel plan keeps exactly the bytes of the local-shape copy ``model_facts`` measures:
    the fake world that measures sequence parallelism counts as the plain measurement does."""
    from lightning_3d.parallel.activation_checkpoint import transformer_blocks
    from lightning_3d.parallel.plans import build_plan
    from lightning_3d.parallel.tensor import resolve_plan
    from lightning_3d.planner.activations import measure_sequence_parallel

    module = _tiny()
    name, block = transformer_blocks(module)[0]
    plan = resolve_plan(module, build_plan(module, None, False), 2)
    own = {k[len(name) + 1 :]: v for k, v in plan.items() if k.startswith(name + ".")}
    fake = measure_sequence_parallel(
        (name, block),
        own,
        forward=None,
        d_model=facts.d_model,
        seq_len=facts.seq_len,
        act_bytes=2,
        policies=("none", "full"),
        tp=2,
    )
    for policy in ("none", "full"):
        assert fake[(policy, 2, "sp")].points == facts.activation(policy, 2).points
    assert facts.activation("none", 2, True).bytes_per_sample(32) < facts.activation(
        "none", 2
    ).bytes_per_sample(32)


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_the_forward_alone_counts_what_a_backward_would_free(policy):
    """The planner measures a block's forward only (a backward costs minutes at a 70B width on a
    CPU without fast bf16 matmuls); with a backward after it the meter's count is the same."""
    from lightning_3d.parallel.activation_checkpoint import transformer_blocks
    from lightning_3d.planner.activations import _materialize, _measure

    block = _materialize(transformer_blocks(_tiny())[0][1], torch.float32)
    call = lambda b, x: b(x)  # noqa: E731
    assert (
        _measure(block, call, 32, 32, policy)
        == _measure(block, call, 32, 32, policy, backward=True)
        > 0
    )


def test_a_block_that_cannot_run_alone_leaves_its_sequence_parallel_layouts_unmeasured(
    monkeypatch,
):
    """A block whose forward fails on its own (here: the model's block forward made to raise, as
    a family whose layers need inputs the meter cannot give) cannot be measured in the
    sequence-parallel fake world: the planner still plans, and refuses those layouts as not
    measured instead of failing (it raised NotImplementedError). The same Llama block, run in
    its model's place, is measured in every case."""
    pytest.importorskip("transformers")
    import dataclasses

    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.planner.search import plan_candidates
    from tools.harness.hf_configs import tiny_hf_config

    with torch.device("meta"):
        module = HFCausalLM(config=tiny_hf_config("llama"))
    cluster, options = (
        Cluster(nodes=1, devices_per_node=2),
        PlannerOptions(offloads=("none",), seq_len=16),
    )
    facts, _ = plan_candidates(module, cluster, options)
    assert all(fit.source == "measured" for fit in facts.activations.values())
    assert any(len(key) > 2 for key in facts.activations)  # sequence parallelism measured

    def fails(block, x):
        raise NotImplementedError("this block needs inputs the meter cannot give")

    spec = dataclasses.replace(module.pipeline_spec(), block_forward=fails)
    monkeypatch.setattr(module, "pipeline_spec", lambda: spec)
    facts, cands = plan_candidates(module, cluster, options)
    assert not any(len(key) > 2 for key in facts.activations)  # no sequence-parallel fit
    sp = [c for c in cands if c.choice.sequence_parallel]
    assert sp and all(c.kind == "activations not measured" for c in sp)
    assert any(c.fits and c.choice.tensor == 2 for c in cands)


# Fine-tune methods: the adapters on every linear projection of the blocks (planner/methods.py).


def _linear_weights(module):
    """(in, out) of every nn.Linear of the model's blocks: what peft's all-linear adapts."""
    from lightning_3d.parallel.activation_checkpoint import transformer_blocks

    return [
        (m.in_features, m.out_features)
        for _, block in transformer_blocks(module)
        for m in block.modules()
        if isinstance(m, torch.nn.Linear)
    ]


def test_lora_and_qlora_model_state_follow_their_formulas(facts):
    """On the tiny GPT's facts (bf16-mixed: fp32 parameters): a full fine-tune keeps 16Ψ, LoRA
    4Ψ + 16Φ and QLoRA 0.516Ψq + 4(Ψ − Ψq) + 16Φ, to the byte, with Φ = r·(in + out) and Ψq
    counted from the module's own nn.Linear layers; QLoRA's projections at most 0.3 of bf16's."""
    from lightning_3d.adapters.qlora import NF4_BYTES_PER_VALUE
    from lightning_3d.planner.memory import stage_block_parts

    r = 8
    linears = _linear_weights(_tiny())
    phi = sum(r * (i + o) for i, o in linears)
    psi_q = sum(i * o for i, o in linears)
    psi = facts.num_params
    ((part, _),) = stage_parts(facts, 1)
    (blocks,) = stage_block_parts(facts, 1)

    def state(adapter, data=1, zero=0):
        return model_state(facts, Choice(data, 1, 1, zero, adapter=adapter), part, 0, blocks, r)

    assert sum(state("none")[:3]) == 16 * psi
    params, grads, optimizer, _, _ = state("lora")
    assert (params, grads, optimizer) == (4 * psi + 4 * phi, 4 * phi, 8 * phi)
    params, grads, optimizer, _, _ = state("qlora")
    assert params + grads + optimizer == pytest.approx(
        NF4_BYTES_PER_VALUE * psi_q + 4 * (psi - psi_q) + 16 * phi, abs=1e-6
    )
    assert (params - 4 * phi - 4 * (psi - psi_q)) <= 0.3 * 2 * psi_q  # vs the projections in bf16
    # ZeRO 1: the adapters' Adam state sharded, the frozen base whole; ZeRO 3: the base sharded too.
    assert state("lora", 2, 1)[:3] == (4 * psi + 4 * phi, 4 * phi, 4 * phi)
    assert state("lora", 2, 3)[0] == pytest.approx((4 * psi + 4 * phi) / 2, rel=0.02)


def test_adapters_of_llama_3_8b_are_peft_s_count():
    """Φ from the shapes alone, on Llama-3-8B's projections (q, k, v, o, gate, up, down; the
    plan's column / row split): 20,971,520 at r = 8, peft's trainable-parameter count for
    all-linear; the tensor-parallel share keeps A beside a column-parallel base and B beside a
    row-parallel one whole."""
    from lightning_3d.planner.facts import Part
    from lightning_3d.planner.methods import adapter_part, projections

    d, kv, ff = 4096, 1024, 14336
    shapes = {(d, d * d, 0): 1, (kv, kv * d, 0): 2, (d, d * d, 1): 1, (ff, ff * d, 0): 2}
    shapes[(d, d * ff, 1)] = 1
    shapes[(d, d, -1)] = 2  # the norms: not projections
    block = Part(tensors=tuple(sorted(shapes.items())))
    assert adapter_part(block, 8).params * 32 == 20_971_520
    assert projections(block).params == 2 * d * d + 2 * kv * d + 3 * d * ff
    whole = 8 * d * (5 + 2)  # A of the five column bases (in: d), B of the two row ones (out: d)
    assert adapter_part(block, 8).local(2) == (adapter_part(block, 8).params + whole) / 2


def test_the_search_enumerates_methods_only_when_asked(facts):
    cluster = Cluster(nodes=1, devices_per_node=2, device_memory_gb=80)
    default = plan_layouts(facts, cluster, PlannerOptions(offloads=("none",)))
    assert {c.choice.adapter for c in default} == {"none"}
    lora = plan_layouts(facts, cluster, PlannerOptions(offloads=("none",), adapters=("lora",)))
    assert {c.choice.adapter for c in lora} == {"lora"}
    assert not any(c.choice.sequence_parallel for c in lora)  # refused by the project
    assert any(c.fits and c.choice.tensor == 2 for c in lora)
    # LoRA's fastest layout beats the full fine-tune's: no weight gradients, Adam over Φ alone.
    assert lora[0].tokens_per_s > default[0].tokens_per_s
    assert lora[0].time.optimizer < default[0].time.optimizer / 3
    both = plan_layouts(facts, cluster, PlannerOptions(adapters=("none", "lora")))
    assert {c.choice.adapter for c in both if c.fits} == {"none", "lora"}


@pytest.fixture(scope="module")
def nf4_facts():
    """A GPT whose projections NF4 can hold (128 wide: every weight a multiple of 64 × 256)."""
    from lightning_3d.models import LitGPT
    from lightning_3d.planner.facts import model_facts

    with torch.device("meta"):
        module = LitGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=128)
    return model_facts(module, precision="bf16-mixed", tp_sizes=(1, 2), policies=("none",))


def test_qlora_with_tensor_parallelism_is_refused_with_the_projects_reason(nf4_facts, facts):
    options = PlannerOptions(adapters=("qlora",), ac_policies=("none",), offloads=("none",))
    cands = plan_layouts(
        nf4_facts, Cluster(nodes=1, devices_per_node=2, device_memory_gb=80), options
    )
    tp2 = [c for c in cands if c.choice.tensor == 2]
    assert tp2 and not any(c.fits for c in tp2)
    assert all(
        c.kind == "plan check"
        and c.reason.startswith("adapter method='qlora' cannot run with tensor=2: the NF4 base")
        for c in tp2
    )
    assert any(c.fits for c in cands if c.choice.tensor == 1)
    # A model whose projections NF4 cannot hold (the tiny GPT's 32 × 32) is refused as the project does.
    tiny = plan_layouts(facts, Cluster(nodes=1, devices_per_node=1, device_memory_gb=80), options)
    assert {c.kind for c in tiny} == {"NF4 shapes"}
    assert "multiple of 16384 elements in NF4" in tiny[0].reason and "(32, 32)" in tiny[0].reason
