"""Replicas that committed steps apart are caught in the next average they share, never mixed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline import PipeConfigError
from pipeline.replicas import lineage as ft_lineage
from pipeline.replicas.replica import FaultTolerance


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("members", [(0,), (0, 1), (0, 2, 3), (0, 1, 2, 3)])
def test_lineages_survive_the_average_in_every_gradient_dtype(dtype: torch.dtype,
                                                              members: tuple[int, ...]) -> None:
    # The largest digits (0xFFFFFF) and mixed ones, averaged as torchft does: sum, then / n.
    lineages = {r: v for r, v in zip(members, [0xFFFFFF, 0x123456, 0, 0xA5A5A5], strict=False)}
    total = sum(ft_lineage.encode(v, r, 4, dtype, torch.device("cpu"))
                for r, v in lineages.items())
    assert isinstance(total, torch.Tensor)
    assert ft_lineage.decode(total / len(members), members) == lineages


def test_the_lineage_follows_steps_and_members() -> None:
    a = ft_lineage.next_lineage(0, 0, (0,))
    assert a == ft_lineage.next_lineage(0, 0, (0,))  # the same history, the same value
    assert a != ft_lineage.next_lineage(0, 0, (1,))  # step 0 committed by another alone
    assert a != ft_lineage.next_lineage(0, 0, (0, 1))
    assert ft_lineage.next_lineage(a, 1, (0, 1)) != ft_lineage.next_lineage(0, 1, (0, 1))
    assert ft_lineage.next_lineage(0, 3, (1, 0)) == ft_lineage.next_lineage(0, 3, (0, 1))


class _Manager:
    """What average_gradients and commit ask of torchft's Manager, for one replica whose
    peers' buffers are given: the all-reduce sums them in and divides by the count."""

    def __init__(self, peers: list[torch.Tensor], step: int = 5) -> None:
        self.peers, self.step, self.errors = peers, step, list[Exception]()
        self.seen: torch.Tensor | None = None

    def allreduce(self, flat: torch.Tensor) -> Any:
        self.seen = flat.clone()
        for p in self.peers:
            flat.add_(p)
        flat.div_(1 + len(self.peers))
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(flat)
        return done

    def num_participants(self) -> int:
        return 1 + len(self.peers)

    def errored(self) -> Exception | None:
        return self.errors[0] if self.errors else None

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def should_commit(self) -> bool:
        if not self.errors:
            self.step += 1
        return not self.errors

    def current_step(self) -> int:
        return self.step


def _replica(replica: int, lineage: int, peers: list[torch.Tensor]
             ) -> tuple[FaultTolerance, list[torch.nn.Parameter]]:
    ft = FaultTolerance.__new__(FaultTolerance)  # no torchft: the protocol's arithmetic alone
    ft.replica_id, ft.num_replicas, ft.lineage = replica, 2, lineage
    ft.participants, ft._quorum_started, ft._stepped = (), True, True
    ft.record, ft._scaler, ft.last_committed = None, None, False  # no launcher's record
    ft.rank, ft.digest, ft._pipe = 0, 0, torch.nn.Linear(1, 1)  # the state's digest: 0
    ft.manager = _Manager(peers)  # type: ignore[assignment]
    params = [torch.nn.Parameter(torch.zeros(3))]
    params[0].grad = torch.full((3,), float(replica + 1))
    return ft, params


def _buffer(replica: int, lineage: int) -> torch.Tensor:
    """The buffer `replica` sends into the average."""
    ft, params = _replica(replica, lineage, [])
    ft.average_gradients(params)
    seen = ft.manager.seen  # type: ignore[attr-defined]
    assert isinstance(seen, torch.Tensor)
    return seen


def test_one_history_averages_and_commits_alike() -> None:
    history = ft_lineage.next_lineage(0, 4, (0, 1))
    ft, params = _replica(0, history, [_buffer(1, history)])
    ft.average_gradients(params)
    assert ft.participants == (0, 1)
    assert torch.equal(params[0].grad, torch.full((3,), 1.5))
    assert ft.commit(lambda: None)
    assert ft.lineage == ft_lineage.next_lineage(history, 5, (0, 1))


def test_replicas_that_committed_apart_are_not_mixed() -> None:
    """Both committed step 4 alone (a live replica dropped for stalled heartbeats): at step 5
    neither commits the mixed average, and replica 1 (not the lowest) stops to be healed."""
    zero, one = ft_lineage.next_lineage(0, 4, (0,)), ft_lineage.next_lineage(0, 4, (1,))
    ft0, params0 = _replica(0, zero, [_buffer(1, one)])
    ft0.average_gradients(params0)
    assert ft0.participants == ()
    assert not ft0.commit(lambda: pytest.fail("a mixed step was applied"))
    assert ft0.lineage == zero
    (error,) = ft0.manager.errors  # type: ignore[attr-defined]
    assert isinstance(error, ft_lineage.ReplicasDiverged)
    assert "replica(s) [1] committed steps apart from replica 0" in str(error)
    ft1, params1 = _replica(1, one, [_buffer(0, zero)])
    with pytest.raises(ft_lineage.ReplicasDiverged, match="heals from replica 0"):
        ft1.average_gradients(params1)


def test_two_groups_with_one_replica_id_are_refused() -> None:
    """Two groups started by hand as REPLICA_GROUP_ID=0: torchft counts both, and the average
    holds 2 / 2 at replica 0's slot; both trained on replica 0's data as if one replica."""
    history = ft_lineage.next_lineage(0, 4, (0,))
    ft, params = _replica(0, history, [_buffer(0, history)])
    with pytest.raises(PipeConfigError, match=r"2 replica groups run as REPLICA_GROUP_ID=0"):
        ft.average_gradients(params)
    assert not ft.commit(lambda: pytest.fail("a step of two groups as one was applied"))


class _Recorder:
    """torchft's Manager as FaultTolerance builds it: what it registers for a heal."""

    def __init__(self, **kwargs: Any) -> None:
        self.fns: dict[str, tuple[Any, Any]] = {}

    def register_state_dict_fn(self, key: str, load: Any, state: Any) -> None:
        self.fns[key] = (load, state)


def test_a_heal_carries_the_lineage(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a heal sends (the state functions FaultTolerance registers with torchft's
    Manager) holds the peer's lineage, and loading it gives the healed replica that lineage:
    a restarted replica then averages with its peers as one history."""
    pytest.importorskip("torchft")
    import torchft.manager
    import torchft.process_group

    from pipeline.replicas import environment
    from pipeline.replicas import replica as fault_tolerance

    monkeypatch.setattr(torchft.manager, "Manager", _Recorder)
    monkeypatch.setattr(torchft.process_group, "ProcessGroupGloo", lambda timeout: None)
    monkeypatch.setattr(fault_tolerance, "_weights_only_transport", lambda timeout: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setenv(environment.NUM_REPLICAS_ENV, "2")
    monkeypatch.setenv(environment.LIGHTHOUSE_ENV, "http://127.0.0.1:1")

    class Pipe:
        world, mesh, group, multi_batch = (0, 2), None, None, False

    def replica(index: int) -> FaultTolerance:
        monkeypatch.setenv(environment.REPLICA_ID_ENV, str(index))
        return FaultTolerance(Pipe(), timeout=5.0)

    peer, healed = replica(0), replica(1)
    peer.lineage = ft_lineage.next_lineage(ft_lineage.next_lineage(0, 0, (0,)), 1, (0,))
    sent = peer.manager.fns["lineage"][1]()  # type: ignore[attr-defined]
    assert sent == {"lineage": peer.lineage}
    assert healed.lineage == 0
    healed.manager.fns["lineage"][0](sent)  # type: ignore[attr-defined]
    assert healed.lineage == peer.lineage
    assert set(healed.manager.fns) >= {"pipe", "lineage"}  # type: ignore[attr-defined]
