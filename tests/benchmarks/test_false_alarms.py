"""The false-alarm count's command line (its launches are measured, in docs/fault-tolerance.md)."""

from __future__ import annotations

import pytest

from benchmarks.false_alarms import main


@pytest.mark.parametrize("argv", [["--launches", "0"], ["--spinners", "-1"], ["--nice", "20"],
                                  ["--steps", "0"]])
def test_bad_counts_are_refused_naming_the_rule(argv: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--launches and --steps must be >= 1, --spinners >= 0 and --nice in [0, 19]" in err
