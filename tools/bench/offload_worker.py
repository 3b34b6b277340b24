"""One configuration of :mod:`tools.bench.offload_memory` in its own process, and the
parent's side of talking to it: the worker trains one step per ``step`` line on stdin and
answers with one ``BENCH {json}`` line. Shared by the benchmark's fixed rows and its size
ladder (:mod:`tools.bench.offload_ladder`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from typing import Any

from tools import pythonpath

MODEL = {
    "vocab_size": 256,
    "block_size": 128,
    "n_layer": 7,
    "n_head": 12,
    "n_embd": 768,
    "dropout": 0.0,
}


def model_config(
    n_layer: int, n_embd: int, vocab_size: int = MODEL["vocab_size"], seq: int = 0
) -> dict[str, Any]:
    """The benchmark's LitGPT settings at another depth / width (64-wide heads) and vocabulary;
    the positional table covers ``seq`` tokens when that is longer than the default 128."""
    return {
        **MODEL,
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_embd // 64,
        "vocab_size": vocab_size,
        "block_size": max(MODEL["block_size"], seq),
    }


PREFIX = "BENCH "


@dataclass(frozen=True)
class Row:
    """One configuration, run in its own process."""

    precision: str
    batch: int
    seq: int
    offload: str = "none"  # none | cpu | nvme
    checkpointing: str = "none"  # activation checkpointing: none | full
    params: bool = False  # ZeRO-3 with the parameters offloaded too (offload_params=True)
    overlap: bool = True  # offload: transfers on side streams beside the CPU step (offload_overlap)
    # Offload: the update one step behind, beside the next forward (offload_delay_update).
    delay: bool = False


def _say(record: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(record), flush=True)


def run_worker(args: argparse.Namespace) -> None:
    """One configuration: train ``1 + rounds`` steps, each started by a ``step`` line on stdin."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_3d import ThreeDStrategy
    from lightning_3d.data import TextDataModule
    from lightning_3d.models import LitGPT
    from lightning_3d.observe.memory import peak_rss_mb
    from lightning_3d.observe.summary import RunSummary
    from lightning_3d.offload import OffloadedAdam

    def sync() -> None:  # a step's time is its kernels' time, not the launch queue's
        if args.accelerator == "gpu":
            torch.cuda.synchronize()

    class Lockstep(Callback):
        """Wait for the parent before each step; report the step's wall and CPU seconds, and the
        wall seconds of forward + backward (up to ``on_before_optimizer_step``), of the rest
        (clipping, the optimizer step and its transfers) and, offloaded, of the CPU step alone
        (``OffloadedAdam.last_update_cpu_s``)."""

        def on_train_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
        ) -> None:
            if batch_idx == 0:
                sync()
                _say(
                    {
                        "ready": True,
                        "base_rss_mb": base_rss,
                        "build_s": time.perf_counter() - build_start,
                        "build_peak_rss_mb": peak_rss_mb(),
                    }
                )
            if sys.stdin.readline().strip() != "step":
                raise SystemExit("benchmark parent went away")
            self.start = time.perf_counter(), time.process_time()
            self.backward_done: float | None = None

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            sync()
            self.backward_done = time.perf_counter()

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            sync()
            end = time.perf_counter()
            split = (
                {}
                if self.backward_done is None
                else {  # None: the hook did not run (a skipped step)
                    "fwd_bwd_s": self.backward_done - self.start[0],
                    "optimizer_s": end - self.backward_done,
                }
            )
            updates = [
                o.last_update_cpu_s for o in trainer.optimizers if isinstance(o, OffloadedAdam)
            ]
            if updates and None not in updates:  # delayed: the update that ran beside this step
                split["cpu_step_s"] = sum(updates)
            _say(
                {
                    "step_s": end - self.start[0],
                    "cpu_s": time.process_time() - self.start[1],
                    **split,
                }
            )

    torch.set_num_threads(args.threads)
    if args.device_memory_gb is not None:  # before anything is allocated on the device
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, args.device_memory_gb * 2**30 / total), 0
        )
    L.seed_everything(0, verbose=False)
    data = TextDataModule(
        corpus="stdlib", block_size=args.seq, batch_size=args.batch, max_bytes=1_000_000, seed=0
    )
    data.setup_for(1, 0)  # the corpus now, so that it is part of the base RSS
    base_rss = peak_rss_mb()  # interpreter, torch, Lightning and the corpus: the same in every row
    build_start = time.perf_counter()  # build time: model, Trainer setup, up to the first batch
    # Built on meta and materialised by the strategy in its final place (--eager-init: the
    # model whole in fp32 on the host first, then cast, moved and sharded).
    module = LitGPT(
        **model_config(args.n_layer, args.n_embd, args.vocab, args.seq),
        lr=1e-4,
        warmup_steps=0,
        deferred_init=not getattr(args, "eager_init", False),
    )
    strategy = ThreeDStrategy(
        offload=args.offload,
        offload_path=args.path if args.offload == "nvme" else None,
        ac_policy=args.checkpointing,
        zero_stage=3 if args.params else 0,
        offload_params=args.params,
        offload_overlap=args.overlap,
        offload_delay_update=args.delay,
    )
    with tempfile.TemporaryDirectory(prefix="offload-memory-") as out:  # summary.json goes there
        summary = RunSummary(out_dir=out, warmup_steps=0)
        trainer = L.Trainer(
            accelerator=args.accelerator,
            devices=1,
            strategy=strategy,
            precision=args.precision,
            max_steps=1 + args.rounds,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[summary, Lockstep()],
            default_root_dir=out,
        )
        try:
            trainer.fit(module, data)
        except torch.OutOfMemoryError as error:  # the parent reports "does not fit"
            _say({"oom": str(error).strip().splitlines()[0][:300]})
            return
    rank = summary.summary["ranks"][0]
    # CUDA only.
    device = {"device_peak_mb": rank["device_peak_mb"]} if "device_peak_mb" in rank else {}
    _say(
        {
            "peak_rss_mb": peak_rss_mb(),
            "num_params": summary.summary["num_params"],
            **summary.memory,
            **summary.activations,
            **device,
        }
    )


def start_worker(row: Row, args: argparse.Namespace) -> subprocess.Popen:
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="1048576",
        OMP_NUM_THREADS=str(args.threads),
        PYTHONPATH=pythonpath(),
    )
    command = [
        sys.executable,
        "-m",
        "tools.bench.offload_memory",
        "--worker",
        *(f"--{f.name}={getattr(row, f.name)}" for f in fields(row)),
        f"--rounds={args.rounds}",
        f"--threads={args.threads}",
        f"--path={args.path}",
        f"--n-layer={args.n_layer}",
        f"--n-embd={args.n_embd}",
        f"--accelerator={args.accelerator}",
        f"--vocab={args.vocab}",
        *(["--eager-init"] if getattr(args, "eager_init", False) else []),
        *(
            [f"--device-memory-gb={args.device_memory_gb}"]
            if args.device_memory_gb is not None
            else []
        ),
    ]
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 -- the worker's warnings, closed in measure()
    proc = subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
    )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def read_reply(worker: subprocess.Popen) -> dict[str, Any]:
    """The worker's next record (other stdout lines are skipped)."""
    for line in worker.stdout:
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX) :])
    worker.log.seek(0)
    raise RuntimeError(
        f"benchmark worker {worker.args[4:9]} exited with {worker.wait()}:\n{worker.log.read()[-3000:]}"
    )


def step_worker(worker: subprocess.Popen) -> dict[str, Any]:
    worker.stdin.write("step\n")
    worker.stdin.flush()
    return read_reply(worker)
