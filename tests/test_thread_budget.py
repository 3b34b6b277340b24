"""Ranks that share a host share its cores: each gets its share of threads for the work it does
there (all of it on a CPU; the offloaded optimizer's CPU Adam step on a GPU), unless
``OMP_NUM_THREADS`` says otherwise. Without it, N offloading GPU ranks would each start one
thread per core for their Adam steps and oversubscribe the host N times."""

import os

from lightning_3d.strategy.three_d import computes_on_host
from tools.harness.runs import Run, fit_gpt
from tools.harness.world import run_world


def test_which_ranks_take_a_share_of_the_host():
    """Catches: GPU ranks that offload left with a thread per core (the cap on CPUs only)."""
    assert computes_on_host("cpu", "none")
    assert computes_on_host("cuda", "cpu") and computes_on_host("cuda", "nvme")
    assert not computes_on_host("cuda", "none")  # the device computes; the host only feeds it


def _threads_after_fit(rank, run):
    import torch

    os.environ.pop("OMP_NUM_THREADS", None)  # a launcher that sets none
    torch.set_num_threads(8)  # torch's own default: a thread per core, on every rank
    fit_gpt(rank, run)
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_two_offloading_ranks_split_the_cores():
    cores = len(os.sched_getaffinity(0))
    run = Run(strategy={"zero_stage": 1, "offload": "cpu"}, devices=2, steps=1)
    for threads, omp in run_world(_threads_after_fit, 2, run):
        assert threads == max(1, cores // 2) and omp == str(threads)


def _threads_kept(rank, run):
    import torch

    os.environ["OMP_NUM_THREADS"] = "3"  # the user's word
    torch.set_num_threads(3)
    fit_gpt(rank, run)
    return torch.get_num_threads()


def test_the_users_omp_num_threads_is_kept():
    run = Run(strategy={"zero_stage": 1, "offload": "cpu"}, devices=2, steps=1)
    assert run_world(_threads_kept, 2, run) == [3, 3]
