"""What "the same run" means for parity tests, in one place.

Losses must agree within ``rtol`` relative. Weights are compared per tensor: the relative
Frobenius error ``||a - b|| / ||b||`` must be within ``rtol``, and no element may differ by more
than ``atol``. Elementwise relative error is deliberately not used: Adam divides by
``sqrt(v) + eps``, so for an embedding row of a byte seen once or twice, a last-ulp difference
in the gradient sum (ranks add in a different order) becomes a 1e-4 relative change of a
near-zero update. A real bug (a missing rank, a wrong average, a local clip norm) moves
whole tensors by about the learning rate, orders of magnitude above these bounds.
"""

from __future__ import annotations

import math

from torch import Tensor


def loss_mismatches(losses: list[float], reference: list[float], rtol: float = 1e-5) -> list[str]:
    if len(losses) != len(reference):
        return [f"{len(losses)} losses vs {len(reference)} in the reference"]
    return [
        f"step {i}: {a:.8f} vs {b:.8f}"
        for i, (a, b) in enumerate(zip(losses, reference))
        if not math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)
    ]


def weight_mismatches(
    state: dict[str, Tensor], reference: dict[str, Tensor], rtol: float = 1e-5, atol: float = 1e-5
) -> list[str]:
    if set(state) != set(reference):
        return [f"keys differ: {sorted(set(state) ^ set(reference))}"]
    problems = []
    for name, ref in reference.items():
        got = state[name].float()
        ref = ref.float()
        if got.shape != ref.shape:
            problems.append(f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}")
            continue
        diff = got - ref
        rel = (diff.norm() / ref.norm().clamp_min(1e-12)).item()
        worst = diff.abs().max().item() if diff.numel() else 0.0
        if rel > rtol or worst > atol:
            problems.append(
                f"{name}: relative error {rel:.2e} (max {rtol:.0e}), max abs {worst:.2e} (max {atol:.0e})"
            )
    return problems


def assert_same_run(run: dict, reference: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Raise ``AssertionError`` listing every loss and weight that differs from the reference."""
    problems = loss_mismatches(run["losses"], reference["losses"], rtol)
    problems += weight_mismatches(run["state"], reference["state"], rtol, atol)
    if problems:
        raise AssertionError("run differs from the reference:\n  " + "\n  ".join(problems))


__all__ = [
    "assert_same_run",
    "loss_mismatches",
    "rank_state_mismatches",
    "update_mismatches",
    "weight_mismatches",
]


def checkpoint_tensors(checkpoint: dict) -> dict:
    """Model tensors and the first optimizer's state tensors of a consolidated checkpoint dict,
    under comparable names (``model/<name>``, ``optim/<index>/<key>``), for :func:`weight_mismatches`."""
    out = {f"model/{k}": v for k, v in checkpoint["state_dict"].items()}
    for index, state in checkpoint["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            out[f"optim/{index}/{key}"] = value.reshape(-1) if value.dim() == 0 else value
    return out


def update_mismatches(
    state: dict[str, Tensor],
    reference: dict[str, Tensor],
    initial: dict[str, Tensor],
    rtol: float,
    atol: float = 0.0,
) -> list[str]:
    """Per tensor, the relative error of the *update*: ``||(a - w0) - (b - w0)|| / ||b - w0||``
    must be within ``rtol``, for every tensor of ``state`` (a rank may hold a part of the model:
    its names must be in ``reference``). For runs whose rounding differs (mixed precision), where
    the weights' own relative error would hide a wrong update under the size of the weights: a
    missing reduction or a skipped step changes the update by O(1), rounding by a few units of
    the format's precision per step.

    ``atol`` (per element: ``||(a - w0) - (b - w0)|| <= atol * sqrt(numel)`` passes too) is for
    fp64 runs: a gradient that is mathematically zero (a router whose choice cannot change, a key
    bias the softmax ignores) is rounding noise far below Adam's ``eps``, so its update is a
    tiny step in a random direction, wrong by 100 % relative and by 1e-15 absolute."""
    if not state or not set(state) <= set(reference):
        return [
            f"names not in the reference: {sorted(set(state) - set(reference))} (of {len(state)})"
        ]
    problems = []
    for name, got in state.items():
        if name not in initial:
            continue  # a buffer the module does not save
        start = initial[name].double()  # double: an fp64 run's error is not rounded to fp32
        want = reference[name].double() - start
        diff = (got.double() - start - want).norm()
        err = (diff / want.norm().clamp_min(1e-30)).item()
        if not (err <= rtol or diff.item() <= atol * want.numel() ** 0.5):  # NaN fails too
            floor = f", or {atol:.0e} per element" if atol else ""
            problems.append(
                f"{name}: update relative error {err:.2e} (max {rtol:.1e}{floor}; "
                f"|update| {want.norm().item():.1e})"
            )
    return problems


def rank_state_mismatches(
    runs: list[dict], reference: dict, rtol: float = 1e-5, atol: float = 1e-5
) -> list[str]:
    """:func:`weight_mismatches` of every rank's own parameters (``fit_gpt_ranks`` or ``Run(rank_state=True)``)
    against the reference's, each rank under its own label: a rank whose copy is stale or wrong
    shows, not only rank 0's gathered weights."""
    problems = []
    for rank, run in enumerate(runs):
        own = run["rank_state"] or {}
        unknown = sorted(set(own) - set(reference["state"]))
        if not own or unknown:
            problems.append(f"rank {rank}: no parameters, or names not in the reference: {unknown}")
            continue
        ref = {name: reference["state"][name] for name in own}
        problems += [f"rank {rank}: {p}" for p in weight_mismatches(own, ref, rtol, atol)]
    return problems
