"""Context parallelism end to end: the reference GPT trained under ``ThreeDStrategy(context=N)``
gives the losses and weights of one process (gloo worlds), for both schemes and ZeRO stages."""

import pytest

from support.context_worlds import assert_matches_one_process
from tools.harness.parity import assert_same_run
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks
from tools.harness.world import run_world

STEPS = 4
CLIP = {"gradient_clip_val": 0.05}  # always hit: a norm over one rank's tokens would show


@pytest.fixture(scope="module")
def reference():
    return fit_gpt(0, Run(steps=STEPS, trainer=CLIP))


@pytest.mark.parametrize(
    "scheme, world, options",
    [
        ("ring", 2, {}),
        ("alltoall", 2, {}),
        ("ring", 4, {}),
        ("alltoall", 4, {}),
        ("ring", 4, {"data": 2, "zero_stage": 1}),
        ("alltoall", 2, {"zero_stage": 2}),
        ("ring", 2, {"zero_stage": 3}),
        ("ring", 4, {"tensor": 2}),
        ("alltoall", 4, {"tensor": 2, "zero_stage": 3}),
        ("ring", 4, {"pipeline": 2}),
        ("alltoall", 4, {"pipeline": 2, "zero_stage": 1}),
        ("ring", 2, {"ac_policy": "full", "zero_stage": 3, "offload": "cpu"}),
        ("alltoall", 2, {"ac_policy": "selective", "offload": "cpu", "zero_stage": 1}),
        ("ring", 2, {"zero_stage": 3, "offload": "cpu", "offload_params": True}),
        ("alltoall", 2, {"zero_stage": 2, "offload": "nvme", "offload_path": "/tmp"}),
    ],
)
def test_context_parallel_gpt_matches_one_process(reference, scheme, world, options):
    """Catches: positions 0..T/cp-1 on every rank instead of the true ones, a logged loss that is
    one rank's tokens' mean (the gradients would not show it: the ranks' equal token counts make
    the average of their means the whole mean), gradients reduced over data only (cp ranks'
    weights drift apart), a batch split that is not the one the attention kernels assume."""
    others = options.get("data", 1) * options.get("tensor", 1) * options.get("pipeline", 1)
    context = world // others
    strategy = {"context": context, "context_scheme": scheme, **options}
    run = Run(strategy=strategy, devices=world, steps=STEPS, trainer=CLIP)
    ranks = run_world(fit_gpt_ranks, world, run)
    # self.log sees the whole sequence's loss on every rank (a data rank: its own rows')
    assert_matches_one_process(ranks, reference, logged="data" not in options)
    summary = ranks[0]["summary"]  # FLOPs of a token at the whole sequence's length
    assert summary["flops_per_token"] == pytest.approx(reference["summary"]["flops_per_token"])


def test_context_parallel_gradients_have_the_whole_sequences_scale():
    """cp 2 under momentum SGD without clipping against one process, every weight tensor:
    SGD's updates scale with the gradient, where AdamW and an always-hit clip (the tests above)
    hide a uniform scale. Catches the context loss's backward without its all-reduce (every
    gradient 1/cp of the true one: seen failing with the losses from the second step on and
    every weight tensor apart)."""
    sgd = {"optimizer": "sgd", "lr": 0.3}
    reference = fit_gpt(0, Run(steps=3, model=sgd))
    run = Run(strategy={"context": 2}, devices=2, steps=3, model=sgd)
    assert_matches_one_process(run_world(fit_gpt_ranks, 2, run), reference)


@pytest.mark.parametrize(
    "arch, scheme, world, options",
    [
        ("hf_llama", "ring", 2, {}),
        ("hf_llama", "alltoall", 2, {}),
        ("hf_gpt2", "ring", 2, {}),
        ("hf_gpt2", "alltoall", 2, {}),
        ("hf_llama", "ring", 4, {}),
        ("hf_gpt2", "alltoall", 4, {"zero_stage": 3}),
        ("hf_llama", "ring", 4, {"tensor": 2}),
        ("hf_gpt2", "alltoall", 4, {"tensor": 2, "zero_stage": 1}),
        ("hf_llama", "ring", 4, {"pipeline": 2}),
        ("hf_gpt2", "alltoall", 4, {"pipeline": 2, "zero_stage": 3}),
    ],
)
def test_hugging_face_decoders_through_the_attention_interface(arch, scheme, world, options):
    """A Llama-style (rotary, grouped-query) and a GPT-2-style (learned positions, tied head)
    ``transformers`` model: attention routed by a registered attention function, positions
    passed as ``position_ids``. Catches: rotary angles of positions 0..T/cp-1, the model's own
    sdpa still running on local tokens (a mask of the wrong size, or none across ranks)."""
    reference = fit_gpt(0, Run(arch=arch, steps=STEPS, trainer=CLIP))
    others = options.get("tensor", 1) * options.get("pipeline", 1)
    strategy = {"context": world // others, "context_scheme": scheme, **options}
    run = Run(arch=arch, strategy=strategy, devices=world, steps=STEPS, trainer=CLIP)
    ranks = run_world(fit_gpt_ranks, world, run)
    # A pipeline adds micro-batches' gradients in another order than one process: on some CPUs'
    # kernels the head's largest difference reaches 1.1e-5 (relative error of the tensor 8e-6).
    atol = 2e-5 if "pipeline" in options else 1e-5
    assert_matches_one_process(ranks, reference, logged=False, atol=atol)


@pytest.mark.parametrize("checkpoint_format", ["consolidated", "sharded"])
def test_a_checkpoint_resumes_under_another_context(tmp_path, checkpoint_format):
    """Checkpoints hold whole tensors by the names one process has: three steps at cp=2 (ZeRO-1),
    saved, then three more at cp=4 (ZeRO-3) equal six steps on one process."""
    straight = fit_gpt(0, Run(steps=6))
    first = run_world(
        fit_gpt,
        2,
        Run(
            strategy={"context": 2, "zero_stage": 1, "checkpoint_format": checkpoint_format},
            devices=2,
            steps=3,
            save_to=str(tmp_path / "run.ckpt"),
            save_every_n_steps=1,
        ),
    )[0]
    second = run_world(
        fit_gpt,
        4,
        Run(
            strategy={"context": 4, "zero_stage": 3, "checkpoint_format": checkpoint_format},
            devices=4,
            steps=6,
            resume_from=str(tmp_path / "run-step=3.ckpt"),
        ),
    )[0]
    assert_same_run({**second, "losses": first["losses"] + second["losses"]}, straight)


def test_validation_test_and_predictions_mean_what_they_mean_on_one_process():
    """Validation and test losses are whole-sequence token means; predictions come back as whole
    sequences (each rank predicts its own tokens, gathered over the context ranks)."""
    import torch

    reference = fit_gpt(0, Run(steps=2, validate=True))
    run = Run(strategy={"context": 2}, devices=2, steps=2, validate=True)
    result = run_world(fit_gpt, 2, run)[0]
    for split in ("val", "test"):
        for key, value in reference[split].items():
            assert result[split][key] == pytest.approx(value, rel=1e-5), (split, key)
    assert torch.equal(result["predictions"], reference["predictions"])


@pytest.mark.parametrize("scheme", ["ring", "alltoall"])
def test_bf16_mixed_precision_follows_one_process(scheme):
    """Under ``bf16-mixed`` the kernels run inside autocast: losses within bf16's rounding of one
    process's (a wrong causal mask moves them by far more; the fp32 tests above are the ones
    fine enough for positions)."""
    trainer = {"precision": "bf16-mixed"}
    reference = fit_gpt(0, Run(steps=STEPS, trainer=trainer))
    strategy = {"context": 2, "context_scheme": scheme}
    run = Run(strategy=strategy, devices=2, steps=STEPS, trainer=trainer)
    losses = run_world(fit_gpt, 2, run)[0]["losses"]
    assert losses == pytest.approx(reference["losses"], rel=1e-4)


@pytest.mark.parametrize(
    "arch, scheme, options",
    [
        ("gpt", "ring", {}),
        ("gpt", "alltoall", {"zero_stage": 3}),
        ("hf_llama", "ring", {"zero_stage": 1}),
        ("hf_gpt2", "alltoall", {}),
    ],
)
def test_sequence_parallel_tensor_beside_context(arch, scheme, options):
    """tensor 2 x context 2 with ``sequence_parallel=True``: the tensor group shards the norms
    and residual stream of this context rank's tokens along the sequence, and gathers them
    before the projections feed the attention. Catches: a refusal of the pair, and anything
    that mixes the tensor group's sequence shards up with the context ranks' chunks (positions
    of the sequence-parallel shard, attention over a shard's tokens only)."""
    reference = fit_gpt(0, Run(arch=arch, steps=STEPS, trainer=CLIP))
    strategy = {"context": 2, "context_scheme": scheme, "tensor": 2, "sequence_parallel": True}
    run = Run(arch=arch, strategy={**strategy, **options}, devices=4, steps=STEPS, trainer=CLIP)
    ranks = run_world(fit_gpt_ranks, 4, run)
    assert_matches_one_process(ranks, reference)


@pytest.mark.parametrize(
    "scheme, backend",
    [
        ("ring", "aot_eager"),
        ("alltoall", "aot_eager"),
        pytest.param("ring", "inductor", marks=pytest.mark.slow),
    ],
)
def test_compiled_blocks_beside_context(reference, scheme, backend, capfd):
    """cp 2 with ``compile=True``: each block compiled, the attention's autograd Function and its
    collectives inside it (Dynamo may break the graph around them). Catches: a refusal of the
    pair, and the activation meter holding what autograd saves while Dynamo traces that
    Function (objects Dynamo makes without their fields: "Exception ignored" at every release)."""
    strategy = {"context": 2, "context_scheme": scheme}
    compiled = {**strategy, "compile": True, "compile_backend": backend}
    ranks = run_world(
        fit_gpt_ranks, 2, Run(strategy=compiled, devices=2, steps=STEPS, trainer=CLIP)
    )
    assert_matches_one_process(ranks, reference, logged=False)
    eager = run_world(
        fit_gpt_ranks, 2, Run(strategy=strategy, devices=2, steps=STEPS, trainer=CLIP)
    )
    for rank, plain in zip(ranks[0]["summary"]["ranks"], eager[0]["summary"]["ranks"]):
        assert rank["compiled_blocks"] == 2
        # a compiled graph saves its own tensors: close to eager's, not the same
        assert rank["activation_bytes_per_block"] == pytest.approx(
            plain["activation_bytes_per_block"], rel=0.02
        )
    assert "Exception ignored" not in capfd.readouterr().err
