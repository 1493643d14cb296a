"""The multi-process transport: one channel per peer (a same-host link, or torch.distributed).

Each peer gets a `Channel`: a same-host link (`channels.LinkChannel`, CPU tensors between two
processes of one machine) or torch.distributed point to point (`group_channel.GroupChannel`,
gloo or NCCL). The order of messages with each peer comes from the lowered schedule
(`schedules.lower` keeps each pair's receives in the sender's order), so matching needs no
tags for order. Every wait watches for failures (failures.py): an error report in the
rendezvous store, a poison flag (a failing rank sends one in place of its next message to
each peer), a dead peer's broken connection, or the timeout, so no rank hangs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipeline.comm import failures, quiet_exit, wire
from pipeline.comm.channels import RESULT, BadFlag, Channel, LinkChannel, Received
from pipeline.comm.failures import (
    PeerFailure,
    PeerTimeout,
    PipelineAborted,
    Watch,
    default_store,
    guarded,
    poisoned_rank,
)
from pipeline.comm.group_channel import GroupChannel, GroupWork
from pipeline.comm.same_host import connect
from pipeline.comm.transport import Broken, describe_message, move
from pipeline.comm.waiting import Waiter
from pipeline.comm.wire import BadHeader, describe
from pipeline.errors import PipelineError
from schedules import Schedule
from schedules.ir import RECV_OPS, SEND_OPS
from schedules.lower import Message, message, source_stage

__all__ = ["PeerFailure", "ProcessTransport"]


class ProcessTransport:
    """Point-to-point transport over a torch.distributed process group (gloo or NCCL)."""

    copies = True  # what `send` needs of the values lives on in the channel, not the sender

    def __init__(self, rank: int, device: torch.device, *, timeout: float,
                 group: dist.ProcessGroup | None = None,
                 watch: tuple[int, ...] | None = None,
                 names: Callable[[int], str] | None = None) -> None:
        wire.check_limit()  # a bad PIPELINE_MAX_MESSAGE_BYTES: refused here, not at import
        self.rank = rank  # within `group`
        self.device = device
        self.timeout = timeout
        self.group = group
        self.world_size = dist.get_world_size(group)
        # isend/irecv address global ranks, whatever group they go through.
        self._global = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(self.world_size)]
        # Global ranks whose failure reports end this rank's waits: its group's, or a whole
        # mesh's (a failed replica must stop the others too).
        self._store = default_store()
        self._watch = Watch(self._store, list(watch) if watch is not None else self._global,
                            rank)
        self.name = names or (lambda r: f"rank {r}")  # a peer in messages (with coordinates)
        self._polls = dist.get_backend(group) == "nccl"
        # Only NCCL takes CUDA tensors point to point: over gloo (CUDA ranks sharing one GPU,
        # or a job without NCCL) messages are staged through host memory, as CPU ranks' are,
        # and moved to the receiver's device on arrival.
        comm_device = device if device.type == "cuda" and self._polls else torch.device("cpu")
        self._waiter = Waiter()
        self._arrived: dict[Message, Received] = {}
        # id(schedule) -> (schedule, sends, receives) per peer: a Pipe runs the same few
        # programs step after step, so each one's order of messages is read once.
        self._orders: dict[int, tuple[Schedule, dict[int, list[Message]],
                                      dict[int, list[Message]]]] = {}
        self._broken: str | None = None  # the first failure seen: then every call refuses
        # Peers on this host: a Unix socket instead (CPU tensors only: CUDA keeps NCCL's
        # stream-ordered path).
        links = (connect(self._store, self._global, rank, timeout)
                 if comm_device.type == "cpu" else {})
        self._links = sorted(links)
        self._channels: dict[int, Channel] = {
            peer: LinkChannel(links[peer]) if peer in links else GroupChannel(
                self._global[peer], group=group, device=comm_device, waiter=self._waiter)
            for peer in range(self.world_size) if peer != rank}

    def linked(self) -> list[int]:
        """The group ranks this rank reaches over a same-host link."""
        return list(self._links)

    def unusable(self) -> PipelineError:
        """The error every call raises once this transport has seen a failure."""
        return PipelineError(
            f"rank {self.rank}: this pipeline's process group is unusable after an earlier "
            f"failure ({self._broken}): build a new process group and Pipe (restart the ranks)")

    def check_usable(self) -> None:
        if self._broken is not None:
            raise self.unusable()

    @guarded
    def begin(self, schedule: Schedule) -> None:
        """Read this step's order of messages with each peer from the lowered schedule and
        post the receives that can be."""
        self._arrived.clear()
        hit = self._orders.get(id(schedule))
        if hit is None or hit[0] is not schedule:
            if len(self._orders) >= 64:  # programs of many step shapes: keep the recent ones
                self._orders.clear()
            hit = self._orders[id(schedule)] = (schedule, *self._order(schedule))
        _, sends, receives = hit
        for peer, channel in self._channels.items():
            channel.plan(sends.get(peer, []), receives.get(peer, []))
            self._call(peer, channel.post, "its first messages")

    def _order(self, schedule: Schedule
               ) -> tuple[dict[int, list[Message]], dict[int, list[Message]]]:
        """This rank's messages to each peer and from each, in the schedule's order."""
        sends: dict[int, list[Message]] = {}
        receives: dict[int, list[Message]] = {}
        for a in schedule.actions[self.rank]:
            if a.op in RECV_OPS:  # a program's tied weights too (schedules.program)
                msg = message(a)
                receives.setdefault(schedule.rank_of(source_stage(msg)), []).append(msg)
            elif a.op in SEND_OPS:
                msg = message(a)
                sends.setdefault(schedule.rank_of(msg[1]), []).append(msg)
        return sends, receives

    # -- sending ------------------------------------------------------------------------------
    @guarded
    def send(self, msg: Message, values: tuple[Any, ...], dst_rank: int) -> None:
        channel = self._channels[dst_rank]
        self._call(dst_rank, lambda: channel.send(msg, values, describe(values)),
                   "its next message")

    @guarded
    def finish(self) -> None:
        """Wait for every send of the step (they complete as peers receive them)."""
        deadline = time.monotonic() + self.timeout
        for peer, channel in self._channels.items():
            try:
                channel.flushed().wait(deadline, self._watch.tick)
            except TimeoutError:
                raise TimeoutError(f"rank {self.rank} waited {self.timeout:g}s for a send to "
                                   f"finish") from None
            except Broken as exc:
                self._watch.check()
                raise PeerFailure(f"{self.name(peer)} is gone (its process died or its "
                                  f"connection broke) while rank {self.rank} sent to it: {exc}"
                                  ) from exc

    # -- receiving ----------------------------------------------------------------------------
    @guarded
    def post(self, msg: Message, src_rank: int) -> None:
        """A RECV: its receive is posted by now, or as soon as those ahead of it arrive."""
        del msg
        channel = self._channels[src_rank]
        self._call(src_rank, channel.post, "its next message")

    @guarded
    def wait(self, msg: Message, src_rank: int, device: torch.device) -> tuple[Any, ...]:
        channel = self._channels[src_rank]
        while msg not in self._arrived:
            head = channel.expected()
            if head is None:
                raise AssertionError(f"rank {self.rank}: {msg} is not among what rank "
                                     f"{src_rank} sends under this schedule")
            got, received = self._receive(src_rank, head, channel.receive)
            self._arrived[got] = received
        values, flags = self._arrived.pop(msg)
        return move(values, device, grad_flags=flags)

    def _receive(self, src: int, head: Message | None, receive: Callable[[float, Any], Any]
                 ) -> Any:
        """`receive(deadline, tick)` from `src` (`head`: the message expected, None for a
        result), its errors named."""
        try:
            return receive(time.monotonic() + self.timeout, self._watch.tick)
        except (TimeoutError, Broken, BadHeader, BadFlag) as exc:
            what = "a result" if head is None else describe_message(head)
            raise self._named(exc, src, what) from (exc if isinstance(exc, Broken) else None)

    def _named(self, exc: Exception, src: int, what: str) -> Exception:
        """The error a receive of `what` from `src` that failed with `exc` raises."""
        if isinstance(exc, BadHeader):
            return PipelineError(f"rank {self.rank}: {self.name(src)} sent {what} with a bad "
                                 f"header: {exc}")
        self._watch.check()  # a failure elsewhere explains a silence, a poison, a break
        if isinstance(exc, TimeoutError):
            return PeerTimeout(self.rank, src, what, self.timeout)
        if isinstance(exc, Broken):
            return PeerFailure(f"{self.name(src)} is gone (its process died or its connection "
                               f"broke) while rank {self.rank} waited for {what} from it: {exc}")
        assert isinstance(exc, BadFlag)
        failed = poisoned_rank(exc.flag, self.world_size)
        if failed is not None:  # a rank failed (see `abort`)
            return PipelineAborted(failed, f"{self.name(failed)} failed (told rank {self.rank} "
                                           f"through {self.name(src)})")
        expected = (f"0 (data), 1 (new shapes) or a poison -1 to -{self.world_size}"
                    if exc.agreed else "1 (new shapes) first")
        return PipelineError(f"rank {self.rank}: {self.name(src)} sent {what} with flag "
                             f"{exc.flag}{'' if exc.agreed else ' before any header'}; "
                             f"expected {expected}")

    def _call(self, peer: int, fn: Callable[[], None], what: str) -> None:
        """A non-blocking channel call; a broken connection (a peer that died, possibly before
        this step began) becomes a PeerFailure naming it."""
        try:
            fn()
        except Broken as exc:
            self._watch.check()
            raise PeerFailure(f"{self.name(peer)} is gone (its process died or its connection "
                              f"broke); rank {self.rank} could not exchange {what} with it: "
                              f"{exc}") from exc

    # -- messages outside the schedule --------------------------------------------------------
    @guarded
    def send_result(self, tensor: torch.Tensor, dst: int) -> None:
        """One tensor to `dst` outside the schedule (results, checkpoints), in order."""
        channel = self._channels[dst]
        self._call(dst, lambda: channel.send(RESULT, (tensor,), describe((tensor,))),
                   "a result")

    @guarded
    def recv_result(self, src: int, shape: tuple[int, ...],
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        """The next tensor `src` sent with `send_result`, which must have this shape (and
        dtype, if given)."""
        values, _ = self._receive(src, None, self._channels[src].receive_result)
        out = values[0] if len(values) == 1 else None
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape
                or dtype not in (None, out.dtype)):
            got = (f"shape {tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor)
                   else f"{len(values)} entries")
            raise PipelineError(f"rank {self.rank}: {self.name(src)} sent a result of {got}; "
                                f"expected {shape} {dtype or ''}".rstrip())
        return out.detach().clone()

    @guarded
    def exchange(self, payload: str) -> list[str]:
        """Every rank's `payload`, in rank order (the same list on every rank), point to point
        with the failure-aware waits: a peer that is already dead is named, not waited for."""
        data = torch.tensor(list(payload.encode("utf-8")), dtype=torch.uint8)
        for peer in range(self.world_size):
            if peer != self.rank:
                self.send_result(torch.tensor([data.numel()]), peer)
                self.send_result(data, peer)
        out = []
        for peer in range(self.world_size):
            if peer == self.rank:
                out.append(payload)
                continue
            (size,) = self.recv_result(peer, (1,)).tolist()
            raw = self.recv_result(peer, (int(size),), torch.uint8)
            out.append(bytes(raw.tolist()).decode("utf-8"))
        self.finish()
        return out

    def close(self) -> None:
        """Close the same-host links (a peer still talking over one hears that this rank is
        gone); the process group is the caller's."""
        for channel in self._channels.values():
            channel.close()

    # -- waiting and failing ------------------------------------------------------------------
    @guarded
    def wait_work(self, work: Any, what: str) -> None:
        """Wait for any torch.distributed work (a collective too) with the failure-aware
        waits: a failure reported anywhere this transport watches ends it."""
        pending = GroupWork([work], polls=self._polls, waiter=self._waiter)
        try:
            pending.wait(time.monotonic() + self.timeout, self._watch.tick)
        except TimeoutError:
            raise TimeoutError(f"rank {self.rank} waited {self.timeout:g}s for {what}; raise "
                               f"Pipe(timeout=...) if a stage is really that slow") from None
        except Broken as exc:
            self._watch.check()
            others = [r for r in range(self.world_size) if r != self.rank]
            peer = (self.name(others[0]) if len(others) == 1
                    else "one of " + ", ".join(map(self.name, others)))
            raise PeerFailure(f"{peer} is gone (its process died or its connection broke) "
                              f"while rank {self.rank} waited for {what}: {exc}") from exc

    def check_failed(self) -> None:
        """Raise PipelineAborted with the first failure any rank of this pipeline reported."""
        self._watch.check()

    def abort(self, rank: int, note: str, *, report: bool = True) -> None:
        """Tell every rank that this rank (`rank`) failed: a report in the store under a key
        only this rank writes, ticketed so that readers pick the first failure, and a poison
        flag in place of our next message to each peer, which wakes a receive blocked on this
        rank; a peer blocked on another rank hears it when that rank fails in turn."""
        if self._broken is None:
            self._broken = note
            quiet_exit.arm()  # the group is broken: its teardown may abort the process
        if report and self._store is not None:
            failures.report(self._store, self._global[self.rank], note)
        for channel in self._channels.values():
            with contextlib.suppress(Exception):
                channel.poison(rank)
