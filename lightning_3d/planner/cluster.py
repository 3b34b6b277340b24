"""The machines a layout is planned for: nodes of identical devices and the links between them.

Bandwidths are in GB/s (gigabytes, not gigabits, per second) per device and direction, as a
collective's bus bandwidth: what one rank can send while every rank sends. ``peak_tflops`` is
the dense peak of one device in the training precision (bf16 on a GPU), before any efficiency
factor (the planner's ``efficiency`` option says how much of it a step reaches).

``matmul_efficiency`` and ``memory_gbps`` turn on the shape-dependent matmul model
(:func:`lightning_3d.planner.timing.gemm_efficiency`): a matmul reaches ``matmul_efficiency``
of the peak at large shapes and less as its arithmetic intensity falls toward the device's
ridge point (``peak_tflops / memory_gbps``). Unset (``None``, the default) every matmul runs at
the planner's flat ``efficiency``, as a cluster measured whole (the CPU calibration's, whose
peak is a measured block rate) wants.

Example::

    >>> Cluster(nodes=1, devices_per_node=8, device_memory_gb=80).world_size
    8
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    devices_per_node: int = 8
    device_memory_gb: float = 80.0  # usable by one rank, per device
    host_memory_gb: float = 1024.0  # per node, shared by its ranks (CPU offload lives here)
    intra_node_gbps: float = 300.0  # GB/s per device inside a node (NVLink class)
    inter_node_gbps: float = 25.0  # GB/s per device between nodes (a 200 Gb/s NIC per device)
    peak_tflops: float = 989.0  # dense bf16 TFLOP/s of one device (H100 SXM)
    host_link_gbps: float = 25.0  # GB/s between one device and host memory (PCIe)
    nvme_gbps: float = 6.0  # GB/s of a node's local drives, each direction (offload to nvme)
    nvme_gb: float = 3840.0  # free space on a node's local drives
    # The share of peak_tflops a large matmul reaches on this device (cuBLAS-class kernels at
    # shapes of thousands; A100 ~0.8, H100 ~0.75); None: the planner's flat efficiency.
    matmul_efficiency: Optional[float] = None
    # GB/s of one device's memory (HBM: A100-80GB 2039, H100 SXM 3350): what a thin matmul's
    # operands stream at; used only with matmul_efficiency.
    memory_gbps: Optional[float] = None

    def __post_init__(self) -> None:
        problems = []
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"cluster.{name}={value!r} must be a positive integer")
        for name in (
            "device_memory_gb",
            "host_memory_gb",
            "intra_node_gbps",
            "inter_node_gbps",
            "peak_tflops",
            "host_link_gbps",
            "nvme_gbps",
            "nvme_gb",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                problems.append(f"cluster.{name}={value!r} must be a positive number")
        for name in ("matmul_efficiency", "memory_gbps"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
            ):
                problems.append(f"cluster.{name}={value!r} must be a positive number or null")
        if self.matmul_efficiency is not None and self.matmul_efficiency > 1:
            problems.append(
                f"cluster.matmul_efficiency={self.matmul_efficiency!r} must be at most 1 "
                "(a share of peak)"
            )
        if (self.matmul_efficiency is None) != (self.memory_gbps is None):
            problems.append(
                f"cluster.matmul_efficiency={self.matmul_efficiency!r} and "
                f"cluster.memory_gbps={self.memory_gbps!r} must be given together "
                "(the shape model needs both)"
            )
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Cluster:
        """From a Hydra ``cluster`` group (or any mapping); ``ValueError`` naming unknown keys."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown cluster key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(values))

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device_bytes(self) -> float:
        return self.device_memory_gb * 1e9

    @property
    def host_bytes(self) -> float:
        return self.host_memory_gb * 1e9

    def describe(self) -> str:
        return (
            f"{self.nodes} node(s) x {self.devices_per_node} device(s) of {self.device_memory_gb:g} GB, "
            f"{self.peak_tflops:g} TFLOP/s peak, links {self.intra_node_gbps:g} GB/s in a node / "
            f"{self.inter_node_gbps:g} GB/s between nodes"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
