"""The job's record of committed steps (pipeline/replicas/record.py) and the launcher's
decisions on it: which history a step extends, whether a lost group can be healed, whether a
live group can ever catch up, whether the groups ended alike; the loop's refusals."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipeline import PipeConfigError
from pipeline.replicas.coordinator import KeyStore
from pipeline.replicas.record import PARTIAL, JobRecord, group_key, read_record

pytest.importorskip("torchft")

from pipeline.replicas import history_watch
from pipeline.replicas import launch as replica_launch
from pipeline.replicas.replica import FaultTolerance


@pytest.fixture
def store() -> Any:
    return KeyStore()  # the record as the launcher holds it


def test_one_history_claims_each_step(store: Any) -> None:
    """The first quorum to commit a step names its history; a group of another history sees
    the conflict before its commit and loses a race after it; its own history passes."""
    a, b = JobRecord(store, 0), JobRecord(store, 1)
    assert a.conflict(0, 111) is None and a.claim(0, 111) is None
    assert b.claim(0, 111) is None  # the same quorum's other group: the same history
    assert b.conflict(0, 222) == 111 and b.claim(0, 222) == 111
    assert b.conflict(1, 222) is None  # a step nobody committed yet
    a.committed(1, 111)
    b.committed(0, 0)
    assert read_record(store, 3) == {0: (1, 111), 1: (0, 0)}


def _groups(done: list[bool]) -> list[replica_launch.ReplicaGroup]:
    groups = [replica_launch.ReplicaGroup(r) for r in range(len(done))]
    for g, d in zip(groups, done, strict=True):
        g.done = d  # no processes: a group not done is live
    return groups


def test_a_lost_group_is_restarted_only_while_a_live_group_holds_the_history(
        store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_watch, "HISTORY_GRACE_S", 0.2)
    groups = _groups([False, False])
    assert history_watch.history_lost(store, groups, groups[1]) is None  # nothing committed
    store.set(group_key(0), "5 9")
    store.set(group_key(1), "5 9")
    assert history_watch.history_lost(store, groups, groups[1]) is None
    # The only group holding the 5 steps is lost while the other restarts from nothing.
    store.set(group_key(1), "0 0")
    why = history_watch.history_lost(store, groups, groups[0])
    assert why is not None and "resume the job from its last sharded checkpoint" in why
    # Lost after the other finished: no live group holds what it would have to redo, and
    # none is left to show it, so the grace is not waited (the job ended 20 s late).
    monkeypatch.setattr(history_watch, "HISTORY_GRACE_S", 3600.0)
    groups = _groups([True, False])
    store.set(group_key(1), "5 9")
    began = time.monotonic()
    why = history_watch.history_lost(store, groups, groups[1])
    assert why is not None and "finished groups' weights are the job's result" in why
    assert time.monotonic() - began < 60  # not the hour of grace


def test_a_live_group_that_can_never_catch_up_ends_the_job(
        store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_watch, "HISTORY_GRACE_S", 0.05)
    groups = _groups([True, False])
    store.set(group_key(0), "20 7")
    store.set(group_key(1), "20 7")
    assert history_watch.Stuck(store, groups).check() is None  # it is finishing alike
    store.set(group_key(1), "3 5")
    stuck = history_watch.Stuck(store, groups)
    assert stuck.check() is None  # seen once: it may be writing its count
    time.sleep(0.1)  # past the grace
    stuck.next_look = 0.0
    why = stuck.check()
    assert why is not None and "replica group(s) [1] never reached the job's history" in why


def test_groups_that_end_with_other_histories_fail_the_job(
        store: Any, capsys: pytest.CaptureFixture[str]) -> None:
    groups = _groups([True, True])
    store.set(group_key(0), "20 7")
    store.set(group_key(1), "20 7")
    assert history_watch.compare_ends(store, groups) == 0
    store.set(group_key(1), "20 8")
    assert history_watch.compare_ends(store, groups) == 1
    assert "ended with different histories" in capsys.readouterr().err


def _bare_ft(**fields: Any) -> FaultTolerance:
    """A FaultTolerance without its torchft Manager, for the checks made before it is used."""
    ft = object.__new__(FaultTolerance)
    ft.__dict__.update({"_optimizer": object(), "_scaler": None, "_quorum_started": True,
                        "record": None, "_writes_count": False,
                        "_stepped": False, **fields})
    return ft


def test_a_scaler_given_to_pipe_step_alone_is_refused() -> None:
    """Stepped by the user, it would skip or grow on this replica's gradients alone."""
    ft = _bare_ft()
    with pytest.raises(PipeConfigError, match=r"give the same scaler to pipe.fault_tolerant"):
        ft.before_step(torch.amp.GradScaler("cpu"))
    ft.before_step(None)  # no scaler: fine
    assert ft._stepped


def test_state_for_a_heal_needs_state_dict_and_a_free_name() -> None:
    model = torch.nn.Linear(2, 2)
    ft = _bare_ft(_optimizer=None, _pipe=SimpleNamespace(parameters=model.parameters))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PipeConfigError, match=r"state=\{'epoch': \.\.\.\}.*state_dict\(\)"):
        ft.wrap(optimizer, state={"epoch": 3})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    with pytest.raises(PipeConfigError, match=r"other than pipe, lineage, optimizer"):
        ft.wrap(optimizer, state={"optimizer": scheduler})


class _Steps:
    """torchft's Manager as training_steps sees it: quorums started, the committed count."""

    def __init__(self) -> None:
        self.step, self.quorums = 0, 0

    def start_quorum(self) -> None:
        self.quorums += 1

    def current_step(self) -> int:
        return self.step


def test_training_steps_heal_first_and_end_on_a_step_every_replica_took() -> None:
    """Each step's quorum starts before the step is yielded (none after the last); the loop
    ends on the step that reached `total` with every replica in it (a group at `total`
    without them holds there: test_ft_hold.py)."""
    manager = _Steps()
    ft = _bare_ft(_quorum_started=False, manager=manager, num_replicas=2, replica_id=0,
                  last_committed=False, participants=())
    seen = []
    for step in ft.training_steps(2, deadline=60):
        seen.append(step)
        assert manager.quorums == step + 1  # this step's quorum (and heal) came first
        manager.step += 1  # the step committed: by this replica alone, then by both
        ft._quorum_started, ft.last_committed = False, True
        ft.participants = (0,) if step < 1 else (0, 1)
    assert seen == [0, 1] and manager.quorums == 2


def test_a_heal_from_a_group_of_another_model_is_a_configuration_error() -> None:
    """Groups that build different models: the healed rank's load fails as a configuration
    error (the rank exits 78, the launcher ends the job naming it), where a failed
    load_state_dict was a plain failure, restarted and healed from again until the give-up."""
    from torch import nn

    from pipeline import Pipe

    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), balance=[1, 1],
                devices=["cpu", "cpu"], chunks=1)
    ft = _bare_ft(_pipe=pipe)
    same = {k: v.clone() + 1 for k, v in pipe.state_dict().items()}
    ft._load_model(same)  # the same model: loaded
    assert all(torch.equal(v, same[k]) for k, v in pipe.state_dict().items())
    wider = dict(same, **{"1.weight": torch.zeros(3, 4)})
    with pytest.raises(PipeConfigError, match=r"other shapes \(1.weight: \(3, 4\) there, "
                                              r"\(2, 4\) here\).*the same model"):
        ft._load_model(wider)
    deeper = dict(same, **{"2.weight": torch.zeros(2, 2)})
    with pytest.raises(PipeConfigError, match=r"other keys \(\['2.weight'\]\)"):
        ft._load_model(deeper)
    assert all(torch.equal(v, same[k]) for k, v in pipe.state_dict().items())  # unchanged


def test_a_group_holds_the_history_only_once_every_rank_does(
        store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of group 1 healed to step 5, rank 1 did not (its source was lost): the group
    holds nothing, and with group 0 lost the job ends at once, not after the grace (the
    launcher restarted group 0 from its initial weights and both trained over the history)."""
    monkeypatch.setattr(history_watch, "HISTORY_GRACE_S", 3600.0)
    for r in (0, 1):
        JobRecord(store, 0, r).committed(5, 9)
    JobRecord(store, 1, 0).committed(5, 9)
    JobRecord(store, 1, 1).committed(0, 0)
    assert read_record(store, 2, 2) == {0: (5, read_record(store, 2, 2)[0][1]),
                                        1: (0, PARTIAL)}
    groups = _groups([False, False])
    began = time.monotonic()
    why = history_watch.history_lost(store, groups, groups[0], 2)
    assert time.monotonic() - began < 60  # not the hour of grace
    assert why is not None and "group(s) [1] hold a heal in part" in why, why
    assert "none is started again from its initial weights" in why
    JobRecord(store, 1, 1).committed(5, 9)  # the heal completed: group 1 holds it
    assert history_watch.history_lost(store, groups, groups[0], 2) is None


def test_a_group_that_commits_nothing_within_the_bound_ends_the_job(store: Any) -> None:
    groups = _groups([False, False])
    progress = history_watch.Progress(store, groups, 1, timeout=0.2)
    assert progress.check() is None
    for count in (1, 2):  # group 0 commits, group 1 does not
        time.sleep(0.15)
        JobRecord(store, 0).committed(count, 7)
        progress.next_look = 0.0
        why = progress.check()
    assert why is not None and "replica group 1 committed no step for" in why, why
    assert "the job's history 2" in why and "rather than retry forever" in why
    progress.restarted(groups[1])  # a restarted group gets the bound afresh
    progress.next_look = 0.0
    JobRecord(store, 0).committed(3, 7)
    assert progress.check() is None


def test_a_heal_is_checked_whole() -> None:
    """A rank whose heal failed, or brought a state other than the history's at that step,
    raises: its group restarts as lost (a half-healed group trained on as one replica)."""
    from pipeline.replicas.heal import HealIncomplete, check_heal
    from pipeline.replicas.lineage import state_digest

    model = torch.nn.Linear(2, 2)
    store = KeyStore()
    errors: list[Exception] = [RuntimeError("the source closed")]
    ft = SimpleNamespace(replica_id=1, rank=1, record=JobRecord(store, 1, 1),
                         manager=SimpleNamespace(errored=lambda: errors[0] if errors else None))
    ft._digest_now = lambda: state_digest(model.state_dict().values())
    with pytest.raises(HealIncomplete, match=r"rank 1: its heal to step 4 failed \("
                                             r"RuntimeError: the source closed\)"):
        check_heal(ft, 4)
    errors.clear()
    check_heal(ft, 4)  # no digest recorded at step 4: nothing to hold it against
    JobRecord(store, 0, 1).digest(4, ft._digest_now())  # the history's, from its commit
    check_heal(ft, 4)
    with torch.no_grad():
        model.weight[0, 0] += 1.0
    with pytest.raises(HealIncomplete, match=r"is not the job's state after 4 committed"):
        check_heal(ft, 4)
