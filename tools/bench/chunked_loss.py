"""Peak bytes and speed of the LM head + cross-entropy, whole logits against chunked ones.

    python -m tools.bench.chunked_loss [--tokens 2048] [--vocab 128256] [--width 128]
                                       [--chunks 16] [--repeats 3] [--out FILE.json]

One micro-batch's head and loss, forward and backward: ``F.cross_entropy(F.linear(h, W), t)``
against :func:`lightning_3d.parallel.chunked_loss.chunked_cross_entropy` at ``--chunks``, fp32 on
the CPU. Bytes are counted from the tensors, not from RSS (glibc keeps freed memory; see
DESIGN.md): every storage an op makes inside the measured region is added when it appears and
taken off when it is freed, and the peak of that sum is reported, with and without the head
weight's gradient (which training holds either way, and which model-state figures count). The
inputs (hidden states, weight, targets) exist before the region and are not counted. Tokens/s:
the median of ``--repeats`` timed forward + backward passes, after one untimed warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_3d.parallel.chunked_loss import chunked_cross_entropy


class StorageMeter(TorchDispatchMode):
    """Bytes of the storages ops make inside, alive at each op, and their history (so a storage
    can be left out of the peak afterwards). ``inputs``: tensors made before, not counted."""

    def __init__(self, inputs: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # address -> (ref, bytes, id)
        self.events: list[tuple[int, int]] = []  # (storage id, +bytes or -bytes)
        self.before = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._prune()
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.live and key not in self.before:
                # An id per storage: a freed storage's address is soon another's.
                uid = len(self.events)
                self.live[key] = (StorageWeakRef(storage), storage.nbytes(), uid)
                self.events.append((uid, storage.nbytes()))
        return out

    def _prune(self) -> None:
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            _, nbytes, uid = self.live.pop(key)
            self.events.append((uid, -nbytes))

    def id_of(self, tensor: torch.Tensor) -> int:
        """The id of the live storage ``tensor`` is a view of."""
        return self.live[tensor.untyped_storage().data_ptr()][2]

    def peak(self, leave_out: tuple[int, ...] = ()) -> int:
        """The most bytes alive at once, not counting the storages ``leave_out`` (ids)."""
        now = top = 0
        for uid, delta in self.events:
            if uid not in leave_out:
                now += delta
                top = max(top, now)
        return top


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def measure(loss_of: Callable, tokens: int, vocab: int, width: int, repeats: int) -> dict:
    """Peak bytes and tokens/s of ``loss_of(hidden, weight, targets)``, forward and backward."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = (torch.randn(vocab, width) * 0.02).requires_grad_()
    targets = torch.randint(vocab, (tokens,))
    targets[: tokens // 4] = -100  # a chat row's prompt: no targets there
    meter = StorageMeter((hidden, weight, targets))
    with meter:
        loss_of(hidden, weight, targets).backward()
    meter._prune()
    grad_key = meter.id_of(weight.grad)
    times = []
    for i in range(repeats + 1):
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        loss_of(hidden, weight, targets).backward()
        if i:  # the first: warm-up
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {
        "peak_bytes": meter.peak(),
        "peak_bytes_without_weight_grad": meter.peak(leave_out=(grad_key,)),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    sizes = {"tokens": args.tokens, "vocab": args.vocab, "width": args.width}
    bad = {
        k: v for k, v in {**sizes, "chunks": args.chunks, "repeats": args.repeats}.items() if v < 1
    }
    if bad:
        parser.error(f"sizes must be positive, got {bad}")
    sized = (args.tokens, args.vocab, args.width, args.repeats)

    def whole(h, w, t):
        return F.cross_entropy(F.linear(h, w), t)

    def chunked(h, w, t):
        return chunked_cross_entropy(h, w, t, args.chunks)

    rows = {
        "whole logits": measure(whole, *sized),
        f"{args.chunks} chunks": measure(chunked, *sized),
    }
    a, b = rows.values()
    result = {
        "benchmark": "chunked_loss",
        **sizes,
        "chunks": args.chunks,
        "rows": rows,
        "peak_drop": a["peak_bytes"] / b["peak_bytes"],
        "peak_drop_without_weight_grad": a["peak_bytes_without_weight_grad"]
        / b["peak_bytes_without_weight_grad"],
        "tokens_per_s_ratio": b["tokens_per_s"] / a["tokens_per_s"],
        "threads": torch.get_num_threads(),
    }
    print(f"T={args.tokens} V={args.vocab} D={args.width}, fp32, {torch.get_num_threads()} threads")
    print("| loss | peak MB | peak MB without W.grad | tokens/s |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['peak_bytes'] / 2**20:.1f} | "
            f"{row['peak_bytes_without_weight_grad'] / 2**20:.1f} | {row['tokens_per_s']:.0f} |"
        )
    print(
        f"peak drop {result['peak_drop']:.1f}x ({result['peak_drop_without_weight_grad']:.1f}x "
        f"without W.grad); tokens/s ratio {result['tokens_per_s_ratio']:.2f}x"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
