"""``summary.json`` reports the activations offloaded to the host (``activation_offload``) beside
those kept on the device: one-process Trainer runs of the tiny GPT, with and without offload."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def runs():
    import torch.distributed as dist

    from tools.harness.runs import Run, fit_gpt

    try:
        return {
            offload: fit_gpt(0, Run(strategy={"activation_offload": offload}, devices=1, steps=2))
            for offload in (False, True)
        }
    finally:  # the strategy's one-rank process group, left for the next test otherwise
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_summary_counts_host_activation_bytes(runs):
    """Catches: a summary that reports device bytes only, so an offloaded run looks as if it
    saved nothing for backward (0 bytes per block) instead of moving it to the host."""
    kept = runs[False]["summary"]["ranks"][0]
    moved = runs[True]["summary"]["ranks"][0]
    assert kept["activation_host_bytes_per_block"] == kept["activation_host_peak_bytes"] == 0
    assert kept["activation_bytes_per_block"] > 0
    # offloaded: nothing of the blocks' saves stays on the device, all of it is on the host
    # (a view saved twice is copied twice: up to ~1.2x, parallel/activation_offload.py)
    assert moved["activation_bytes_per_block"] == 0
    host = moved["activation_host_bytes_per_block"]
    assert kept["activation_bytes_per_block"] <= host <= 1.3 * kept["activation_bytes_per_block"]
    # every block's saves are alive together at the end of forward
    blocks = moved["blocks_on_rank"]
    assert moved["activation_host_peak_bytes"] >= blocks * host * 0.99
