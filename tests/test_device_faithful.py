"""Every layout's collectives take only tensors a GPU would hold on its device.

An NCCL group has no host backend: a tensor made on the host that reaches one of its
collectives crashes the run ("No backend type associated with device type cpu"), and so does an
op that mixes a host tensor with device ones. gloo forgives both, so CPU CI would not see them;
under ``support.device_guard.DeviceGuard`` (tensors marked by where they were made) each short
run below lists every such site. Together the runs reach every collective site of the strategy:
the step agreement with clipping, the replica check, the ZeRO 0-3 engines, the offloaded
optimizer and its consolidated and sharded saves and resumes, the pipeline's schedules in fit,
validate, test and predict and its parameter count, tensor parallelism with sequence
parallelism, ring and all-to-all context parallelism on packed chat rows, LoRA / QLoRA adapters,
and a preemption's agreed stop and checkpoint; expert parallelism with its aux loss (ep2, and
under -m slow ep2 over 4 data ranks, ep2 x pp2, a Hugging Face router's aux loss at dp2), and
``bf16-true`` at ZeRO 1-2 with fp32 masters on the device or, with ``offload="cpu"``, in host
memory. The guard sees backward too (hooks, ``autograd.Function.backward``, FSDP2's and the
pipeline's backward). Seen failing on the code before the fix, at the replica check's verdict
flag, the pipeline's parameter count and the offloaded state's gather at a save."""

from pathlib import Path

import pytest

from support.guarded_runs import guarded_fit
from tools.harness.runs import Run
from tools.harness.world import run_world

STEPS = 2
CLIP = {"gradient_clip_val": 0.5}


def _guarded(world, run, *then):
    results = run_world(guarded_fit, world, run, then)
    for rank, result in enumerate(results):
        assert not result["violations"], f"rank {rank}:\n" + "\n".join(result["violations"])
    return results


def _save_and_resume(tmp_path: Path, strategy: dict, **common):
    """``STEPS`` steps saved, then resumed in the same world for ``STEPS`` more."""
    first = Run(
        strategy=strategy,
        devices=2,
        steps=STEPS,
        save_to=str(tmp_path / "run.ckpt"),
        save_every_n_steps=STEPS,
        **common,
    )
    resumed = Run(
        strategy=strategy,
        devices=2,
        steps=2 * STEPS,
        resume_from=str(tmp_path / f"run-step={STEPS}.ckpt"),
        **common,
    )
    return first, resumed


def test_one_device_with_clipping_and_the_replica_check():
    _guarded(1, Run(strategy={}, steps=STEPS, trainer=CLIP))


@pytest.mark.parametrize(
    "strategy",
    [
        {"zero_stage": 2, "offload": "cpu"},
        {"zero_stage": 3, "offload": "cpu", "offload_params": True, "checkpoint_format": "sharded"},
    ],
    ids=["zero2-offload-consolidated", "zero3-offload-params-sharded"],
)
def test_data_parallel_offload_saves_and_resumes(tmp_path, strategy):
    _guarded(2, *_save_and_resume(tmp_path, strategy, trainer=CLIP))


@pytest.mark.parametrize("stage", [0, 1])
def test_data_parallel_buckets(stage):
    _guarded(2, Run(strategy={"zero_stage": stage}, devices=2, steps=STEPS, trainer=CLIP))


def test_tied_weights_over_pipeline_stages():
    """Qwen2's tied embedding and head: a copy on each stage, gradients summed between them
    inside ZeRO-2's buckets, the copies' replica check."""
    pytest.importorskip("transformers")
    strategy = {"pipeline": 2, "zero_stage": 2}
    _guarded(2, Run(strategy=strategy, devices=2, steps=STEPS, arch="hf_qwen2", trainer=CLIP))


def test_pipeline_fits_validates_tests_and_predicts():
    _guarded(2, Run(strategy={"pipeline": 2}, devices=2, steps=STEPS, validate=True, trainer=CLIP))


def test_tensor_parallel_with_sequence_parallelism():
    strategy = {"tensor": 2, "sequence_parallel": True}
    _guarded(2, Run(strategy=strategy, devices=2, steps=STEPS, trainer=CLIP))


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    pytest.importorskip("transformers")
    from support.chat_files import write_chat_files

    return write_chat_files(tmp_path_factory.mktemp("chat"))


@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_context_parallel_on_packed_chat_rows(chat_files, scheme):
    chat = {**chat_files, "block_size": 48, "batch_size": 4, "packing": True, "val_fraction": 0.2}
    run = Run(
        strategy={"context": 2, "context_scheme": scheme},
        devices=2,
        steps=STEPS,
        arch="hf_llama",
        data={"chat": chat},
        trainer=CLIP,
    )
    _guarded(2, run)


@pytest.mark.parametrize(
    "adapter, strategy",
    [
        ({"method": "lora", "r": 4, "lora_alpha": 8}, {"zero_stage": 3}),
        ({"method": "qlora", "r": 4, "lora_alpha": 8}, {"zero_stage": 1, "nonfinite": "skip"}),
    ],
    ids=["lora-zero3", "qlora-zero1"],
)
def test_adapters(adapter, strategy):
    pytest.importorskip("peft")
    if adapter["method"] == "qlora":
        pytest.importorskip("torchao")
    from support.qlora import WIDE

    model = {"adapter": adapter, "lr": 1e-2, "hf": WIDE}
    run = Run(strategy=strategy, devices=2, steps=STEPS, arch="hf_llama", model=model, trainer=CLIP)
    _guarded(2, run)


# The reference mixture-of-experts GPT (tests/test_expert_parallel.py's), aux loss on.
MOE = {"optimizer": "sgd", "lr": 0.3, "n_experts": 4, "top_k": 2, "shared_expert": True}
MOE["aux_loss_coef"] = 0.1


@pytest.mark.parametrize(
    "world, strategy, model",
    [
        (2, {"expert": 2, "zero_stage": 1}, MOE),
        # Two ranks hold each expert shard: the gradient hook's all-reduce over the replicas.
        pytest.param(4, {"expert": 2}, MOE, marks=pytest.mark.slow),
        pytest.param(
            4,
            {"expert": 2, "pipeline": 2, "micro_batches": 2},
            {**MOE, "n_layer": 4},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["ep2-zero1", "ep2-dp4", "ep2-pp2"],
)
def test_expert_parallelism_with_the_aux_loss(world, strategy, model):
    """Token all-to-alls forward and backward, the experts' gradient sums over replicas (a
    tensor hook, in backward), the aux loss's load counts. Seen failing with a host buffer
    planted in the exchange's backward (missed by the guard before it saw backward), with the
    counts exchanged from the host, and (ep2-dp4) with a host tensor all-reduced in the
    experts' gradient hook (also missed before)."""
    _guarded(world, Run(arch="moe", strategy=strategy, devices=world, steps=STEPS, model=model))


@pytest.mark.slow
def test_hugging_face_router_aux_loss_at_dp2():
    pytest.importorskip("transformers")
    from tools.harness.hf_configs import tiny_config

    hf = tiny_config("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    model = {"optimizer": "sgd", "lr": 0.3, "hf": hf}
    _guarded(2, Run(arch="hf", strategy={"zero_stage": 1}, devices=2, steps=STEPS, model=model))


@pytest.mark.parametrize(
    "strategy, trainer",
    [
        ({"zero_stage": 1, "offload": "cpu"}, {"accumulate_grad_batches": 2}),
        pytest.param({"zero_stage": 2}, {"accumulate_grad_batches": 2}, marks=pytest.mark.slow),
        pytest.param({"zero_stage": 1}, {}, marks=pytest.mark.slow),
    ],
    ids=["offload-split-zero1", "masters-zero2", "masters-zero1"],
)
def test_bf16_true_host_split_and_fp32_masters(strategy, trainer):
    """``bf16-true`` at ZeRO 1-2: fp32 masters on the device, or with ``offload="cpu"`` in host
    memory (ZeRO-Offload's split: reduced parts land on the host during backward, the token
    mean's factor and the clip scale reach the host gradients by a copy to the host). Catches a
    host tensor in a collective there (seen: the host accumulator all-reduced as it lands)."""
    trainer = {"precision": "bf16-true", **CLIP, **trainer}
    _guarded(2, Run(strategy=strategy, devices=2, steps=STEPS, trainer=trainer))


READ_STEPS = 4


@pytest.mark.parametrize(
    "world, strategy, chat",
    [
        (1, {}, False),
        (2, {"context": 2}, True),
        (2, {"context": 2, "context_scheme": "alltoall"}, True),
    ],
    ids=["hf-one-device", "cp2-ring-packed", "cp2-alltoall-packed"],
)
def test_one_host_read_per_step_the_agreement(chat_files, world, strategy, chat):
    """From the second step to the end of training, lightning_3d code reads one device value a
    step: the step agreement's verdict (a GPU waits for its queue at every read). Catches: the
    token count of the Hugging Face loss read with ``int`` every step, the ring attention
    reading each chunk pair's document mask to skip it (ten a step here, growing with layers
    and context ranks), a second read in the agreement."""
    from support.guarded_runs import counted_fit

    data = {}
    if chat:
        data = {"chat": {**chat_files, "block_size": 48, "batch_size": 4, "packing": True}}
        data["chat"]["val_fraction"] = 0.2
    run = Run(
        strategy=strategy,
        devices=world,
        steps=READ_STEPS,
        arch="hf_llama",
        data=data or None,
        trainer=CLIP,
    )
    for result in run_world(counted_fit, world, run):
        ours = {site: n for site, n in result["reads"].items() if site.startswith("lightning_3d/")}
        assert sum(ours.values()) == READ_STEPS - 1, ours
        assert all("agreement.py" in site for site in ours), ours
        assert not result["violations"], result["violations"]


def test_preemption_stops_every_rank_with_a_checkpoint(tmp_path):
    from support.guarded_runs import guarded_preemption

    for rank, result in enumerate(run_world(guarded_preemption, 2, str(tmp_path))):
        assert "preempted.ckpt" in result.get("preempted", ""), result
        assert not result["violations"], f"rank {rank}:\n" + "\n".join(result["violations"])


def test_replica_check_on_the_device_with_a_missing_gradient():
    """A replicated parameter with no gradient is fingerprinted on the device (a host
    ``torch.zeros(3)`` stacked with device fingerprints would fail on a GPU), and replicas that
    differ stop every rank, naming the parameter."""
    from support.guarded_runs import guarded_replica_check

    for result in run_world(guarded_replica_check, 2):
        assert not result["violations"], result["violations"]
        assert len(result["raised"]) == 1 and "value of a differs" in result["raised"][0]
