"""The end of a fault-tolerant loop: groups that reach `total` hold there, committing no step
past it, until every replica group is back with them, or their deadline passes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipeline import PipelineError
from pipeline.replicas import lineage as ft_lineage
from pipeline.replicas.coordinator import KeyStore
from pipeline.replicas.record import JobRecord
from tests.pipeline.parallel.test_fault_tolerance import (
    _assert_equal_to_replay,
    _launch_with_defaults,
    _log,
    _logged_members,
    needs_torchft,
)

pytest.importorskip("torchft")

from pipeline.replicas import history_watch, hold
from tests.pipeline.parallel.test_ft_record import _bare_ft, _groups

TOTAL = 12  # the steps of the launched jobs


class _Manager:
    """torchft's Manager as one rank of replica group `me` sees it at the end of its loop:
    each quorum's groups and their lineages scripted (`rounds`, the last one repeated), a
    heal to the quorum's step (`heal_to`), what its all-reduce of the quorum sums, the votes
    (a vote with no error reported commits, as torchft's does), and whether the group's other
    ranks agree (`others_agree`: one answer per agreement, the last repeated)."""

    def __init__(self, me: int, step: int, rounds: list[dict[int, int]], *,
                 heal_to: int | None = None, others_agree: tuple[bool, ...] = (True,)) -> None:
        self.me, self.step, self.rounds, self.heal_to = me, step, rounds, heal_to
        self.quorums, self.votes, self.agreements, self.sent = 0, [], [], []
        self.error: Exception | None = None
        self.current: dict[int, int] = {}
        answers = list(others_agree)

        def agree(rank: int, yes: bool, timeout: Any) -> bool:
            self.agreements.append(yes)
            return yes and (answers.pop(0) if len(answers) > 1 else answers[0])

        self._client = SimpleNamespace(agree=agree)

    def start_quorum(self) -> None:
        self.current = self.rounds[min(self.quorums, len(self.rounds) - 1)]
        self.quorums += 1
        self.error = None
        if self.heal_to is not None and self.me in self.current:
            self.step, self.heal_to = self.heal_to, None

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return len(self.current)

    def allreduce(self, flat: torch.Tensor) -> Any:
        self.sent.append(flat.clone())
        n = len(flat) // (1 + ft_lineage.DIGITS)
        total = torch.zeros_like(flat)
        for r, lineage in self.current.items():  # each group's one-hot and lineage, summed
            one = torch.zeros(n)
            one[r] = 1.0
            total += torch.cat([one, ft_lineage.encode(lineage, r, n, flat.dtype, flat.device)])
        flat.copy_(total / len(self.current))  # torchft averages over the participants
        return SimpleNamespace(wait=lambda: None)

    def errored(self) -> Exception | None:
        return self.error

    def report_error(self, error: Exception) -> None:
        self.error = error

    def should_commit(self) -> bool:
        self.votes.append(self.error is None)
        self.step += self.error is None
        return self.error is None


def _ft(manager: _Manager, **fields: Any) -> Any:
    return _bare_ft(**{"_quorum_started": False, "manager": manager, "num_replicas": 2,
                       "replica_id": manager.me, "rank": 0, "lineage": 7,
                       "last_committed": False, "participants": (), "holding_said": False,
                       "_wait": None,
                       **fields})


def _train(ft: Any, total: int, deadline: float = 60.0) -> list[int]:
    """The loop over ft.training_steps(total), each step committed by this group alone."""
    seen = []
    for step in ft.training_steps(total, deadline=deadline):
        seen.append(step)
        ft.manager.step += 1
        ft._quorum_started, ft.last_committed, ft.participants = False, True, (ft.replica_id,)
    return seen


@pytest.fixture(autouse=True)
def _quick_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hold, "HOLD_PAUSE_S", 0.01)


def test_a_group_at_total_holds_training_nothing_until_every_group_is_back() -> None:
    """Group 0 commits steps 0 and 1 alone (group 1 lost), reaches total 2 and holds: two
    rounds alone, then one with group 1 back at the same lineage, which ends the loop. No step
    past 2 is yielded, every round votes not to commit (a vote to commit would have moved the
    count), and each round's all-reduce carries this group's one-hot and lineage."""
    manager = _Manager(0, 0, [{0: 7}, {0: 7}, {0: 7}, {0: 7}, {0: 7, 1: 7}])
    ft = _ft(manager)
    assert _train(ft, 2) == [0, 1]
    assert manager.step == 2 and ft.committed_steps == 2
    assert manager.quorums == 5 and manager.votes == [False, False, False]
    mine = torch.cat([torch.tensor([1.0, 0.0]), ft_lineage.encode(7, 0, 2, torch.float32,
                                                                  torch.device("cpu"))])
    assert all(torch.equal(sent, mine) for sent in manager.sent)
    assert manager.agreements == [False, False, True]
    assert not ft._quorum_started  # the next step, if any, starts a quorum of its own


def test_a_survivor_whose_peer_never_comes_back_names_its_deadline() -> None:
    """Alone at total for longer than the deadline: PipelineError naming it, after hold rounds
    only (no step yielded past total, none committed)."""
    manager = _Manager(0, 2, [{0: 7}])
    ft = _ft(manager)
    began = time.monotonic()
    with pytest.raises(PipelineError, match=r"replica group 0 reached 2 committed steps and "
                                            r"held there.*\(last: \(0,\)\) within 0.3s"):
        _train(ft, 2, deadline=0.3)
    assert time.monotonic() - began >= 0.3
    assert manager.step == 2 and manager.votes and not any(manager.votes)


def test_a_group_healed_into_total_trains_nothing() -> None:
    """A restarted group healed to 5 by its first quorum, with the total at 5: it yields no
    step (its peer holds, and no collective of a step would meet it), and ends in that round
    once both groups are in it with one lineage."""
    manager = _Manager(1, 0, [{0: 9, 1: 9}], heal_to=5)
    ft = _ft(manager, lineage=9)
    assert _train(ft, 5) == []
    assert (manager.step, manager.quorums, manager.votes) == (5, 1, [False])


def test_a_step_committed_with_every_group_at_total_ends_at_once() -> None:
    """The fast path: the step that reached the total held every group: no hold round."""
    manager = _Manager(0, 1, [{0: 7, 1: 7}])
    ft = _ft(manager)
    for step in ft.training_steps(2, deadline=60):
        assert step == 1
        manager.step += 1
        ft._quorum_started, ft.last_committed, ft.participants = False, True, (0, 1)
    assert manager.quorums == 1 and manager.votes == []


def test_a_group_ends_only_when_every_one_of_its_ranks_saw_every_group() -> None:
    """Both groups in the round, but another rank of this group saw fewer (its all-reduce
    failed): the group holds another round, so that no rank of it is left alone in a quorum
    that waits for all of them."""
    manager = _Manager(0, 2, [{0: 7, 1: 7}], others_agree=(False, True))
    ft = _ft(manager)
    assert _train(ft, 2) == []
    assert manager.quorums == 2 and manager.agreements == [True, True]


def test_groups_at_total_on_other_histories_do_not_end_as_one() -> None:
    """Both at total with other lineages: none ends there; the group apart from the
    lowest-numbered one stops (ReplicasDiverged) to restart and heal from it, and the
    lowest-numbered one holds on."""
    apart = _ft(_Manager(1, 2, [{0: 7, 1: 8}]), lineage=8)
    with pytest.raises(ft_lineage.ReplicasDiverged, match=r"replica\(s\) \[1\] committed"):
        _train(apart, 2)
    manager = _Manager(0, 2, [{0: 7, 1: 8}, {0: 7, 1: 8}, {0: 7, 1: 7}])
    assert _train(_ft(manager), 2) == []
    assert manager.quorums == 3 and manager.agreements == [False, False, True]


def test_a_holding_group_is_not_taken_for_stuck() -> None:
    """The launcher's progress watch: a group that holds at its count (its record says so)
    is waiting for its peers, not stuck; a group at the same count that does not hold is."""
    store = KeyStore()
    groups = _groups([False, False])
    for g in (0, 1):
        JobRecord(store, g).committed(2, 7)
    JobRecord(store, 0).holds(2, 7)
    progress = history_watch.Progress(store, groups, 1, timeout=0.2)
    assert progress.check() is None
    time.sleep(0.3)
    progress.next_look = 0.0
    why = progress.check()
    assert why is not None and "replica group 1 committed no step for" in why, why
    JobRecord(store, 1).holds(2, 7)
    progress.restarted(groups[1])
    time.sleep(0.3)
    progress.next_look = 0.0
    assert progress.check() is None
    JobRecord(store, 0).committed(0, 0)  # restarted: its hold is gone with its count
    assert not history_watch.holding(store, 0, 1)


def _steps_logged(out: Path) -> dict[tuple[int, int], list[int]]:
    """Each rank's committed steps, in the order it logged them."""
    return {(r, k): [e["step"] for e in _log(out, r, k) if e["committed"]]
            for r in (0, 1) for k in (0, 1) if (out / f"log_{r}_{k}.jsonl").exists()}


@needs_torchft
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_survivor_holds_at_total_until_the_restarted_group_is_back(tmp_path: Path,
                                                                     busy: None) -> None:
    """2 x 2 ranks, the launcher's defaults, `pipe.training_steps(12)` alone: replica 1's rank
    1 SIGKILLed in its backward of step 2, its group restarted 10 s late. Replica 0 trains on
    alone to 12 committed steps and holds there (it trained on, 283 to 467 steps for a total
    of 40, until a step held both groups); the restarted group heals into step 12 and trains
    nothing. Every rank ends with exactly 12 committed steps, every group equal to the replay
    of the logged quorums, exit 0."""
    done = _launch_with_defaults(tmp_path, str(TOTAL), "--exact", "--kill", "1:1:2:backward",
                                 "--restart-delay", "10", "--min-step-ms", "20",
                                 "--start-together")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "replica group 1 lost rank 1 (killed by SIGKILL)" in done.stderr, done.stderr[-4000:]
    logged = _steps_logged(tmp_path)
    assert max(max(steps) for steps in logged.values()) == TOTAL - 1, logged
    # The survivor committed the last steps alone: it reached 12 before the group was back.
    last = [e for e in _log(tmp_path, 0, 0) if e["committed"]][-1]
    assert (last["step"], last["members"]) == (TOTAL - 1, [0]), last
    killed = json.loads((tmp_path / "killed_0").read_text())["t"]
    for k in (0, 1):  # the restarted group began healed at 12 and took no step
        starts = [json.loads(line) for line in (tmp_path / f"start_1_{k}.jsonl").open()]
        assert len(starts) == 2 and starts[1]["step"] == TOTAL, starts
        assert not [e for e in _log(tmp_path, 1, k) if e["t"] > killed], k
    members = _logged_members(tmp_path)
    assert len(members) == TOTAL
    _assert_equal_to_replay(tmp_path, (0, 1), members)  # every rank at 12, equal


@needs_torchft
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_survivor_whose_peer_does_not_come_back_holds_then_names_its_deadline(
        tmp_path: Path, busy: None) -> None:
    """The same, the group restarted 120 s late and a deadline of 8 s: the survivor holds at 12
    committed steps for 8 s, trains no step past them, and ends with the PipelineError naming
    the deadline; the launcher then has no live group holding the history, and exits 1."""
    done = _launch_with_defaults(tmp_path, str(TOTAL), "--exact", "--kill", "1:1:2:backward",
                                 "--restart-delay", "120", "--deadline", "8",
                                 "--min-step-ms", "20", "--start-together")
    assert done.returncode == 1, done.stderr[-4000:]
    assert (f"replica group 0 reached {TOTAL} committed steps and held there" in done.stderr
            and "within 8s" in done.stderr), done.stderr[-4000:]
    logged = _steps_logged(tmp_path)
    assert max(logged[0, 0]) == max(logged[0, 1]) == TOTAL - 1, logged
    assert "no live group holds the job's history" in done.stderr, done.stderr[-4000:]
