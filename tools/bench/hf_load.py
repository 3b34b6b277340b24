"""Host memory of loading a pretrained ``transformers`` directory, per rank, by layout.

    python -m tools.bench.hf_load [--hidden 2048] [--layers 12] [--layouts dp2_zero3 tp2 pp2]

Saves a random Llama-shaped model in bf16 (the defaults: 738 M parameters, a 1.5 GB
directory) to a temporary directory, then on 2 gloo ranks (spawned: nothing inherited) builds
``HFCausalLM(path=DIR)`` and runs the strategy's recipe on it (split, tensor parallelism, FSDP2,
then the weights read), once with the deferred load (each rank reads its own slices) and once
with ``deferred_init=False`` (``from_pretrained`` whole on every rank, then sharded). Prints per
layout and mode rank 0's peak anonymous memory and peak RSS above what it had before the model
was built (RSS also counts the memory-mapped files' pages, which the page cache may drop), its
parameters' bytes after the recipe (its shard) and the largest tensor's fp32 bytes. With
``MALLOC_MMAP_THRESHOLD_=1048576`` (freed large tensors return to the OS), fp32 parameters.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import threading
from typing import Any

LAYOUTS = {
    "dp2_zero3": {"data": 2, "zero_stage": 3},
    "tp2": {"tensor": 2},
    "pp2": {"pipeline": 2},
}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


class AnonymousPeak:
    """The peak of this process's anonymous memory (``RssAnon``), sampled every millisecond on
    a thread: unlike the peak RSS it leaves out the memory-mapped weights files' pages, which
    the page cache holds and can drop (safetensors reads through ``mmap``)."""

    def __init__(self) -> None:
        self.peak, self._done = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _status_mb("RssAnon"))

    def __enter__(self) -> "AnonymousPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _status_mb("RssAnon"))


def load_on_rank(rank: int, directory: str, layout: dict, deferred: bool) -> dict[str, Any]:
    """One rank: build the model from ``directory``, run the recipe, report memory."""
    import torch

    from lightning_3d.layout import build_mesh
    from lightning_3d.models.hf import HFCausalLM
    from lightning_3d.options import Plan
    from lightning_3d.parallel.tensor import local_tensor
    from lightning_3d.strategy.recipe import parallelize

    torch.set_num_threads(1)
    plan = Plan.from_options(**layout).resolved(2)
    mesh = build_mesh(plan.layout, "cpu")
    before, anon_before = _status_mb("VmRSS"), _status_mb("RssAnon")
    with AnonymousPeak() as anon:
        module = HFCausalLM(path=directory, deferred_init=deferred)
        parallelize(module, mesh, plan, device=torch.device("cpu"))
    shard = sum(
        local_tensor(p).numel() * local_tensor(p).element_size() for p in module.parameters()
    )
    largest = max(p.numel() for p in module.parameters()) * 4
    return {
        "peak_mb": _rss_mb() - before,
        "anon_mb": anon.peak - anon_before,
        "shard_mb": shard / 2**20,
        "largest_mb": largest / 2**20,
    }


def save_directory(directory: str, hidden: int, layers: int) -> int:
    """A random Llama-shaped model saved in bf16; returns its parameter count."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875),
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    with torch.device("meta"):
        count = sum(
            p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters()
        )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    return count


def main(argv: list[str] | None = None) -> None:
    from tools.harness.world import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")  # inherited by the spawned ranks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as directory:
        count = save_directory(directory, args.hidden, args.layers)
        size = (
            sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 2**30
        )
        print(
            f"Llama-shaped, {count / 1e6:.0f} M parameters, {size:.2f} GB of bf16 safetensors; rank 0 of 2.\n"
        )
        print(
            "| layout | load | peak anonymous memory (MB) | peak RSS (MB) | own shard, fp32 (MB) | "
            "largest tensor, fp32 (MB) | anonymous peak / (shard + largest) |"
        )
        print("|---|---|---|---|---|---|---|")
        for name in args.layouts:
            for deferred in (True, False):
                row = run_world(
                    load_on_rank, 2, directory, LAYOUTS[name], deferred, start_method="spawn"
                )[0]
                ratio = row["anon_mb"] / (row["shard_mb"] + row["largest_mb"])
                print(
                    f"| {name} | {'deferred' if deferred else 'whole (from_pretrained)'} | {row['anon_mb']:.0f} | "
                    f"{row['peak_mb']:.0f} | {row['shard_mb']:.0f} | {row['largest_mb']:.0f} | {ratio:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
