"""benchmarks.config: suites, filters and groups."""

from __future__ import annotations

import pytest

from benchmarks.config import SUITES, groups, narrow, num_units, stages_per_rank


def test_quick_suite_is_tiny() -> None:
    quick = SUITES["quick"]
    assert quick.models == ("tiny",)
    assert quick.repeats <= 3


def test_full_suite_holds_the_targets_configurations() -> None:
    full = SUITES["full"]
    assert "mlp" in full.models and 2 in full.ranks and 1 in full.ranks
    assert {4, 8, 16} <= set(full.microbatches["mlp"])
    assert {"gpipe", "1f1b", "zb-h1"} <= set(full.schedules)
    assert set(full.transports) == {"threads", "processes"}


def test_suites_run_the_zero_bubble_and_v_shape_schedules() -> None:
    assert {"zb-h1", "zb-h2", "zb-v", "dualpipe-v"} <= set(SUITES["full"].schedules)
    assert {"zb-h1", "zb-v", "dualpipe-v"} <= set(SUITES["quick"].schedules)
    # tiny (5 layers) on 2 ranks: the V schedules' 4 stages fit; on 3 ranks their 6 do not.
    two, three = groups(narrow(SUITES["quick"], ranks="2,3"))
    assert {"zb-v", "dualpipe-v"} <= set(two.schedules)
    assert not {"zb-v", "dualpipe-v"} & set(three.schedules)
    assert stages_per_rank("zb-v") == stages_per_rank("dualpipe-v") == 2


def test_narrow_replaces_each_given_list() -> None:
    s = narrow(SUITES["full"], models="mlp", ranks="2", microbatches="4,8",
               schedules="1f1b", transports="processes", warmup=0, repeats=2)
    assert s.models == ("mlp",) and s.ranks == (2,) and s.microbatches == {"mlp": (4, 8)}
    assert s.schedules == ("1f1b",) and s.transports == ("processes",)
    assert (s.warmup, s.repeats) == (0, 2)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"models": "resnet"}, "unknown model"),
    ({"transports": "carrier-pigeon"}, "unknown transport"),
    ({"ranks": "0"}, ">= 1"),
    ({"repeats": 0}, "repeats"),
])
def test_narrow_rejects_bad_filters(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        narrow(SUITES["quick"], **kwargs)  # type: ignore[arg-type]


def test_groups_one_per_model_method_and_rank_count() -> None:
    s = narrow(SUITES["full"], models="mlp,unbalanced", ranks="1,2")
    gs = groups(s)
    names = [g.name for g in gs]
    # One rank: only the model's first method (every method splits one stage alike).
    assert names == ["mlp/params/p1", "mlp/params/p2", "unbalanced/uniform/p1",
                     "unbalanced/uniform/p2", "unbalanced/time/p2"]
    assert gs[0].schedules == ("gpipe", "1f1b")
    assert gs[1].schedules == SUITES["full"].schedules
    assert num_units(gs) == sum(len(g.microbatches) for g in gs)


def test_groups_skip_what_cannot_run() -> None:
    # tiny has 5 layers and a batch of 16: interleaved on 4 ranks needs 8 stages; m=32 > 16.
    s = narrow(SUITES["quick"], ranks="4", microbatches="4,32")
    (g,) = groups(s)
    assert "interleaved" not in g.schedules and g.microbatches == (4,)
    assert stages_per_rank("interleaved") == 2 and stages_per_rank("1f1b") == 1


def test_one_gpu_keeps_the_threads_pipeline_and_says_what_it_skips() -> None:
    from benchmarks.config import SUITES, fit_to_gpus, groups

    chosen = groups(SUITES["quick"], device="cuda")
    kept, notes = fit_to_gpus(chosen, 1)
    assert {g.num_ranks for g in kept} == {1, 2}
    assert all(g.transports == ("threads",) for g in kept if g.num_ranks == 2)
    assert all(g.transports == tuple(SUITES["quick"].transports) for g in kept
               if g.num_ranks == 1)
    assert notes and all("needs 2 GPUs and 1 is here" in n for n in notes)
    assert fit_to_gpus(chosen, 2) == (list(chosen), [])
