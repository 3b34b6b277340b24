"""Build time and host peak of one rank's model, eager vs built on ``meta`` (no optimizer, no data).

    python -m tools.bench.model_build --size 24x2048 --init deferred --zero 3 --offload-params --world 2

One ``LitGPT`` (vocab 32 000, 64-wide heads) is built as ``ThreeDStrategy`` builds it at
bf16-true: ``--init eager`` whole in fp32 on the host (``torch.manual_seed(0); LitGPT(...)``),
then cast to bf16, then the recipe (ZeRO-3 sharding with ``--zero 3``, CPU-offloaded shards with
``--offload-params``); ``--init deferred`` the same with ``LitGPT(deferred_init=True)``, whose
parameters the recipe fills in place (``parallel/materialize.py``). ``--world N`` plays rank 0
of a fake world of N (no other process, no communication: the shard one rank would hold). Run
each configuration in a fresh process (the peak is the process's ``ru_maxrss``); prints one JSON
line. Measured with ``MALLOC_MMAP_THRESHOLD_=1048576`` as the offload benchmark's workers run.
"""

from __future__ import annotations

import argparse
import json
import time

from tools.bench.offload_ladder import parse_size


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", default="24x1024", help="a ladder size name (1.3B) or LAYERSxWIDTH"
    )
    parser.add_argument("--init", choices=["eager", "deferred"], default="deferred")
    parser.add_argument(
        "--zero", type=int, choices=[0, 3], default=0, help="3: ZeRO-3 (FSDP2) sharding"
    )
    parser.add_argument(
        "--offload-params", action="store_true", help="with --zero 3: shards in CPU memory"
    )
    parser.add_argument(
        "--world", type=int, default=1, help="play rank 0 of a fake world of this size"
    )
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    args = parser.parse_args(argv)
    if (
        args.world < 1
        or (args.offload_params and args.zero != 3)
        or (args.world > 1 and args.zero != 3)
    ):
        parser.error(
            f"--world {args.world} needs --zero 3 above 1, --offload-params needs --zero 3 "
            f"(got --zero {args.zero}, --offload-params {args.offload_params})"
        )
    n_layer, n_embd = parse_size(args.size)

    import torch

    from lightning_3d.layout import build_mesh
    from lightning_3d.models import LitGPT
    from lightning_3d.observe.memory import peak_rss_mb
    from lightning_3d.options import Plan
    from lightning_3d.parallel.fake_world import fake_world
    from lightning_3d.parallel.materialize import to_device_keeping_meta
    from lightning_3d.strategy.recipe import parallelize

    torch.set_num_threads(args.threads)
    base = peak_rss_mb()
    start = time.perf_counter()
    torch.manual_seed(0)
    module = LitGPT(
        vocab_size=32_000,
        block_size=1024,
        n_layer=n_layer,
        n_head=n_embd // 64,
        n_embd=n_embd,
        deferred_init=args.init == "deferred",
    )
    built = time.perf_counter()
    to_device_keeping_meta(module, torch.device("cpu"))  # the strategy's model_to_device
    module = module.to(torch.bfloat16)  # bf16-true: Lightning's HalfPrecision.convert_module
    cast = time.perf_counter()
    options = (
        {"zero_stage": 3, "offload": "cpu", "offload_params": True}
        if args.offload_params
        else ({"zero_stage": 3} if args.zero == 3 else {})
    )
    plan = Plan().updated(**options).resolved(args.world)
    with fake_world(0, args.world):
        parallelize(
            module,
            build_mesh(plan.layout, "cpu"),
            plan,
            device=torch.device("cpu"),
            precision="bf16-true",
        )
    done = time.perf_counter()
    record = {
        "size": args.size,
        "init": args.init,
        "zero": args.zero,
        "offload_params": args.offload_params,
        "world": args.world,
        "num_params": sum(p.numel() for p in module.parameters()),
        "build_s": round(built - start, 2),
        "cast_s": round(cast - built, 2),
        "recipe_s": round(done - cast, 2),
        "total_s": round(done - start, 2),
        "base_rss_mb": round(base),
        "peak_rss_mb": round(peak_rss_mb()),
    }
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
