"""Per-rank model-state bytes under ZeRO 0-3 at data=2 and data=4, next to the paper's formula.

    python -m tools.bench.zero_memory [--n-embd 256] [--n-layer 4] [--data 2 4]

Trains the reference GPT for two fp32 AdamW steps per layout on gloo worlds and prints, for
rank 0, the bytes of parameters, gradients and optimizer state resident at the end of backward
(counted from the tensors: see ``lightning_3d.observe.memory``) and their ratio to the formula
(stage 0: 16Ψ, 1: 8Ψ + 8Ψ/N, 2: 4Ψ + 12Ψ/N, 3: 16Ψ/N). Peak RSS is printed too, measured with
``MALLOC_MMAP_THRESHOLD_=1048576`` so freed large tensors go back to the OS.

A second table is the bf16 module with fp32 master weights (``precision="bf16-true"``, ZeRO 0-2:
``lightning_3d.parallel.masters``): the same GPT in bf16, one AdamW step of the ZeRO engine per
layout, its bytes counted from the tensors after the step (bf16 weights and gradient buffers, fp32
masters and moments; the masters' fp32 gradients, made for the step only, in their own column)
against the paper's mixed-precision formula (16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N).

Beside it, the same bf16 module without masters (``zero_master_weights=False``): the optimizer
steps the bf16 weights with bf16 moments, 2 + 2 + 4 bytes a parameter, the moments sharded from
stage 1 and the gradients from stage 2 (8Ψ, 4Ψ + 4Ψ/N, 2Ψ + 6Ψ/N: :func:`no_masters_bytes`),
counted the same way.

A third table is ZeRO-Offload's split (``precision="bf16-true"`` with ``offload=cpu`` / ``nvme``,
``lightning_3d.offload.split``): the engine and the offloaded AdamW as the recipe builds them, two
accumulated micro-batches and a step per layout, bytes by place counted from the tensors (device:
bf16 weights, gradients kept between steps, the staging peak during backward; host: fp32 masters
and gradients; the store: moments, on the drive under nvme) against the split's formula (2Ψ on
the device; 4Ψ + 4Ψ + 8Ψ off it, divided by N from stage 1). ``--offload`` picks the devices.
"""

from __future__ import annotations

import argparse
import os

from lightning_3d.observe.memory import zero_formula_bytes
from lightning_3d.parallel.masters import paper_bytes
from tools.harness.runs import TINY_MODEL, Run, fit_gpt
from tools.harness.world import run_world


def measure(data: int, stage: int, model: dict) -> dict:
    run = Run(
        strategy={"zero_stage": stage},
        devices=data,
        steps=2,
        seed=1234,
        model=model,
        data={"block_size": model["block_size"]},
    )
    # Peak RSS: nothing inherited from a fork server.
    runs = run_world(fit_gpt, data, run, start_method="spawn")
    summary = runs[0]["summary"]
    return {"num_params": summary["num_params"], **summary["ranks"][0]}


def _masters_rank(rank: int, data: int, stage: int, model: dict, masters: bool = True) -> dict:
    """One AdamW step of the bf16 GPT under the ZeRO engine, with fp32 masters or (``masters``
    False) stepping the bf16 weights themselves; bytes counted."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.models import LitGPT
    from lightning_3d.parallel.masters import MASTER_DTYPE, zero_state_bytes
    from lightning_3d.parallel.zero import ZeroDataParallel

    mesh = init_device_mesh("cpu", (data,), mesh_dim_names=("dp",))
    torch.manual_seed(1234)
    module = LitGPT(**{**TINY_MODEL, **model}).bfloat16()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    engine = ZeroDataParallel(mesh, stage, master_dtype=MASTER_DTYPE if masters else None)
    engine.attach(optimizer)
    vocab = {**TINY_MODEL, **model}["vocab_size"]
    tokens = torch.randint(0, vocab, (2, model["block_size"]))
    engine.prepare_backward(sync=True)
    module(tokens).float().square().mean().backward()
    engine.finish_backward()
    optimizer.step()
    counted = zero_state_bytes(module, optimizer, engine)
    engine.after_step()
    return {"num_params": sum(p.numel() for p in module.parameters()), **counted}


def masters_table(data_sizes: list[int], model: dict) -> None:
    print(
        "\n| N | stage | bf16 params MB | bf16 grads MB | fp32 masters MB | optim MB | total MB "
        "| formula MB | total/formula | master grads MB (step only) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for data in data_sizes:
        for stage in (0, 1, 2):
            row = run_world(_masters_rank, data, data, stage, model)[0]
            keys = ("params", "grads", "masters", "optimizer_state")
            total = sum(row[k] for k in keys)
            formula = paper_bytes(row["num_params"], stage, data)
            mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
            print(
                f"| {data} | {stage} | {' | '.join(mb(row[k]) for k in keys)} | {mb(total)} | "
                f"{mb(formula)} | {total / formula:.3f} | {mb(row['master_grads'])} |",
                flush=True,
            )
    print(f"\nΨ = {row['num_params']:,} parameters (bf16 + fp32 masters, AdamW); rank 0.")


def no_masters_bytes(num_params: int, stage: int, data: int) -> float:
    """Model-state bytes per rank of a bf16 module stepped without masters (AdamW's moments in
    bf16): 2 bytes of weight, 2 of gradient, 4 of moments a parameter, the moments divided by
    ``data`` from stage 1, the gradients from stage 2."""
    psi, n = num_params, data
    return {0: 8 * psi, 1: 4 * psi + 4 * psi / n, 2: 2 * psi + 6 * psi / n}[stage]


def no_masters_table(data_sizes: list[int], model: dict) -> None:
    print(
        "\n| N | stage | bf16 params MB | bf16 grads MB | bf16 moments MB | total MB | formula MB "
        "| total/formula |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for data in data_sizes:
        for stage in (0, 1, 2):
            row = run_world(_masters_rank, data, data, stage, model, False)[0]
            keys = ("params", "grads", "optimizer_state")
            total = sum(row[k] for k in keys) + row["masters"]  # no masters: 0
            formula = no_masters_bytes(row["num_params"], stage, data)
            mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
            print(
                f"| {data} | {stage} | {' | '.join(mb(row[k]) for k in keys)} | {mb(total)} | "
                f"{mb(formula)} | {total / formula:.3f} |",
                flush=True,
            )
    print(
        f"\nΨ = {row['num_params']:,} parameters (bf16, zero_master_weights=False, AdamW); rank 0."
    )


def _offload_rank(rank: int, data: int, stage: int, model: dict, device: str, path: str) -> dict:
    """Two micro-batches and one AdamW step of the bf16 GPT under the split; bytes by place."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_3d.models import LitGPT
    from lightning_3d.offload import OffloadedAdam
    from lightning_3d.offload.split import split_state_bytes
    from lightning_3d.options import Plan
    from lightning_3d.parallel.masters import master_options
    from lightning_3d.parallel.zero import ZeroDataParallel

    mesh = init_device_mesh("cpu", (data,), mesh_dim_names=("dp",))
    torch.manual_seed(1234)
    module = LitGPT(**{**TINY_MODEL, **model}).bfloat16()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    plan = Plan.from_options(
        zero_stage=stage, offload=device, offload_path=path if device == "nvme" else None
    )
    engine = ZeroDataParallel(
        mesh,
        stage,
        bucket_numel=plan.zero.bucket_bytes // 2,
        **master_options(optimizer, plan),
    )
    engine.attach(optimizer)
    offloaded = OffloadedAdam.from_optimizer(optimizer, device, plan.offload.path)
    vocab = {**TINY_MODEL, **model}["vocab_size"]
    for micro in range(2):
        engine.prepare_backward(sync=micro == 1)
        tokens = torch.randint(0, vocab, (2, model["block_size"]))
        module(tokens).float().square().mean().backward()
        engine.finish_backward()
    offloaded.step()
    counted = split_state_bytes(module, offloaded, engine)
    engine.after_step()
    offloaded.close()
    return {"num_params": sum(p.numel() for p in module.parameters()), **counted}


def offload_table(data_sizes: list[int], model: dict, devices: list[str]) -> None:
    import tempfile

    from lightning_3d.offload.split import split_formula

    print(
        "\n| offload | N | stage | device bf16 params MB | device grads MB | staging peak MB "
        "| host fp32 masters MB | host fp32 grads MB | store MB | device/formula "
        "| off-device/formula |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for device in devices:
        for data in [1, *data_sizes]:
            for stage in (0, 1, 2) if data > 1 else (0,):
                with tempfile.TemporaryDirectory() as path:
                    row = run_world(_offload_rank, data, data, stage, model, device, path)[0]
                formula = split_formula(row["num_params"], stage, data)
                off = row["host_masters"] + row["host_grads"] + row["store"]
                off_formula = formula["host_masters"] + formula["host_grads"] + formula["store"]
                device_bytes = row["device_params"] + row["device_grads"]
                mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
                where = " (drive)" if row["store_on_drive"] else ""
                keys = ("device_params", "device_grads", "device_staging_peak")
                print(
                    f"| {device} | {data} | {stage} | {' | '.join(mb(row[k]) for k in keys)} | "
                    f"{mb(row['host_masters'])} | {mb(row['host_grads'])} | "
                    f"{mb(row['store'])}{where} | {device_bytes / formula['device_params']:.3f} | "
                    f"{off / off_formula:.3f} |",
                    flush=True,
                )
    print(
        f"\nΨ = {row['num_params']:,} parameters (bf16 weights, fp32 masters, AdamW); rank 0. "
        "The staging peak is bounded by the bucket size (two buckets), not by Ψ."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--data", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--offload", nargs="*", default=["cpu", "nvme"], choices=["cpu", "nvme"])
    args = parser.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")  # inherited by the spawned ranks
    model = dict(n_embd=args.n_embd, n_layer=args.n_layer, n_head=4, block_size=64)
    print(
        "| N | stage | params MB | grads MB | optim MB | total MB | formula MB | total/formula | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for data in args.data:
        for stage in (0, 1, 2, 3):
            row = measure(data, stage, model)
            total = row["param_bytes"] + row["grad_bytes"] + row["optimizer_state_bytes"]
            formula = zero_formula_bytes(row["num_params"], stage, data)
            mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
            print(
                f"| {data} | {stage} | {mb(row['param_bytes'])} | {mb(row['grad_bytes'])} | "
                f"{mb(row['optimizer_state_bytes'])} | {mb(total)} | {mb(formula)} | {total / formula:.3f} | "
                f"{row['peak_rss_mb']:.0f} |",
                flush=True,
            )
    print(f"\nΨ = {row['num_params']:,} parameters (fp32 AdamW); rank 0 of each layout.")
    masters_table(args.data, model)
    no_masters_table(args.data, model)
    if args.offload:
        offload_table(args.data, model, args.offload)


if __name__ == "__main__":
    main()
