"""Lightning's own behaviours, case by case, under every layout of ``ThreeDStrategy`` compared
with Lightning's ``ddp`` on 2 ranks: a compatibility suite small enough for CI.

Each case (``support/compat_cases.py``) is a tiny Lightning program adapted from what Lightning's
test suite checks: the hooks and their order in fit / validate / test / predict, ``self.log``
reductions, torchmetrics, ``EarlyStopping``, ``ModelCheckpoint(save_top_k)``, LR schedulers,
gradient accumulation and clipping, loop limits, predict outputs, manual optimization, an
override of ``backward``, an exception in ``validation_step``, the distributed sampler and
resuming from a checkpoint. Every layout runs all cases one after another in one world (one
``run_world`` per layout, ``ddp``'s once per module), and each test compares one case's record
under one layout with ``ddp``'s: logged values, hook sequences, whole weights
(``trainer.strategy.full_state_dict()``), sample ids, predictions. Where docs/parallelism.md
("Lightning features by layout") says a layout refuses a feature, the case must end in that
``ValueError``, before training.

Catches any layout that departs from ``ddp`` in what a Lightning user's code sees: a reduction
over the whole world where copies of a sample sit on tensor / context / pipeline ranks (sums and
``ModelCheckpoint`` file names doubled), a hook skipped or moved, a scheduler, clip or
accumulation the engine ignores, a checkpoint that resumes at another step or weights.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest
import torch

from support.compat_cases import CASES, run_cases
from support.compat_run import GLOBAL_BATCH
from tools.harness.parity import weight_mismatches
from tools.harness.world import run_world

# name -> (strategy: "ddp", "3d" or ThreeDStrategy keywords, ranks)
REFERENCE = "ddp"
LAYOUTS: dict[str, tuple[Any, int]] = {
    REFERENCE: ("ddp", 2),
    "3d": ("3d", 2),  # the registered preset: ZeRO 0 over 2 data ranks
    "zero3": ({"zero_stage": 3}, 2),
    "tp2": ({"tensor": 2}, 2),
    "cp2": ({"context": 2}, 2),
    "pp2": ({"pipeline": 2, "micro_batches": 2}, 2),
    # 3-D: two data ranks, each with a tensor-parallel pair, under ZeRO-2 (4 processes)
    "dp2_tp2_zero2": ({"tensor": 2, "zero_stage": 2}, 4),
}
# (case, layout) -> what the error must say: docs/parallelism.md, "Lightning features by layout".
REFUSED = {
    ("manual_optimization", "pp2"): ("ValueError: manual optimization", "pipeline=2"),
    ("backward_override", "pp2"): ("ValueError: OwnBackward.backward", "pipeline=2"),
}
WEIGHTS = dict(rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ comparisons
def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where ``got`` is not ``want``: floats and tensors to 1e-5, whole weights (a ``state``
    entry) with :func:`weight_mismatches`, everything else exactly."""
    if isinstance(want, dict) and isinstance(got, dict):
        if where.endswith("state"):
            return [f"{where}: {p}" for p in weight_mismatches(got, want, **WEIGHTS)]
        if set(got) != set(want):
            return [f"{where}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        if any(isinstance(w, str) for w in want):  # a hook sequence: from where it departs
            if list(got) == list(want):
                return []
            at = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), len(want))
            return [f"{where}: from call {at}, {got[at : at + 4]} != ddp's {want[at : at + 4]}"]
        if len(got) != len(want):
            return [f"{where}: {got} != {want}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, where)]
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        same = got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        return [] if same else [f"{where}: tensors differ (max {(got - want).abs().max()})"]
    if isinstance(want, float) and isinstance(got, (int, float)):
        return (
            [] if got == pytest.approx(want, rel=1e-5, abs=1e-6) else [f"{where}: {got} != {want}"]
        )
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def _same(ours: list[Any], ddp: list[Any], copies: int) -> list[str]:
    """Every rank recorded what ddp's rank 0 recorded (the case records what all ranks agree on)."""
    return [f"rank {r}{d}" for r, got in enumerate(ours) for d in differences(got, ddp[0])]


def _batch_end_outputs(ours: list[Any], ddp: list[Any], copies: int) -> list[str]:
    """Each rank's ``outputs["loss"]`` is its own batch's loss: the mean over ranks is the
    global batch's loss, as the mean over ddp's two halves (a token mean over equal halves)."""

    def mean(records: list[Any]) -> list[float]:
        return [sum(r["losses"][i] for r in records) / len(records) for i in range(2)]

    wrong = [
        f"rank {r}: batches {o['batches']}" for r, o in enumerate(ours) if o["batches"] != [0, 1]
    ]
    return wrong + differences(mean(ours), mean(ddp), "mean loss per batch")


def _sampler_per_rank(ours: list[Any], ddp: list[Any], copies: int) -> list[str]:
    """The same samples in every global batch: ddp's two halves, each once per copy (tensor,
    context and pipeline ranks read their data rank's samples)."""
    wrong = []
    for key in ddp[0]["seen"]:
        want = Counter(i for r in ddp for i in r["seen"][key] for _ in range(copies))
        got = Counter(i for r in ours for i in r["seen"].get(key, []))
        if got != want:
            wrong.append(
                f"epoch/batch {key}: {sorted(got.elements())} != {sorted(want.elements())}"
            )
    return wrong


def _predict_outputs(ours: list[Any], ddp: list[Any], copies: int) -> list[str]:
    """Every sample a rank predicts has ddp's plain whole-sequence logits (ddp: each rank its
    half of the samples), and together the ranks predict every sample."""
    wrong = []
    for kind in ("tensor", "dict"):
        want = {i: v for r in ddp for i, v in r[kind]["logits"].items()}
        covered = set()
        for rank, record in enumerate(ours):
            if record[kind]["types"] != ["Tensor"]:
                wrong.append(f"rank {rank}, {kind}: outputs {record[kind]['types']}")
                continue
            covered |= set(record[kind]["logits"])
            for sample, logits in record[kind]["logits"].items():
                wrong += differences(logits, want[sample], f"rank {rank}, {kind}, sample {sample}")
        if covered != set(want):
            wrong.append(f"{kind}: samples predicted {sorted(covered)} != {sorted(want)}")
    return wrong


COMPARE: dict[str, Callable[[list[Any], list[Any], int], list[str]]] = {
    name: _same for name in CASES
}
COMPARE.update(
    batch_end_outputs=_batch_end_outputs,
    sampler_per_rank=_sampler_per_rank,
    predict_outputs=_predict_outputs,
)
RANK_DEPENDENT = {"batch_end_outputs", "sampler_per_rank", "predict_outputs"}  # under ddp


# ------------------------------------------------------------------ worlds
@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> Callable[[str], list[dict[str, Any]]]:
    """Each layout's world, run on first use: every case on every rank, ``{case: record}``."""
    cache: dict[str, Any] = {}
    directory = str(tmp_path_factory.mktemp("compat"))

    def world(layout: str) -> list[dict[str, Any]]:
        if layout not in cache:
            strategy, ranks = LAYOUTS[layout]
            names = list(CASES)
            try:
                results = run_world(
                    run_cases, ranks, ranks, layout, strategy, directory, names, timeout=400
                )
                cache[layout] = [{k: v["record"] for k, v in r.items()} for r in results]
            except Exception as error:  # noqa: BLE001 -- every case of the layout reports it
                cache[layout] = error
        if isinstance(cache[layout], Exception):
            raise cache[layout]
        return cache[layout]

    return world


def _copies(layout: str) -> int:
    strategy, ranks = LAYOUTS[layout]
    if isinstance(strategy, str):
        return 1
    return strategy.get("tensor", 1) * strategy.get("context", 1) * strategy.get("pipeline", 1)


def _check(worlds: Callable, case: str, layout: str) -> None:
    ours = [r[case] for r in worlds(layout)]
    ddp = [r[case] for r in worlds(REFERENCE)]
    refused = REFUSED.get((case, layout))
    if refused is not None:
        wrong = [
            f"rank {r}: " + o.get("error", f"ran, recorded {sorted(o)}")
            for r, o in enumerate(ours)
            if not _refusal(o, refused)
        ]
        assert not wrong, f"{case} under {layout} must be refused ({refused}): " + "; ".join(wrong)
        return
    failed = [f"rank {r}: {o['error']}" for r, o in enumerate(ours) if "error" in o]
    assert not failed, f"{case} under {layout} raised: " + "; ".join(failed)
    wrong = COMPARE[case](ours, ddp, _copies(layout))
    assert not wrong, f"{case} under {layout} differs from ddp:\n" + "\n".join(wrong[:12])


def _refusal(record: Any, says: tuple[str, ...]) -> bool:
    return set(record) == {"error"} and all(s in record["error"] for s in says)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != REFERENCE])
@pytest.mark.parametrize("case", list(CASES))
def test_case_matches_ddp(worlds, case, layout):
    """The case's record under ``layout`` is ddp's on 2 ranks (or the documented refusal); on 4
    ranks, data 2 x tensor 2, each of ddp's halves sits on a tensor-parallel pair."""
    _check(worlds, case, layout)


def test_the_reference_records_what_the_cases_expect(worlds):
    """The reference itself: ddp runs every case, its ranks agree where a case records shared
    values, and the cases measure what they were built to (a check that a broken case, one
    recording nothing, cannot pass against a broken layout)."""
    ddp = worlds(REFERENCE)
    errors = {k: v["error"] for k, v in ddp[0].items() if "error" in v}
    assert errors == {}, errors
    for case in set(CASES) - RANK_DEPENDENT:
        assert differences(ddp[1][case], ddp[0][case]) == [], case
    first = ddp[0]
    assert (
        first["log_reduce"]["train_sum"] == sum(range(16))
        and first["log_reduce"]["val_count"] == 16
    )
    assert first["torchmetrics"]["cat"]["train"] == list(range(16))
    assert first["early_stopping"]["stopped_epoch"] == 2
    assert first["checkpoint_top_k"]["kept"] == [
        "epoch=3-score=1.00.ckpt",
        "epoch=4-score=2.00.ckpt",
    ]
    assert first["lr_step_interval"]["lrs"] == [0.1, 0.05, 0.025, 0.0125]
    assert first["accumulate_grad_batches"]["global_step"] == 2
    assert first["exception_in_validation"]["heard"] == ["RuntimeError"]
    assert first["resume"]["global_step"] == 4
    assert first["backward_override"]["calls"] == [0, 1]
    assert first["manual_optimization"]["global_step"] == 2
    assert len(first["sampler_per_rank"]["seen"]["0/0"]) == GLOBAL_BATCH // 2
    fit = first["hooks"]["fit"]
    assert fit.count("training_step") == 2 and fit.count("optimizer_step") == 2


def test_a_backward_override_the_pipeline_skips_is_refused():
    """Plain: the schedule runs the backward itself, so a module's own ``backward`` would be
    skipped without a word under a pipeline (the ``backward_override`` case recorded no call of
    it, and other weights than ddp's): refused by name when the strategy connects, accepted at
    ``pipeline=1`` and for a module that leaves ``backward`` to Lightning."""
    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import LitGPT

    class OwnBackward(LitGPT):
        def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
            loss.backward()

    tiny = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    pipeline = dict(pipeline=2, micro_batches=2)
    with pytest.raises(ValueError, match=r"^OwnBackward.backward does not run under pipeline=2"):
        ThreeDStrategy(**pipeline).connect(OwnBackward(**tiny))
    ThreeDStrategy().connect(OwnBackward(**tiny))
    ThreeDStrategy(**pipeline).connect(LitGPT(**tiny))
