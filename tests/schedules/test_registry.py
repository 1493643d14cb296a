import subprocess
import sys
import textwrap

import pytest

import schedules
from schedules import ScheduleError


def test_available_lists_the_builtins() -> None:
    assert schedules.available() == ("gpipe", "1f1b", "interleaved", "2bw", "zb-h1", "zb-h2",
                                     "zb-h1-tight", "zb-v", "dualpipe-v", "auto")


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'; known: gpipe, 1f1b"):
        schedules.get_schedule("pipedream", 2, 2)


def test_bad_options_and_values() -> None:
    with pytest.raises(ScheduleError, match="takes no option num_batches; it accepts: none"):
        schedules.get_schedule("1f1b", 2, 2, num_batches=2)
    with pytest.raises(ScheduleError, match="num_microbatches must be an int >= 1 \\(got 0\\)"):
        schedules.get_schedule("gpipe", 2, 0)
    with pytest.raises(ScheduleError, match="stages_per_rank must be an int >= 1"):
        schedules.get_schedule("interleaved", 2, 2, stages_per_rank=0)


def test_register_a_custom_generator() -> None:
    from schedules.registry import _GENERATORS

    @schedules.register("test-reverse-gpipe")
    def reverse(num_ranks: int, num_microbatches: int) -> schedules.Schedule:
        base = schedules.get_schedule("gpipe", num_ranks, num_microbatches)
        m = num_microbatches
        rows = tuple(row[:m] + tuple(reversed(row[m:])) for row in base.actions)
        return base.replace(actions=rows, name="test-reverse-gpipe")

    try:
        s = schedules.validate(schedules.get_schedule("test-reverse-gpipe", 3, 4))
        assert str(s.actions[0][4]) == "0B3"
        with pytest.raises(ValueError, match="already registered"):
            schedules.register("gpipe")(reverse)
    finally:
        del _GENERATORS["test-reverse-gpipe"]


def test_importable_without_torch() -> None:
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'graphviz'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import schedules
        s = schedules.validate(schedules.get_schedule('zb-h1', 4, 8))
        print(round(schedules.simulate(s).bubble_fraction, 4))
        assert 'torch' not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.1111"  # 1 - 3m / (3m + p - 1) = 3/27


def test_options_name_what_each_generator_takes() -> None:
    assert schedules.options("interleaved") == ("stages_per_rank",)
    assert schedules.options("2bw") == ("num_batches",)
    assert schedules.options("1f1b") == ()
    with pytest.raises(ScheduleError, match="unknown schedule"):
        schedules.options("nope")


def test_generators_carry_what_a_runtime_needs() -> None:
    inter, bw, one = (schedules.info(n) for n in ("interleaved", "2bw", "1f1b"))
    assert (inter.stages_per_rank, inter.stages_option, inter.multi_batch) == (
        2, "stages_per_rank", False)
    assert (bw.stages_per_rank, bw.batches_option, bw.multi_batch) == (1, "num_batches", True)
    assert one.options_for(stages_per_rank=1) == {}
    assert inter.options_for(stages_per_rank=3) == {"stages_per_rank": 3}
    assert bw.options_for(stages_per_rank=1, num_batches=4) == {"num_batches": 4}
    with pytest.raises(ScheduleError, match="'1f1b' places 1 stage\\(s\\) per rank \\(got a "
                                            "request for 2\\)"):
        one.options_for(stages_per_rank=2)
    with pytest.raises(ScheduleError, match="'1f1b' runs one batch at a time"):
        one.options_for(stages_per_rank=1, num_batches=2)


def test_metadata_must_name_real_options() -> None:
    def gen(num_ranks: int, num_microbatches: int, depth: int = 2) -> schedules.Schedule:
        raise AssertionError("never generated")

    with pytest.raises(ValueError, match="stages_option='virtual' is not an option of gen "
                                         "\\(its options: depth\\)"):
        schedules.register("test-bad-meta", stages_option="virtual")(gen)
    with pytest.raises(ValueError, match="stages_per_rank must be an int >= 1"):
        schedules.register("test-bad-meta", stages_per_rank=0)
    assert "test-bad-meta" not in schedules.available()
