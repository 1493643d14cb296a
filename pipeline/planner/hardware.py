"""Hardware profiles: an accelerator's compute, memory and links, for planning by simulation."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.planner.link import Link

__all__ = ["A100_80GB", "Hardware"]


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its host, as the planner's analytic profiles use them.

    Compute: `peak_flops` (dense 16-bit tensor-core FLOP/s), of which large matrix products
    reach `matmul_efficiency`; everything else (layer norms, softmax, dropout, GeLU) is bound
    by memory traffic at `hbm_bandwidth` x `hbm_efficiency` bytes/s. Memory: `hbm_bytes`, of
    which a plan may fill `usable_memory` (the rest is for the CUDA context, communication
    buffers, workspaces and the allocator's fragmentation, which the planner does not count).
    Links, per accelerator and direction: `host_bandwidth` to the others of its host
    (`per_host` of them), `network_bandwidth` to other hosts, each reaching `link_efficiency`
    of it, with a latency per message or ring step.
    """

    name: str
    peak_flops: float
    matmul_efficiency: float
    hbm_bytes: float
    hbm_bandwidth: float
    hbm_efficiency: float
    per_host: int
    host_bandwidth: float
    host_latency: float
    network_bandwidth: float
    network_latency: float
    link_efficiency: float
    usable_memory: float = 0.9

    def __post_init__(self) -> None:
        for name in ("matmul_efficiency", "hbm_efficiency", "link_efficiency", "usable_memory"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"Hardware.{name} is a share in (0, 1] "
                                 f"(got {getattr(self, name)})")
        for name in ("peak_flops", "hbm_bytes", "hbm_bandwidth", "host_bandwidth",
                     "network_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware.{name} must be > 0 (got {getattr(self, name)})")
        if self.per_host < 1:
            raise ValueError(f"Hardware.per_host must be >= 1 (got {self.per_host})")

    def compute_seconds(self, matmul_flops: float, other_bytes: float) -> float:
        """Seconds for `matmul_flops` of matrix products and `other_bytes` of memory traffic
        by everything else, one after the other (kernels of one stream do not overlap)."""
        return (matmul_flops / (self.peak_flops * self.matmul_efficiency)
                + other_bytes / (self.hbm_bandwidth * self.hbm_efficiency))

    @property
    def memory_budget(self) -> float:
        """Bytes per accelerator a plan may fill."""
        return self.hbm_bytes * self.usable_memory

    @property
    def host_link(self) -> Link:
        """Between accelerators of one host (messages and collective steps alike)."""
        per_byte = 1.0 / (self.host_bandwidth * self.link_efficiency)
        return Link("nccl", self.host_latency, per_byte, self.host_latency, per_byte)

    @property
    def network_link(self) -> Link:
        """Between accelerators of different hosts."""
        per_byte = 1.0 / (self.network_bandwidth * self.link_efficiency)
        return Link("nccl", self.network_latency, per_byte, self.network_latency, per_byte)


# An A100-SXM4-80GB in a DGX A100 (the machines of Narayanan et al. 2021): NVIDIA's data sheet
# gives 312 TFLOP/s dense bf16, 80 GB at 2,039 GB/s, NVLink 3 at 600 GB/s (300 GB/s each way)
# through NVSwitch, and a DGX A100 has 8 GPUs and 8 x 200 Gb/s HDR InfiniBand adapters, one per
# GPU (25 GB/s each way). The efficiencies are assumptions, not measurements: the best matmul
# shape measured on an A100 SXM reaches 85.9% of peak (267.9 TFLOP/s; stas00/ml-engineering's
# "maximum achievable matmul FLOPS" table), and a transformer's shapes (attention's batched
# products of head size 128 among them) a little less; 80% of memory and link bandwidth is what
# copies and NCCL's bus bandwidth typically reach. Latencies are NCCL's order of magnitude per
# ring step; at the messages planned here (megabytes) they hardly count.
A100_80GB = Hardware(
    name="A100-SXM4-80GB, 8 per host (NVLink 300 GB/s, 8 x 200 Gb/s InfiniBand)",
    peak_flops=312e12,
    matmul_efficiency=0.80,
    hbm_bytes=80 * 2**30,
    hbm_bandwidth=2.039e12,
    hbm_efficiency=0.80,
    per_host=8,
    host_bandwidth=300e9,
    host_latency=2e-6,
    network_bandwidth=25e9,
    network_latency=5e-6,
    link_efficiency=0.80,
)
