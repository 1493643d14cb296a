"""The planner's memory: the last choice for a model and settings is kept unless a candidate is
more than `ties.KEEP` faster than it, re-predicted from this run's profile; its file, in the
user's cache, passes the file gate and is never trusted."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from pipeline.planner import Link, ModelProfile, Plan, plan
from pipeline.planner import remembered as memory
from pipeline.planner.search import predict
from pipeline.planner.ties import KEEP, NEAR
from tests.other_user import other_user, run_as_other
from tests.strategies import noisy_profiles, synthetic_profile, tied_profiles

_LINK = Link("threads", 1e-5, 1e-10)
# 1f1b at 2 or 4 micro-batches: 2 is the simpler, 4 idles less and pays more per micro-batch.
_SPACE: dict[str, Any] = {"schedules": ["1f1b"], "chunks": [2, 4], "checkpoints": ["never"]}


def _profile(overhead: float, saved: float = 1024.0) -> ModelProfile:
    return synthetic_profile([(1e-4, saved, 4096.0)] * 4, 8, overhead=overhead)


def _step(profile: ModelProfile, chunks: int) -> float:
    step = predict(profile, _LINK, schedule="1f1b", chunks=chunks, checkpoint="never",
                   pp=2).step_time
    assert step is not None
    return step


def _ratio(profile: ModelProfile) -> float:
    """Chunks 2's predicted step over chunks 4's: above 1, chunks 4 is the faster."""
    return _step(profile, 2) / _step(profile, 4)


def _profile_at(ratio: float, saved: float = 1024.0) -> ModelProfile:
    """A profile whose chunks 2 predicts `ratio` times chunks 4's step (more overhead per
    micro-batch favours fewer of them): bisected on the overhead."""
    lo, hi = 0.0, 1e-3
    assert _ratio(_profile(lo)) > ratio > _ratio(_profile(hi))
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _ratio(_profile(mid, saved)) > ratio else (lo, mid)
    found = _profile((lo + hi) / 2, saved)
    assert _ratio(found) == pytest.approx(ratio, rel=1e-6)
    return found


def _plan(profile: ModelProfile, remember: Any, **kw: Any) -> Plan:
    model = nn.Sequential(*[nn.Identity() for _ in range(profile.num_layers)])
    return plan(model, None, None, None, ranks=2, memory_per_rank=kw.pop("memory", None),
                profile=profile, link=_LINK, contention=1.0, remember=remember,
                **{**_SPACE, **kw})


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if not p.name.startswith("."))


def test_a_last_choice_within_the_margin_of_the_fastest_is_kept(tmp_path: Path) -> None:
    first = _plan(_profile_at(0.9), tmp_path)  # chunks 2 is 10% faster: chosen
    assert first.chunks == 2
    assert first.remembered is not None and "no last choice" in first.remembered
    moved = _profile_at(1 + (NEAR + KEEP) / 2)  # chunks 4 is now 7.5% faster
    assert _plan(moved, False).chunks == 4  # afresh, chunks 2 is no near tie: it would flip
    again = _plan(moved, tmp_path)
    assert again.chunks == 2 and again.chosen.status == "chosen"
    assert again.predicted_step_time == pytest.approx(_step(moved, 2))  # re-predicted
    assert again.remembered == (
        f"kept the last choice (1f1b, chunks 2, 'never', {_step(moved, 2) * 1e3:.2f} ms), "
        f"within 7.5% of the fastest (1f1b, chunks 4, 'never', {_step(moved, 4) * 1e3:.2f} "
        f"ms; a candidate must be more than {KEEP:.0%} faster to replace it)")
    assert again.remembered in again.summary().splitlines()
    assert len(_files(tmp_path)) == 1


def test_a_candidate_more_than_the_margin_faster_replaces_it(tmp_path: Path) -> None:
    assert _plan(_profile_at(0.9), tmp_path).chunks == 2
    far = _profile_at(1 + 1.5 * KEEP)  # chunks 4 is 15% faster
    switched = _plan(far, tmp_path)
    assert switched.chunks == 4
    assert switched.remembered == (
        f"chose 1f1b, chunks 4, 'never' ({_step(far, 4) * 1e3:.2f} ms): 15.0% faster than the "
        f"last choice (1f1b, chunks 2, 'never') re-predicted ({_step(far, 2) * 1e3:.2f} ms), "
        f"more than the {KEEP:.0%} that keeps it")
    # The new choice is remembered in turn: chunks 2 3% faster (afresh it would be chosen,
    # the simpler and the fastest) does not move it back.
    back = _profile_at(0.97)
    assert _plan(back, False).chunks == 2
    kept = _plan(back, tmp_path)
    assert kept.chunks == 4 and kept.remembered is not None
    assert kept.remembered.startswith("kept the last choice (1f1b, chunks 4, 'never'")


def test_a_last_choice_that_no_longer_fits_the_memory_is_dropped(tmp_path: Path) -> None:
    small, large = _profile_at(0.9, saved=1024.0), _profile_at(0.9, saved=16384.0)

    def peak(profile: ModelProfile, chunks: int) -> float:
        got = predict(profile, _LINK, schedule="1f1b", chunks=chunks, checkpoint="never",
                      pp=2).peak_bytes
        assert got is not None
        return max(got)

    # The larger activations take chunks 2 over the budget; chunks 4 (half the rows) fits.
    budget = (peak(large, 2) + peak(large, 4)) / 2
    assert peak(small, 2) < budget and peak(large, 4) < budget < peak(large, 2)
    assert _plan(small, tmp_path, memory=budget).chunks == 2
    afresh = _plan(large, tmp_path, memory=budget)
    assert afresh.chunks == 4
    assert afresh.remembered is not None and afresh.remembered.startswith(
        "the last choice (1f1b, chunks 2, 'never') is no longer valid: over budget")
    assert afresh.remembered.endswith(
        f"chose 1f1b, chunks 4, 'never', {afresh.predicted_step_time * 1e3:.2f} ms afresh")
    assert json.loads(_files(tmp_path)[0].read_text())["choice"]["chunks"] == 4


def test_a_remembered_choice_that_is_no_candidate_is_dropped(tmp_path: Path) -> None:
    _plan(_profile_at(0.9), tmp_path)
    (path,) = _files(tmp_path)
    data = json.loads(path.read_text())
    data["choice"]["chunks"] = 3  # not among chunks=[2, 4]
    path.write_text(json.dumps(data))
    p = _plan(_profile_at(0.9), tmp_path)
    assert p.chunks == 2 and p.remembered is not None
    assert p.remembered.startswith("the last choice (1f1b, chunks 3, 'never') is no longer "
                                   "valid: not among this run's candidates")


@pytest.mark.parametrize(("damage", "said"), [
    ({"text": "{not json"}, "is not JSON"),
    ({"key": "0" * 32}, "is for other settings"),
    ({"chunks": "two"}, "chunks must be a whole number >= 1 \\(got 'two'\\)"),
    ({"checkpoint": "sometimes"}, "checkpoint must be one of"),
    ({"format": 2}, "is of format 2, not 1"),
    ({"text": "[]"}, "holds no object"),
    ({"text": "[" * 1000}, "nests more than 4 arrays or objects deep"),
])
def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning(
        tmp_path: Path, damage: dict[str, Any], said: str) -> None:
    _plan(_profile_at(0.9), tmp_path)  # remembers chunks 2
    (path,) = _files(tmp_path)
    data = json.loads(path.read_text())
    if "text" in damage:
        content = damage["text"]
    elif "chunks" in damage or "checkpoint" in damage:
        content = json.dumps({**data, "choice": {**data["choice"], **damage}})
    else:
        content = json.dumps({**data, **damage})
    path.write_text(content)
    with pytest.warns(memory.RecallWarning, match=said) as caught:
        p = _plan(_profile_at(1 + 1.5 * KEEP), tmp_path)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert p.chunks == 4 and p.remembered is not None and "ignored" in p.remembered
    assert json.loads(path.read_text())["choice"]["chunks"] == 4  # written anew


def test_a_symlinked_cache_file_is_neither_read_nor_written_through(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    _plan(_profile_at(0.9), cache)
    (path,) = _files(cache)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(path.read_text())  # a valid memory of chunks 2, through a link
    path.unlink()
    path.symlink_to(elsewhere)
    with pytest.warns(memory.RecallWarning, match="symbolic link"):
        p = _plan(_profile_at(1 + (NEAR + KEEP) / 2), cache)
    assert p.chunks == 4  # the linked memory (chunks 2) would have kept chunks 2
    assert p.remembered is not None and "not remembered" in p.remembered
    assert path.is_symlink() and json.loads(elsewhere.read_text())["choice"]["chunks"] == 2


def test_an_oversized_cache_file_is_refused_unread(tmp_path: Path) -> None:
    _plan(_profile_at(0.9), tmp_path)
    (path,) = _files(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(memory.MAX_FILE_BYTES + 1)  # sparse, its JSON first
    with pytest.warns(memory.RecallWarning, match=f"more than the {memory.MAX_FILE_BYTES}"):
        p = _plan(_profile_at(1 + (NEAR + KEEP) / 2), tmp_path)
    assert p.chunks == 4


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to give a file to another user")
def test_a_cache_file_of_another_user_is_not_trusted(tmp_path: Path) -> None:
    _plan(_profile_at(0.9), tmp_path)
    (path,) = _files(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.warns(memory.RecallWarning, match="belongs to another user"):
        p = _plan(_profile_at(1 + (NEAR + KEEP) / 2), tmp_path)
    assert p.chunks == 4


@other_user
def test_a_cache_directory_another_user_planted_is_not_used(shared_dir: str) -> None:
    planted = Path(shared_dir) / "plans"
    done = run_as_other("import os, sys; os.mkdir(sys.argv[1], 0o777)", str(planted))
    assert done.returncode == 0, done.stderr
    with pytest.warns(memory.RecallWarning, match="another user"):
        p = _plan(_profile_at(0.9), planted)
    assert p.remembered is not None and "not remembered" in p.remembered
    assert not os.listdir(planted)


def test_the_memory_is_private_and_keyed_by_settings_not_numbers(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "plans"
    old = os.umask(0o022)
    try:
        _plan(_profile_at(0.9), cache)
    finally:
        os.umask(old)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    (path,) = _files(cache)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    _plan(_profile_at(1.02), cache)  # other numbers, the same model and settings
    assert _files(cache) == [path]
    _plan(_profile_at(0.9), cache, chunks=[2, 4, 8])  # another candidate space
    _plan(_profile_at(0.9), cache, memory=1 << 30)  # another budget
    three_layers = synthetic_profile([(1e-4, 1024.0, 4096.0)] * 3, 8)  # another model
    _plan(three_layers, cache)
    assert len(_files(cache)) == 4


def test_the_cache_directory_follows_the_environment(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert memory.directory() == tmp_path / "xdg" / "pipeline" / "plans"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert memory.directory() == tmp_path / "home" / ".cache" / "pipeline" / "plans"
    monkeypatch.setenv(memory.ENV, str(tmp_path / "mine"))
    assert memory.directory() == tmp_path / "mine" / "plans"


def test_plan_remembers_by_default_when_it_measures_the_profile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.ENV, str(tmp_path))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    kw: dict[str, Any] = {"ranks": 2, "memory_per_rank": None, "link": _LINK,
                          "contention": 1.0, "repeats": 1, "chunks": [1, 2]}
    first = plan(model, x, y, nn.MSELoss(), **kw)
    assert first.remembered is not None and len(_files(tmp_path / "plans")) == 1
    again = plan(model, x, y, nn.MSELoss(), **kw)  # a profile taken again: the last choice weighed
    assert again.remembered is not None and "no last choice" not in again.remembered
    fresh = plan(model, x, y, nn.MSELoss(), remember=False, **kw)
    given = plan(model, x, y, nn.MSELoss(), profile=first.profile, **kw)
    assert fresh.remembered is None and given.remembered is None  # off / a profile in hand
    with pytest.raises(ValueError, match="remember=True chooses by prediction"):
        plan(model, x, y, nn.MSELoss(), remember=True, trials=1, **kw)


@settings(max_examples=15, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.large_base_example])
@given(st.data(), tied_profiles())
def test_noise_within_the_margin_never_changes_a_remembered_choice(
        tmp_path_factory: pytest.TempPathFactory, data: st.DataObject,
        profile: ModelProfile) -> None:
    """Each cost off by up to `spread` moves a candidate's step by that factor at most, so two
    candidates against each other by (1 + spread) / (1 - spread): the last choice, within
    `NEAR` of the fastest when chosen, stays within `KEEP` of it."""
    spread = ((1 + KEEP) / (1 + NEAR) - 1) / 2.2  # (1 + NEAR)(1 + s)/(1 - s) < 1 + KEEP
    cache = tmp_path_factory.mktemp("plans")
    kw: dict[str, Any] = {"max_stages_per_rank": 2, "schedules": None, "chunks": None,
                          "checkpoints": None}
    base = _plan(profile, cache, **kw)
    for _ in range(3):
        noisy = data.draw(noisy_profiles(profile, spread))
        again = _plan(noisy, cache, **kw)
        chosen, was = again.chosen, base.chosen
        assert (chosen.schedule, chosen.options, chosen.chunks, chosen.checkpoint) == (
            was.schedule, was.options, was.chunks, was.checkpoint), again.remembered
        fastest = min(c.step_time for c in again.candidates if c.step_time is not None)
        assert again.predicted_step_time <= fastest * (1 + KEEP)
    # Beyond the margin the choice may move, but only to a candidate more than KEEP faster
    # than the last one re-predicted, or afresh when the last one is gone.
    wild = data.draw(noisy_profiles(profile, 0.5))
    moved = _plan(wild, cache, **kw)
    last = next(c for c in moved.candidates if (c.schedule, c.options, c.chunks, c.checkpoint)
                == (base.chosen.schedule, base.chosen.options, base.chosen.chunks,
                    base.chosen.checkpoint))
    if moved.chosen is not last:
        fastest = min(c.step_time for c in moved.candidates if c.step_time is not None)
        assert last.step_time is not None and last.step_time > fastest * (1 + KEEP)
