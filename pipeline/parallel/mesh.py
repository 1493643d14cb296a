"""Where a process sits on a DeviceMesh of ("dp",) "pp" (, "tp"): its groups and coordinates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipeline.errors import PipeConfigError, PipeTypeError

__all__ = ["DIMENSIONS", "Mesh", "resolve_mesh"]

# The dimensions a mesh may have (in any order; this order is Megatron's advice: "tp"
# innermost, within a host, "dp" outermost): "pp" carries the pipeline, "dp" its replicas,
# "tp" the tensor-parallel shards inside each stage.
DIMENSIONS = (("pp",), ("dp", "pp"), ("pp", "tp"), ("dp", "pp", "tp"))


@dataclass(frozen=True)
class Mesh:
    """Where this process sits: its pipeline group ("pp"), its replica group ("dp", None
    without one), its tensor-parallel group ("tp", None without one), its coordinates, and
    every global rank of the mesh."""

    pp: Any
    dp: Any
    dp_mesh: Any  # the 1-D "dp" sub-mesh (FSDP2 shards over it)
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    ranks: tuple[int, ...]
    tp: Any = None
    tp_mesh: Any = None  # the 1-D "tp" sub-mesh (parallelize_module shards over it)
    tp_rank: int = 0
    tp_size: int = 1

    def _where(self, dp: int, pp: int, tp: int) -> str:
        return f"dp {dp}, pp {pp}" + (f", tp {tp}" if self.tp is not None else "")

    def pp_peer(self, pp_rank: int) -> str:
        """A rank of this pipeline, named with its place in the mesh."""
        g = dist.get_global_rank(self.pp, pp_rank)
        return (f"rank {pp_rank} (global rank {g}, "
                f"{self._where(self.dp_rank, pp_rank, self.tp_rank)})")

    def dp_peer(self, dp_rank: int) -> str:
        """A replica of this rank, named with its place in the mesh."""
        assert self.dp is not None
        g = dist.get_global_rank(self.dp, dp_rank)
        return f"global rank {g} ({self._where(dp_rank, self.pp_rank, self.tp_rank)})"

    def tp_peer(self, tp_rank: int) -> str:
        """A tensor-parallel shard of this rank's stages, named with its place in the mesh."""
        assert self.tp is not None
        g = dist.get_global_rank(self.tp, tp_rank)
        return f"global rank {g} ({self._where(self.dp_rank, self.pp_rank, tp_rank)})"

    @property
    def coordinates(self) -> str:
        """This process's place, e.g. "dp 0, pp 1, tp 0"."""
        return self._where(self.dp_rank, self.pp_rank, self.tp_rank)


def resolve_mesh(mesh: Any, group: Any) -> Mesh | None:
    """A `DeviceMesh` with dimensions named "pp" and optionally "dp" and "tp", checked."""
    if mesh is None:
        return None
    if group is not None:
        raise PipeConfigError("pass either mesh= or group=, not both: a mesh's 'pp' dimension "
                              "is the pipeline's group")
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None or not hasattr(mesh, "get_group"):
        raise PipeTypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh with named dimensions "
            f"(got {type(mesh).__name__}); e.g. init_device_mesh('cpu', (2, 2), "
            f"mesh_dim_names=('dp', 'pp'))")
    if sorted(names) not in [sorted(d) for d in DIMENSIONS]:
        shown = ", ".join(str(d) for d in DIMENSIONS)
        raise PipeConfigError(
            f"the mesh's dimensions must be named as one of {shown} (got "
            f"{tuple(names)}); 'pp' carries the pipeline, 'dp' its replicas (outermost) and "
            f"'tp' the tensor-parallel shards of each stage (innermost, within a host)")
    pp = mesh.get_group("pp")
    dp = mesh.get_group("dp") if "dp" in names else None
    tp = mesh.get_group("tp") if "tp" in names else None
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    return Mesh(pp, dp, mesh["dp"] if dp is not None else None,
                dist.get_rank(dp) if dp is not None else 0,
                dist.get_world_size(dp) if dp is not None else 1, dist.get_rank(pp),
                dist.get_world_size(pp), ranks,
                tp, mesh["tp"] if tp is not None else None,
                dist.get_rank(tp) if tp is not None else 0,
                dist.get_world_size(tp) if tp is not None else 1)
