"""What context parallelism refuses before any rank starts, each in one line naming the values:
against the model built on meta (attention it cannot route or split), and through the app (a
sequence not divisible by 2 × context); what it combines with; and the app's own run at
context=2, which must give the losses of one process."""

from pathlib import Path

import pytest

from lightning_3d.models import LitGPT
from lightning_3d.options import Plan
from lightning_3d.options.model_check import check
from tools.harness.apps import start_app, wait_all
from tools.harness.hf_configs import tiny_hf_config
from tools.harness.tiny_models import LitTinyLM

REPO = Path(__file__).resolve().parents[1]


def test_context_combines_with_auto_sequence_parallelism_and_compile():
    """The planner models the axis: ``auto`` beside ``context`` (a constraint) is a plan; so are
    tensor-parallel sequence parallelism and ``compile`` beside it (their parity:
    test_context_parallel.py)."""
    assert Plan.from_options(context=2, auto=True).layout.context == 2
    assert Plan.from_options(context=2, tensor=2, sequence_parallel=True).tp.sequence_parallel
    assert Plan.from_options(context=2, compile=True).compile.enabled


def _check(module, world, **options):
    check(module, Plan.from_options(**options), world)


def test_heads_all_to_all_cannot_split_are_named():
    model = LitGPT(n_head=4, n_embd=32, block_size=32, deferred_init=True)
    _check(model, 4, context=2, tensor=2, context_scheme="alltoall")  # 4 heads / (2 × 2)
    _check(model, 8, context=4, tensor=2)  # ring: any heads
    with pytest.raises(ValueError) as err:
        _check(model, 8, context=4, tensor=2, context_scheme="alltoall")
    assert "attention heads (4) divisible by context × tensor (4 × 2 = 8)" in str(err.value)


def test_a_model_whose_attention_cannot_be_routed_is_named():
    with pytest.raises(ValueError, match="LitTinyLM has no attention layer context parallelism"):
        _check(LitTinyLM(arch="llama", n_head=4, n_embd=32, block_size=32), 2, context=2)
    with pytest.raises(ValueError, match="attention dropout 0.1 under context=2"):
        _check(LitGPT(n_embd=32, attn_dropout=0.1, deferred_init=True), 2, context=2)


def test_hugging_face_models_the_kernels_cannot_run_are_named():
    from lightning_3d.models.hf import HFCausalLM

    gemma2 = HFCausalLM(config=tiny_hf_config("gemma2"))
    with pytest.raises(ValueError) as err:
        _check(gemma2, 2, context=2)
    assert "sliding-window attention (sliding_window=8)" in str(err.value)
    assert "soft-capping" in str(err.value)
    llama = HFCausalLM(config=tiny_hf_config("llama"))
    _check(llama, 2, context=2, context_scheme="alltoall")
    _check(llama, 4, context=2, pipeline=2)


def test_the_app_refuses_a_sequence_not_divisible_by_twice_context(tmp_path):
    args = ["model=gpt_tiny", "data.max_bytes=100000", "trainer.max_steps=1", "trainer.devices=2"]
    proc = start_app(
        REPO / "examples" / "train.py",
        [*args, "parallelism.context=2", "data.block_size=30", f"hydra.run.dir={tmp_path / 'r'}"],
        tmp_path,
    )
    done = wait_all({"run": proc}, timeout=300)["run"]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert "data.block_size=30 is not divisible by 2 × context = 4" in errors[0]
    assert "Traceback" not in done.stderr


def test_the_app_trains_with_the_losses_of_one_process(tmp_path):
    """``python examples/train.py parallelism.context=2 trainer.devices=2 data.block_size=32``
    against the same command on one process: the summary's losses, step by step."""
    import json

    args = ["model=gpt_tiny", "data.max_bytes=200000", "trainer.max_steps=4", "data.block_size=32"]
    runs = {
        "cp2": [*args, "trainer.devices=2", "parallelism.context=2"],
        "one": [*args, "trainer.devices=1"],
    }
    procs = {
        name: start_app(
            REPO / "examples" / "train.py", [*extra, f"hydra.run.dir={tmp_path / name}"], tmp_path
        )
        for name, extra in runs.items()
    }
    done = wait_all(procs, timeout=600)
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in runs}
    assert summaries["cp2"]["layout"]["context"] == 2
    assert summaries["cp2"]["losses"] == pytest.approx(summaries["one"]["losses"], rel=1e-5)
