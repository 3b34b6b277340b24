"""The buffers of asynchronous collectives stay whole until their work ends (gloo worlds).

gloo writes a received message, or a reduction's result, from a thread of its own through the
pointer it took when the work started; a storage freed, resized or swapped before then makes
it write into freed memory, and the heap is found corrupted later, at an unrelated ``malloc``,
once in many loaded runs (docs/testing.md). :class:`support.buffer_guard.BufferGuard` sees the
hazard itself, every time: it records each collective's buffers and checks them at every later
op while the work is in flight, and checks that no op reaches past a tensor's storage. A peer
delayed before each of its collectives keeps the other rank's works in flight, so an early
free is in the window on every run.

The first tests show the guard failing on the hazard planted; the others run the project's
asynchronous paths under it: ZeRO 1-2's bucket reductions and point-to-point exchanges, FSDP2's
gathers and reduce-scatters through the custom hooks (ZeRO-3), and under ``-m slow`` the worlds
that once died of a corrupted heap (QLoRA at dp2 ZeRO-3, Phi at tp2 with sequence parallelism),
LoRA at ZeRO-3, the ring of context parallelism and a pipeline.
"""

from __future__ import annotations

import pytest
import torch

from support.buffer_guard import BufferGuard, buffer_guarded_fit, past_storage
from tools.harness.runs import Run
from tools.harness.world import run_world


def test_an_op_on_a_view_past_its_storage_is_seen():
    """FSDP2 frees a gathered parameter by resizing its storage to 0; a view of it used after
    that reads freed memory, and torch does not stop it."""
    whole = torch.ones(100)
    view = whole[10:]
    with BufferGuard() as guard:
        view.mul(2)  # still whole: fine
        assert not guard.problems
        whole.untyped_storage().resize_(40)
        view.mul(2)
    assert past_storage(view) == (400, 40)
    assert guard.problems == ["aten.mul.Tensor reads self (90,): 400 bytes of a storage of 40"]


def _reduce_then_swap(rank: int, plant: bool) -> tuple[list[str], int]:
    """An asynchronous all-reduce whose tensor gets another storage (``set_``, what ``.data =``
    does too): after its wait (fine), or before it, while rank 1 is late to the reduction (the
    hazard). The old storage is kept alive here, so the planted run corrupts nothing."""
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        with BufferGuard() as guard:
            tensor = torch.ones(1000)
            old = tensor.untyped_storage()
            if rank == 1:
                time.sleep(0.5)  # rank 0's work stays in flight meanwhile
            work = dist.all_reduce(tensor, async_op=True)
            if not plant:
                work.wait()
            tensor.set_(torch.zeros(1000).untyped_storage())
            torch.zeros(1).add_(1)  # any op: where the guard looks
            work.wait()
            del old
        return guard.problems, guard.issued
    finally:
        dist.destroy_process_group()


def test_a_buffer_swapped_while_its_reduction_is_in_flight_is_seen():
    clean = run_world(_reduce_then_swap, 2, False)
    assert [problems for problems, _ in clean] == [[], []]
    assert [issued for _, issued in clean] == [1, 1]
    planted = run_world(_reduce_then_swap, 2, True)
    assert "c10d.allreduce_.default: a buffer's storage changed while the work was in flight" in (
        planted[0][0][0] if planted[0][0] else ""
    ), planted


GPT = {"steps": 3, "seed": 1234}
LAYOUTS = {
    # Bucket reductions started in backward, the ZeRO-1 gather and exchanges of rows (gloo).
    "zero1": {"data": 2, "zero_stage": 1},
    "zero2": {"data": 2, "zero_stage": 2},
    # FSDP2's gathers and reduce-scatters through the point-to-point hooks.
    "zero3": {"data": 2, "zero_stage": 3},
}


def _assert_clean(world: list[dict]) -> None:
    for rank, result in enumerate(world):
        assert result["issued"] > 10, f"rank {rank} watched {result['issued']} collectives"
        assert not result["problems"], f"rank {rank}:\n  " + "\n  ".join(result["problems"][:10])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_exchanges_keep_their_buffers_until_they_end(layout):
    """Rank 1 late to every collective: rank 0's works are in flight while it goes on. Catches a
    bucket, a row or a gathered buffer freed or swapped before its exchange has ended."""
    run = Run(strategy=LAYOUTS[layout], devices=2, **GPT)
    _assert_clean(run_world(buffer_guarded_fit, 2, run, 1, 0.02))


SLOW_RUNS = {
    "qlora_dp2_zero3": ("qlora", {"data": 2, "zero_stage": 3}),
    "lora_dp2_zero3": ("lora", {"data": 2, "zero_stage": 3}),
    "phi_tp2_sp": ("hf_phi", {"tensor": 2, "sequence_parallel": True}),
    "qwen3_cp2_ring": ("hf_qwen3", {"context": 2}),
    "gpt_pp2": ("gpt", {"pipeline": 2}),
}


def _slow_run(kind: str, strategy: dict) -> Run:
    if kind in ("qlora", "lora"):
        from support.qlora import qlora_run

        return qlora_run(strategy, {"method": kind, "r": 4, "lora_alpha": 8}, devices=2)
    return Run(strategy=strategy, devices=2, arch=kind, **GPT)


@pytest.mark.slow
@pytest.mark.parametrize("delay_rank", [0, 1])
@pytest.mark.parametrize("name", list(SLOW_RUNS))
def test_worlds_that_died_of_a_corrupted_heap_keep_their_buffers(name, delay_rank):
    """The worlds whose rank once died of SIGABRT, and the other asynchronous paths, each rank
    in turn late: DTensor's functional collectives, NF4 under FSDP2, the ring's passes, a
    pipeline's sends and receives."""
    _assert_clean(run_world(buffer_guarded_fit, 2, _slow_run(*SLOW_RUNS[name]), delay_rank, 0.02))
