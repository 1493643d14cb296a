"""`python -m benchmarks.send_cost`: where a SEND's host time goes on a same-host link, by piece.

    python -m benchmarks.send_cost --bytes 65536 --bursts 1,4 --messages 200 --work 4

Two processes joined by a connected Unix socket pair, each end wrapped as the process
transport wraps a same-host link (`SocketLink`, `LinkChannel`). Before each SEND the sender
runs `--work` layers of the anchor workload's stage (Linear(1024) + GELU on 16 rows, with
autograd), so that the send runs on the caches the compute left, as in a step; then it times
each piece of the SEND, in thread CPU time and wall: `describe` (the header's slots), `parts`
(the flag and the tensor's own memory), `link.send` (one `sendmsg`, or the hand-off to the
link's writer thread when the socket does not take the message whole), and `release` (the stage
output's storage freed, as `_send` does). The receiver reads `burst` messages, then answers
with a one-element message that starts the sender's next burst: a burst of 1 is a ping-pong
(the receiver waits, sleeping in `poll` or spinning: `--spin-us`), a burst of k leaves up to k
messages unread in the socket, as a schedule whose sender runs ahead (1F1B's first ranks,
GPipe) does. Each row: medians over the messages, the writer-thread hand-offs counted, the
socket's SO_SNDBUF, and the load average beside it.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from pipeline.comm.channels import RESULT, LinkChannel
from pipeline.comm.socket_link import SocketLink
from pipeline.comm.wire import describe, parts
from pipeline.runtime.split_backward import release

__all__ = ["PIECES", "main", "receive", "send"]

PIECES = ("describe", "parts", "link.send", "release")
_DEADLINE = 120.0  # seconds either process waits for the other before giving up
_WIDTH = 1024  # the anchor workload's layer width


def _nothing(now: float) -> None:
    del now


def send(link: SocketLink, size: int, burst: int, messages: int, work: int
         ) -> tuple[dict[str, list[tuple[float, float]]], int]:
    """The sender's side: per piece, (thread CPU, wall) seconds of each SEND; and how many
    SENDs the writer thread finished (the socket did not take them whole)."""
    channel = LinkChannel(link)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(work)]
    x = torch.randn(max(1, size // (4 * _WIDTH)), _WIDTH) if work else torch.empty(0)
    times: dict[str, list[tuple[float, float]]] = {p: [] for p in PIECES}
    handed = 0
    cpu, wall = time.thread_time, time.perf_counter
    for first in range(0, messages, burst):
        for _ in range(min(burst, messages - first)):
            if work:  # a stage's forward: its output has a graph, as a real one does
                h = x.requires_grad_()
                for layer in layers:
                    h = torch.nn.functional.gelu(layer(h))
            else:
                h = torch.randn(size // 4).requires_grad_() * 1.0
            values = (h,)
            marks = [(cpu(), wall())]
            meta = describe(values)
            marks.append((cpu(), wall()))
            views, keep = parts(values, meta if first == 0 else None)
            marks.append((cpu(), wall()))
            item = link.send(views, keep)
            marks.append((cpu(), wall()))
            # Given an event exactly when the socket did not take it whole (the writer's).
            handed += item.event is not None
            release(values)
            marks.append((cpu(), wall()))
            del views, keep, item, values, h
            for piece, (c0, w0), (c1, w1) in zip(PIECES, marks[:-1], marks[1:], strict=True):
                times[piece].append((c1 - c0, w1 - w0))
        channel.receive_result(time.monotonic() + _DEADLINE, _nothing)  # the receiver's go
    return times, handed


def receive(link: SocketLink, burst: int, messages: int) -> None:
    """The receiver's side: `burst` messages read, then one message back, until `messages`."""
    channel = LinkChannel(link)
    go = (torch.zeros(1),)
    for first in range(0, messages, burst):
        for _ in range(min(burst, messages - first)):
            channel.receive_result(time.monotonic() + _DEADLINE, _nothing)
        channel.send(RESULT, go, describe(go))
    flushed = link.flushed()
    if flushed is not None:
        flushed.wait(time.monotonic() + _DEADLINE)


def _row(size: int, burst: int, args: argparse.Namespace) -> str:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    peer = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--peer", str(theirs.fileno()),
         "--bursts", str(burst), "--messages", str(args.messages),
         "--spin-us", str(args.spin_us)], pass_fds=(theirs.fileno(),), env=env)
    theirs.close()
    link = SocketLink(mine, args.spin_us * 1e-6)
    try:
        sndbuf = mine.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        times, handed = send(link, size, burst, args.messages, args.work)
    finally:
        link.close()
        try:
            peer.wait(_DEADLINE)
        except subprocess.TimeoutExpired:
            peer.kill()  # never leave the receiver behind (the error in flight stays the one)
            peer.wait()
    if peer.returncode:
        raise RuntimeError(f"the receiving process failed (exit {peer.returncode})")
    skip = min(len(times["link.send"]) // 4, 10)  # the first messages warm the path up
    cells = []
    for piece in (*PIECES, None):
        got = times[piece][skip:] if piece else [
            (sum(t[skip + i][0] for t in times.values()), sum(t[skip + i][1] for t in
                                                               times.values()))
            for i in range(len(times["link.send"]) - skip)]
        cells.append(f"{statistics.median(c for c, _ in got) * 1e6:.1f} / "
                     f"{statistics.median(w for _, w in got) * 1e6:.1f}")
    load = os.getloadavg()[0]
    return (f"| {size} | {burst} | {' | '.join(cells)} | {handed} of {args.messages} | "
            f"{sndbuf} | {load:.1f} |")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.send_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", default="65536", help="message sizes, comma-separated")
    ap.add_argument("--bursts", default="1,4",
                    help="messages sent before the receiver reads, comma-separated")
    ap.add_argument("--messages", type=int, default=200, help="SENDs timed per row")
    ap.add_argument("--work", type=int, default=4,
                    help="Linear(1024)+GELU layers run before each SEND (0: none)")
    ap.add_argument("--spin-us", type=int, default=0,
                    help="microseconds a receive spins before it sleeps in poll")
    ap.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    bursts = [int(b) for b in args.bursts.split(",")]
    unit = 4 * _WIDTH if args.work else 4  # a row of the layers' output, or one float
    for size in (int(b) for b in args.bytes.split(",")):
        if size < unit or size % unit:
            ap.error(f"--bytes {size}: a message is whole {unit}-byte "
                     f"{'rows of a Linear(1024) output' if args.work else 'floats'}; give a "
                     f"positive multiple of {unit}, e.g. {max(unit, size - size % unit)}")
    if args.peer is not None:  # the receiving process
        link = SocketLink(socket.socket(fileno=args.peer), args.spin_us * 1e-6)
        try:
            receive(link, bursts[0], args.messages)
        finally:
            link.close()
        return 0
    head = " | ".join(f"{p} us" for p in (*PIECES, "SEND"))
    print("Thread CPU / wall, medians per SEND:\n")
    print(f"| bytes | burst | {head} | writer hand-offs | SO_SNDBUF | load |")
    print("|---" * (len(PIECES) + 6) + "|")
    for size in (int(b) for b in args.bytes.split(",")):
        for burst in bursts:
            print(_row(size, burst, args), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
