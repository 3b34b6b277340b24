"""Context parallelism on ``data=chat``'s dict batches (Hugging Face's convention: unshifted
labels; packed rows with positions restarting per conversation, or right-padded rows): tiny
random ``transformers`` decoders under ``ThreeDStrategy(context=N)`` give the losses and every
weight of one process, fp32, 4 steps, both schemes, packed and padded."""

import dataclasses

import pytest

pytest.importorskip("transformers")

from support.context_worlds import assert_matches_one_process  # noqa: E402
from tools.harness.runs import Run, fit_gpt, fit_gpt_ranks  # noqa: E402
from tools.harness.world import run_world  # noqa: E402

STEPS = 4
CLIP = {"gradient_clip_val": 0.05}  # always hit: a norm over one rank's tokens would show
BLOCK = 48  # divisible by 2 × 4: the same rows at cp 2 and cp 4
_REFERENCES: dict = {}


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    from support.chat_files import write_chat_files

    return write_chat_files(tmp_path_factory.mktemp("chat"))


def _run(chat_files, arch, packing, **kwargs):
    chat = {**chat_files, "block_size": BLOCK, "batch_size": 4, "packing": packing}
    chat["val_fraction"] = 0.2
    return Run(arch=arch, steps=STEPS, trainer=CLIP, data={"chat": chat}, **kwargs)


def _others(options):
    return options.get("data", 1) * options.get("pipeline", 1) * options.get("tensor", 1)


def _reference(chat_files, arch, packing, options):
    """One process on the whole global batch: every layout, data and pipeline parallelism
    included, trains on its token mean (parallel/objective.py)."""
    key = (arch, packing)
    if key not in _REFERENCES:
        _REFERENCES[key] = fit_gpt(0, _run(chat_files, arch, packing))
    return _REFERENCES[key]


@pytest.mark.parametrize(
    "arch, scheme, packing, world, options",
    [
        ("hf_llama", "ring", True, 2, {}),
        ("hf_llama", "alltoall", True, 2, {}),
        ("hf_llama", "ring", False, 2, {}),
        ("hf_llama", "alltoall", False, 2, {}),
        ("hf_gpt2", "ring", True, 2, {}),
        ("hf_gpt2", "alltoall", False, 2, {}),
        ("hf_llama", "ring", True, 4, {}),
        ("hf_llama", "alltoall", False, 4, {"data": 2, "zero_stage": 1}),
        ("hf_llama", "ring", False, 4, {"pipeline": 2}),
        ("hf_gpt2", "alltoall", True, 4, {"tensor": 2}),
    ],
)
def test_chat_batches_match_one_process(chat_files, arch, scheme, packing, world, options):
    """A Llama-style (rotary, grouped-query) and a GPT-2-style (learned positions, tied head)
    model on chat rows; cp 2 and 4, data 2 × cp 2 (ZeRO-1), pipeline 2 × cp 2 (padded rows:
    packed ones are refused under a pipeline), tensor 2 × cp 2. At cp 4 rank 0 holds no token
    with a target in any step (its chunks are a prompt's start and the padding); at cp 2 the
    ranks' counts differ (15 and 25 at the first step). Catches (each seen failing): labels
    shifted after the cut, or shifted twice; no document mask between packed conversations;
    positions left at the whole row's 0..T-1 (GPT-2-style: rotary ones see only distances,
    which within a document do not change); a loss averaged over the ranks' means instead of
    their tokens (at cp 4: 0/0 on the rank with no target); data or pipeline ranks each taking
    the mean of their own rows' tokens."""
    reference = _reference(chat_files, arch, packing, options)
    context = world // _others(options)
    strategy = {"context": context, "context_scheme": scheme, **options}
    run = _run(chat_files, arch, packing, strategy=strategy, devices=world)
    ranks = run_world(fit_gpt_ranks, world, run)
    # self.log sees the global batch's token mean on every rank
    assert_matches_one_process(ranks, reference)


def test_the_finetune_app_trains_chat_with_the_losses_of_one_process(tmp_path):
    """``python examples/finetune.py model=hf data=chat parallelism.context=2 trainer.devices=2``
    (packed rows) against the same command on one process: the summary's losses, step by step.
    Catches: the launcher refusing chat under context parallelism, a batch reaching the ranks
    uncut or cut after its labels' shift."""
    import json
    from pathlib import Path

    from support.chat_files import write_model_dir
    from tools.harness.apps import start_app, wait_all

    repo = Path(__file__).resolve().parents[1]
    model = write_model_dir(tmp_path)
    args = [
        "model=hf",
        f"model.path={model}",
        "data=chat",
        f"data.path={tmp_path / 'chats.jsonl'}",
        f"data.block_size={BLOCK}",
        "data.batch_size=4",
        "data.val_fraction=0.2",
        "offload=none",
        "trainer.precision=32-true",
        "trainer.max_steps=3",
        "trainer.limit_val_batches=0",
    ]
    runs = {"cp2": ["trainer.devices=2", "parallelism.context=2"], "one": ["trainer.devices=1"]}
    procs = {
        name: start_app(
            repo / "examples" / "finetune.py",
            [*args, *extra, f"hydra.run.dir={tmp_path / name}"],
            repo,
        )
        for name, extra in runs.items()
    }
    done = wait_all(procs, timeout=600)
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    summaries = {name: json.loads((tmp_path / name / "summary.json").read_text()) for name in runs}
    assert summaries["cp2"]["layout"]["context"] == 2
    assert len(summaries["one"]["losses"]) == 3
    assert summaries["cp2"]["losses"] == pytest.approx(summaries["one"]["losses"], rel=1e-5)


def test_chat_validation_and_predictions_mean_what_they_mean_on_one_process(chat_files):
    """Validation and test losses on packed chat rows are whole-sequence token means; predictions
    come back as whole rows. Catches: an evaluation batch left uncut or its labels shifted after
    the cut, per-rank predictions not gathered."""
    import torch

    run = _run(chat_files, "hf_llama", True, validate=True)
    reference = fit_gpt(0, run)
    strategy = {"context": 2, "context_scheme": "ring"}
    result = run_world(fit_gpt, 2, dataclasses.replace(run, strategy=strategy, devices=2))[0]
    for split in ("val", "test"):
        assert reference[split], split
        for key, value in reference[split].items():
            assert result[split][key] == pytest.approx(value, rel=1e-5), (split, key)
    assert result["predictions"].shape == reference["predictions"].shape
    assert torch.equal(result["predictions"], reference["predictions"])
