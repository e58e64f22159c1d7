"""The hardware the CLI knows by name: GPUs, links, and the nominal cluster.

Datasheet figures (sources beside each table); ``kv_exchange="auto"`` plans with
:func:`nominal_cluster`. Pass measured figures to the CLI for real predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

from .request import Cluster


@dataclass(frozen=True)
class GPU:
    """Dense bf16/fp16 tensor-core peak (no sparsity), memory, and the node's GPU-to-GPU link."""

    name: str
    tflops: float
    memory_gib: float
    intra_link: str


# NVIDIA datasheets: A100 SXM 312 TFLOP/s, NVLink3; H100 SXM and H200 SXM 989 TFLOP/s, NVLink4;
# HGX B200 36 PFLOP/s sparse per 8 GPUs = 2.25 PFLOP/s dense per GPU, NVLink5.
GPUS = {
    "a100": GPU("A100 SXM 80GB", 312.0, 80.0, "nvlink3"),
    "h100": GPU("H100 SXM", 989.0, 80.0, "nvlink4"),
    "h200": GPU("H200 SXM", 989.0, 141.0, "nvlink4"),
    "b200": GPU("B200", 2250.0, 180.0, "nvlink5"),
}

# Bytes/s per GPU per direction. NVLink totals are bidirectional: NVLink3 600 GB/s, NVLink4
# 900 GB/s, NVLink5 1.8 TB/s per GPU. PCIe x16: gen4 32 GB/s, gen5 64 GB/s per direction.
# InfiniBand, one NIC per GPU (DGX/HGX): HDR 200 Gb/s, NDR 400 Gb/s, XDR 800 Gb/s.
LINKS = {
    "nvlink3": 300e9, "nvlink4": 450e9, "nvlink5": 900e9,
    "pcie4": 32e9, "pcie5": 64e9,
    "ib200": 25e9, "ib400": 50e9, "ib800": 100e9,
}

# Achieved share of the dense peak in attention: FlashAttention-2 reaches 50-73% on A100,
# FlashAttention-3 up to 75% on H100; we take the low end.
DEFAULT_EFFICIENCY = 0.5

# A fixed cost per synchronising exchange (a ring step, a collective): NCCL's small-message
# latency on NVLink is a few microseconds, plus the step's wait on its slowest peer; nominal.
DEFAULT_LATENCY_US = 10.0


def nominal_cluster(world_size: int) -> Cluster:
    """One node of ``world_size`` H100s at the CLI's defaults: what ``kv_exchange="auto"`` plans with."""
    gpu = GPUS["h100"]
    return Cluster(world_size, world_size, gpu.tflops * 1e12 * DEFAULT_EFFICIENCY, LINKS[gpu.intra_link],
                   LINKS["ib400"], gpu.memory_gib * 2**30, DEFAULT_LATENCY_US * 1e-6)
