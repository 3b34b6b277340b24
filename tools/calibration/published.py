"""The planner's step time against published large runs: predicted over measured throughput.

    python -m tools.calibration.published [--efficiency 0.5]

The runs are Megatron-LM's weak-scaling table (Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", SC21, Table 1): GPT models from 1.7 B to 1 T
parameters on 32 to 3,072 A100-80GB GPUs (DGX A100 nodes: 8 GPUs on NVLink, 8 × 200 Gb/s
InfiniBand per node), sequence 2,048, vocabulary 51,200, mixed precision, full activation
recomputation, Megatron's own (non-ZeRO) data parallelism. Their layouts (tensor, pipeline,
micro-batch size, global batch, layers per interleaved stage) are Megatron-LM's
``examples/sc21/run_table_1.sh``; the measured figure is the paper's achieved TFLOP/s per GPU,
which counts the recomputed forward: ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` FLOPs per
iteration. Throughput is that over the per-token count, times the GPUs.

Why these runs: every figure the planner needs (shape, layout, schedule, batch, checkpointing,
cluster) is published with the measurement, and they span 32 to 3,072 GPUs on one machine
type, so a drift with scale shows as a trend in the ratio and not as a machine difference.

The model is Part counts (no module is built: the planner's time model reads counts only, and a
1 T model's meta build takes minutes here): a block holds ``12·h²`` matmul weights and two
norms, the embedding ``V·h`` (split over the tensor ranks), the head ``V·h`` on the last stage.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from lightning_3d.planner.choice import Choice, PlannerOptions
from lightning_3d.planner.cluster import Cluster
from lightning_3d.planner.facts import ModelFacts, Part
from lightning_3d.planner.timing import step_time

SEQ, VOCAB = 2048, 51200
# DGX A100 (80 GB): 312 dense bf16/fp16 TFLOP/s, 2,039 GB/s of HBM2e; NVLink 3 (600 GB/s both
# directions) inside a node; one 200 Gb/s HDR InfiniBand NIC per GPU between nodes. 0.8 of peak:
# what cuBLAS's large bf16 matmuls reach on an A100 (~250 of 312 TFLOP/s), not fitted here.
A100_NODE = dict(
    devices_per_node=8,
    device_memory_gb=80.0,
    intra_node_gbps=300.0,
    inter_node_gbps=25.0,
    peak_tflops=312.0,
    matmul_efficiency=0.8,
    memory_gbps=2039.0,
)


@dataclass(frozen=True)
class PublishedRun:
    """One row of the table: the model's shape, its layout and the measured TFLOP/s per GPU."""

    name: str
    layers: int
    hidden: int
    heads: int
    tensor: int
    pipeline: int
    micro_batch: int
    global_batch: int
    nodes: int
    layers_per_virtual: int  # 0: plain 1F1B
    tflops_per_gpu: float  # achieved, counting recomputation (the paper's Table 1)

    @property
    def gpus(self) -> int:
        return self.nodes * 8

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)

    @property
    def virtual(self) -> int:
        if not self.layers_per_virtual:
            return 1
        return self.layers // self.pipeline // self.layers_per_virtual

    def flops_per_token(self) -> float:
        """The paper's count per token, recomputed forward included."""
        layers, h = self.layers, self.hidden
        return 96 * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))

    def measured_tokens_per_s(self) -> float:
        return self.tflops_per_gpu * 1e12 * self.gpus / self.flops_per_token()


# Narayanan et al. 2021, Table 1 (achieved TFLOP/s per GPU), layouts from run_table_1.sh.
RUNS = (
    PublishedRun("1.7B", 24, 2304, 24, 1, 1, 16, 512, 4, 0, 137),
    PublishedRun("3.6B", 30, 3072, 32, 2, 1, 16, 512, 8, 0, 138),
    PublishedRun("7.5B", 36, 4096, 32, 4, 1, 16, 512, 16, 0, 142),
    PublishedRun("18B", 40, 6144, 48, 8, 1, 8, 1024, 32, 0, 135),
    PublishedRun("39B", 48, 8192, 64, 8, 2, 4, 1536, 64, 0, 138),
    PublishedRun("76B", 60, 10240, 80, 8, 4, 2, 1792, 128, 5, 140),
    PublishedRun("145B", 80, 12288, 96, 8, 8, 2, 2304, 192, 5, 148),
    PublishedRun("310B", 96, 16384, 128, 8, 16, 1, 2160, 240, 3, 155),
    PublishedRun("530B", 105, 20480, 128, 8, 35, 1, 2520, 315, 1, 163),
    PublishedRun("1T", 128, 25600, 160, 8, 64, 1, 3072, 384, 0, 163),
)


def run_facts(run: PublishedRun) -> ModelFacts:
    """The planner's facts of a run's GPT from counts (no activations: time only)."""
    h = run.hidden
    # Megatron's block: fused qkv and fc1 split by output (dim 0), proj and fc2 by input (dim 1).
    shapes = (((3 * h, 3 * h * h, 0), 1), ((h, h * h, 1), 1), ((4 * h, 4 * h * h, 0), 1))
    shapes += (((h, 4 * h * h, 1), 1), ((h, h, -1), 4))
    block = Part(12 * h * h + 4 * h, 12 * h * h, 12 * h * h, tuple(sorted(shapes)))
    embedding = Part(params=VOCAB * h + SEQ * h, split=VOCAB * h)
    head = Part(params=VOCAB * h + 2 * h, split=VOCAB * h, flop_params=VOCAB * h)
    return ModelFacts(
        name=run.name,
        n_layer=run.layers,
        d_model=h,
        n_head=run.heads,
        vocab_size=VOCAB,
        seq_len=SEQ,
        precision="bf16-mixed",
        first=embedding,
        blocks=(block,) * run.layers,
        last=head,
        tied=Part(),
        buffer_bytes=0,
    )


def run_choice(run: PublishedRun) -> Choice:
    """The run's layout as the planner's :class:`Choice` (ZeRO 0, full checkpointing)."""
    per_rank = run.global_batch // run.data
    v = run.virtual
    return Choice(
        data=run.data,
        tensor=run.tensor,
        pipeline=run.pipeline,
        zero_stage=0,
        micro_batches=per_rank // run.micro_batch,
        schedule="interleaved_1f1b" if v > 1 else "1f1b",
        ac_policy="full",
        batch_per_rank=per_rank,
        virtual_stages=v,
    )


def run_cluster(run: PublishedRun, shapes: bool = True) -> Cluster:
    """The run's A100 nodes; ``shapes=False``: without the shape-dependent matmul model (every
    matmul at the planner's flat ``efficiency``, as before it)."""
    node = dict(A100_NODE)
    if not shapes:
        node.update(matmul_efficiency=None, memory_gbps=None)
    return Cluster(nodes=run.nodes, **node)


def ratios(
    options: PlannerOptions | None = None, shapes: bool = True
) -> list[tuple[PublishedRun, float, float]]:
    """``(run, predicted tokens/s, predicted / measured)`` for every run of :data:`RUNS`."""
    options = options or PlannerOptions()
    out = []
    for run in RUNS:
        cluster = run_cluster(run, shapes)
        tokens = step_time(run_facts(run), run_choice(run), cluster, options).tokens_per_s
        out.append((run, tokens, tokens / run.measured_tokens_per_s()))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.calibration.published", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--efficiency",
        type=float,
        default=PlannerOptions().efficiency,
        help="the flat efficiency of the column without the shape model",
    )
    args = parser.parse_args(argv)
    flat = ratios(PlannerOptions(efficiency=args.efficiency), shapes=False)
    shaped = ratios(PlannerOptions(efficiency=args.efficiency))
    print(
        "| run | GPUs | tp×pp×dp | measured tokens/s | flat efficiency: predicted | ratio "
        "| shape model: predicted | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (run, before, r_before), (_, after, r_after) in zip(flat, shaped):
        print(
            f"| {run.name} | {run.gpus} | {run.tensor}×{run.pipeline}×{run.data} | "
            f"{run.measured_tokens_per_s():,.0f} | {before:,.0f} | {r_before:.2f} | "
            f"{after:,.0f} | {r_after:.2f} |"
        )
    median = statistics.median
    print(
        f"median ratio: flat {median(r for *_, r in flat):.2f}, "
        f"shape model {median(r for *_, r in shaped):.2f}"
    )


if __name__ == "__main__":
    main()
