"""Process-group bootstrap: which rank of how many this process is, its device, its own layers."""

from __future__ import annotations

import atexit
import itertools
import json
import os
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import settings
from pipeline.errors import PipeConfigError

__all__ = ["INIT_TIMEOUT_ENV", "MAX_INIT_TIMEOUT", "PARAM_INITS", "ParamInit", "from_first_rank",
           "indexed", "init_timeout", "materialize", "rank_devices", "release_at_exit", "world"]

# Here, not in pipeline.launch (which sets it): importing `pipeline` must not import the
# launcher, or `python -m pipeline.launch` finds it already imported and runpy warns.
INIT_TIMEOUT_ENV = "PIPELINE_INIT_TIMEOUT"  # seconds ranks wait for each other to join
# Longer than any job waits for its ranks (115 days), short of what timedelta and torch's
# millisecond counts hold: `inf` passed the launcher's check, then every rank overflowed.
MAX_INIT_TIMEOUT = 1e7

_shared = itertools.count()  # values shared so far, in order: the same on every rank
_releasing: list[bool] = []  # whether release_at_exit registered its handler


def init_timeout(raw: str | None = None, name: str = INIT_TIMEOUT_ENV) -> float:
    """Seconds the ranks wait for each other to join: `raw` (the launcher's flag) or
    `PIPELINE_INIT_TIMEOUT`, by the settings' rule (`pipeline.settings`); default 300."""
    if raw is not None:
        return settings.parse_number(name, raw, low=0.001, high=MAX_INIT_TIMEOUT,
                                     unit=" seconds")
    return settings.number(INIT_TIMEOUT_ENV, default=300.0, low=0.001, high=MAX_INIT_TIMEOUT,
                           unit=" seconds")


def world(group: Any = None) -> tuple[int, int] | None:
    """(rank, world size) when running as one of several processes, else None.

    Uses an initialised process group, or initialises one from torchrun's environment
    (`WORLD_SIZE` > 1): gloo, or NCCL when CUDA is available, waiting up to
    `PIPELINE_INIT_TIMEOUT` seconds (default 300) for the other ranks to join.
    """
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # How long to wait for every rank to join: a rank that never comes is noticed then.
        seconds = init_timeout()
        dist.init_process_group(backend, timeout=timedelta(seconds=seconds))
    size = dist.get_world_size(group)
    if size == 1 and group is None:
        return None
    release_at_exit()
    return dist.get_rank(group), size


def release_at_exit() -> None:
    """At a normal exit, stop the pipeline's threads, then destroy the process groups (once
    per process; a pipeline over processes asks for it, whoever started the group).

    gloo frees a collective's tensors on its worker threads, after the caller's `wait()` may
    have returned: the pipeline's own collectives wait for that (pipeline/comm/handed.py),
    torch's own (DCP's, `all_gather_object`'s) do not, and a worker left to free one while
    the interpreter finalises aborts the process (SIGABRT). A destroyed group's workers are
    joined while Python still runs, as torch advises. A group broken by a failed peer is left
    as it is (pipeline/comm/quiet_exit.py)."""
    if not _releasing:
        _releasing.append(True)
        atexit.register(_release)


def _release() -> None:
    from pipeline.comm import quiet_exit
    from pipeline.runtime import workers  # the runtime imports this module

    if quiet_exit.armed():
        return
    workers.close_all()  # no stage thread is left inside a collective of the group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rank_devices(devices: Sequence[str | torch.device] | None, num_ranks: int,
                 rank: int) -> list[torch.device]:
    """One device per rank; only this rank's entry is used. Default: this process's GPU
    (`cuda:LOCAL_RANK`) under NCCL, the CPU under gloo."""
    if devices is not None:
        # Only this rank's entry is used, and only it must name a GPU of this host.
        return [indexed(torch.device(d)) if r == rank else torch.device(d)
                for r, d in enumerate(devices)]
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        mine = torch.device("cuda", local)
    else:
        mine = torch.device("cpu")
    return [mine if r == rank else torch.device("cpu") for r in range(num_ranks)]


def indexed(device: torch.device, count: int | None = None,
            current: int | None = None) -> torch.device:
    """`device` with its index: plain "cuda" is the current GPU, as torch places tensors there
    (a rank's thread binds to one GPU by index). A GPU index past the visible ones is refused
    here, before any thread starts. `count`/`current` default to torch's, for tests."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count() if count is None else count
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if current is None else current)
    if device.index >= count:
        raise PipeConfigError(f"device {device} was asked for but {count} GPU(s) are visible; "
                              f"use 'cuda:0' ... 'cuda:{max(0, count - 1)}'")
    return device


ParamInit = Callable[[nn.Module], None]
PARAM_INITS = ("reset", "skip")


def materialize(layer: nn.Module, device: torch.device, *, name: str,
                param_init: str | ParamInit = "reset",
                exempt: frozenset[tuple[int, str]] = frozenset()
                ) -> nn.Module:
    """Put `layer` (the model's layer `name`) on `device`. A layer built on the meta device
    gets real storage there, initialised module by module: by `param_init(module)` when it is
    a function (as FSDP's `param_init_fn`), else by the module's own `reset_parameters()`; a
    module with tensors of its own and neither is refused, naming it, unless `param_init` is
    "skip" (a `load_state_dict` follows). `exempt` holds (id(module), attribute) pairs filled
    otherwise (copies of tied weights)."""
    on_meta = any(t.is_meta for t in [*layer.parameters(), *layer.buffers()])
    if not on_meta:
        return layer.to(device)
    # to_empty gives each module its own new tensor: a weight two modules share (a tie
    # inside one stage: GPT-2's head and embedding) is shared again afterwards.
    places: dict[int, list[tuple[dict[str, Any], str]]] = {}
    for module in layer.modules():
        for table in (module._parameters, module._buffers):
            for k, t in table.items():
                if t is not None:
                    places.setdefault(id(t), []).append((table, k))
    layer.to_empty(device=device)
    for uses in places.values():
        first_table, first_key = uses[0]
        for table, k in uses[1:]:
            table[k] = first_table[first_key]
    if param_init == "skip":
        # In registration order (the set's order changes with the string hash seed).
        lost = [".".join(p for p in (name, path, k) if p)
                for path, module in layer.named_modules()
                for k, t in module._buffers.items()
                if k in module._non_persistent_buffers_set and t is not None]
        if lost:  # no state_dict holds them: left as to_empty left them, uninitialised
            warnings.warn(
                f"param_init='skip' leaves the non-persistent buffers {lost} uninitialised "
                f"(no state_dict holds them, so load_state_dict will not fill them): pass "
                f"param_init=fn to compute them (e.g. rotary inv_freq)", stacklevel=3)
        return layer
    for path, module in layer.named_modules():
        own = [k for k, t in [*module._parameters.items(), *module._buffers.items()]
               if t is not None and (id(module), k) not in exempt]
        if not own:
            continue
        if callable(param_init):
            with torch.no_grad():
                param_init(module)
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            key = ".".join(p for p in (name, path) if p)
            raise PipeConfigError(
                f"layer {key!r} ({type(module).__name__}) was built on the meta device and has "
                f"no reset_parameters(), so Pipe cannot initialise its tensors (they would be "
                f"uninitialised memory). Pass Pipe(..., param_init=fn) with fn(module) "
                f"initialising each module as your model does, param_init='skip' if a "
                f"load_state_dict (or pipe.load) follows, or build the model on a real device")
        reset()
    return layer


def from_first_rank(group: Any, compute: Callable[[], list[int]]) -> list[int]:
    """`compute()` run on the group's rank 0 only, its result given to every rank (through the
    rendezvous store). An error on rank 0 is raised there and reported on the others."""
    store = dist.distributed_c10d._get_default_store()
    first = dist.get_global_rank(group, 0) if group is not None else 0
    key = f"pipeline/shared/{next(_shared)}/{first}"
    if dist.get_rank(group) == 0:
        try:
            value = compute()
        except BaseException as exc:
            store.set(key, json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            raise
        store.set(key, json.dumps({"value": value}))
        return value
    got = json.loads(store.get(key))  # waits for rank 0, up to the store's timeout
    if "error" in got:
        raise PipeConfigError(f"rank 0 could not compute the balance for every rank: "
                              f"{got['error']}")
    return [int(v) for v in got["value"]]
