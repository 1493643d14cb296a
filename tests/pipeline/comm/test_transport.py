"""pipeline.comm.transport: `move`, and every transport and handle honouring its interface."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from pipeline.comm.channels import Channel, LinkChannel
from pipeline.comm.group_channel import GlooReceive, GroupChannel, GroupWork
from pipeline.comm.process_group import ProcessTransport
from pipeline.comm.same_host import LinkSend, SocketLink
from pipeline.comm.threads import ThreadTransport
from pipeline.comm.transport import Done, Pending, Transport, move
from pipeline.comm.waiting import Waiter

CPU = torch.device("cpu")


def test_move_detaches_and_makes_flagged_tensors_fresh_leaves() -> None:
    a = torch.randn(2, requires_grad=True) * 2  # a non-leaf with history
    ids = torch.tensor([1, 2])
    out = move((a, ids, None, "mask"), CPU, grad_flags=[True, False, False, False])
    assert out[0].requires_grad and out[0].is_leaf and out[0].grad_fn is None
    assert torch.equal(out[0], a.detach()) and out[0].data_ptr() == a.data_ptr()  # no copy
    assert out[1].dtype == torch.int64 and not out[1].requires_grad
    assert out[2:] == (None, "mask")
    assert not move((a,), CPU)[0].requires_grad  # unflagged: detached only


def _methods(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(
        getattr(protocol, "__annotations__", {}))


@pytest.mark.parametrize(("protocol", "classes"), [
    (Transport, [ThreadTransport, ProcessTransport]),
    (Pending, [Done, LinkSend, GroupWork, GlooReceive]),
    (Channel, [LinkChannel, GroupChannel]),
])
def test_every_implementation_has_the_whole_interface(protocol: type, classes: list[type]
                                                      ) -> None:
    # The runtime and the transport call these names on whatever they hold, never asking
    # which implementation it is.
    for cls in classes:
        missing = {n for n in _methods(protocol) if not hasattr(cls, n)}
        assert not missing, (cls.__name__, missing)


def test_handles_report_done_and_wait_without_asking_their_type() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = SocketLink(a)
    payload = torch.arange(4, dtype=torch.uint8)
    handles: list[Pending] = [Done(), link.send([memoryview(bytes(payload.tolist()))]),
                              GroupWork([], polls=False, waiter=Waiter())]
    for handle in handles:
        handle.wait(time.monotonic() + 5, lambda now: None)
        assert handle.done()
    assert b.recv(16) == bytes(range(4))
    link.close()
    b.close()
