"""Save and load time and bytes written per rank: sharded vs consolidated checkpoints.

    python -m tools.bench.checkpoint_sharded [--world 2] [--zero-stage 3] [--n-layer 7]
        [--n-embd 768] [--repeats 3] [--dir DIR]

Trains LitGPT (50.0M parameters at the defaults, AdamW) for one step under
``ThreeDStrategy(zero_stage=...)`` on ``--world`` CPU processes, then, alternating the two
formats (A B A B ...), times ``trainer.save_checkpoint`` (every rank, until the last returns) and
a full restore (``strategy.load_checkpoint`` + model + optimizer state, as ``fit(ckpt_path=)``
does). Bytes written per rank are the sizes of the files each rank wrote. Loads read files that
were just written (page cache): they measure serialization, copies and collectives, not the disk.
Prints a markdown table with medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

FORMATS = ("consolidated", "sharded")


def _random_tokens(vocab: int, block: int, batches: int, batch_size: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randint(vocab, (batches * batch_size, block + 1), generator=g)
    return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=batch_size)


def _written_by(path: Path, rank: int, fmt: str) -> int:
    """Bytes this rank wrote for the checkpoint at ``path``."""
    if fmt == "consolidated":
        return path.stat().st_size if rank == 0 else 0
    own = path / f"__{rank}_0.distcp"
    extra = sum((path / n).stat().st_size for n in (".metadata", "meta.pt")) if rank == 0 else 0
    return (own.stat().st_size if own.exists() else 0) + extra


def measure(
    rank: int, world: int, zero_stage: int, n_layer: int, n_embd: int, repeats: int, directory: str
) -> dict[str, Any]:
    """One rank's medians per format: save seconds, load seconds, bytes written."""
    import lightning as L
    import torch.distributed as dist

    from lightning_3d import ThreeDStrategy
    from lightning_3d.models import LitGPT

    L.seed_everything(0, verbose=False)
    model = LitGPT(
        vocab_size=256, block_size=128, n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd
    )
    strategy = ThreeDStrategy(zero_stage=zero_stage)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
    )
    trainer.fit(model, train_dataloaders=_random_tokens(256, 128, 1, 2 * world))
    params = strategy.parallelized.count_parameters()
    times: dict[str, dict[str, list[float]]] = {f: {"save": [], "load": []} for f in FORMATS}
    written: dict[str, int] = {}
    for _repeat in range(repeats):
        for fmt in FORMATS:
            strategy.checkpoint_format = fmt
            path = Path(directory) / f"{fmt}.ckpt"
            dist.barrier()
            start = time.perf_counter()
            # Ends with a barrier: every rank has finished.
            trainer.save_checkpoint(path, weights_only=False)
            times[fmt]["save"].append(time.perf_counter() - start)
            written[fmt] = _written_by(path, rank, fmt)
            dist.barrier()
            start = time.perf_counter()
            checkpoint = strategy.load_checkpoint(path)
            strategy.load_model_state_dict(checkpoint)
            strategy.load_optimizer_state_dict(checkpoint)
            dist.barrier()
            times[fmt]["load"].append(time.perf_counter() - start)
    return {
        "params": params,
        "written": written,
        "median": {f: {k: statistics.median(v) for k, v in t.items()} for f, t in times.items()},
    }


def table(results: list[dict[str, Any]], world: int, zero_stage: int, repeats: int) -> str:
    lines = [
        f"LitGPT {results[0]['params'] / 1e6:.1f}M parameters, AdamW (fp32), {world} processes, "
        f"zero_stage {zero_stage}; median of {repeats} (slowest rank)",
        "",
        "| format | save s | load s | MB written per rank | total MB |",
        "|---|---|---|---|---|",
    ]
    for fmt in FORMATS:
        save = max(r["median"][fmt]["save"] for r in results)
        load = max(r["median"][fmt]["load"] for r in results)
        per_rank = [r["written"][fmt] / 1e6 for r in results]
        lines.append(
            f"| {fmt} | {save:.2f} | {load:.2f} | {' / '.join(f'{b:.0f}' for b in per_rank)} | "
            f"{sum(per_rank):.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from tools.harness.world import run_world

    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.checkpoint_sharded", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=7)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir",
        default=None,
        help="where to write the checkpoints (default: a temporary directory)",
    )
    args = parser.parse_args(argv)
    if (
        args.world < 1
        or args.repeats < 1
        or args.n_layer < 1
        or args.n_embd < 64
        or args.n_embd % 64
    ):
        parser.error(
            f"need world >= 1, repeats >= 1, n_layer >= 1, n_embd a multiple of 64; got {vars(args)}"
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = run_world(
            measure,
            args.world,
            args.world,
            args.zero_stage,
            args.n_layer,
            args.n_embd,
            args.repeats,
            tmp,
            timeout=3600,
        )
    print(table(results, args.world, args.zero_stage, args.repeats))


if __name__ == "__main__":
    main()
