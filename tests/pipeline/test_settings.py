"""Settings from `PIPELINE_*` variables and the launcher's flags: one rule for all of them."""

from __future__ import annotations

import pytest

from pipeline import PipeConfigError, settings
from pipeline.comm import bootstrap, quiet_exit, same_host, socket_link, wire
from pipeline.launch import main as launch

# Each variable with the function that reads it and its value when unset.
_READERS = [
    (bootstrap.INIT_TIMEOUT_ENV, bootstrap.init_timeout, 300.0),
    (wire.LIMIT_ENV, lambda: wire.message_limit(settings._raw(wire.LIMIT_ENV, None)),
     wire._memory_bytes()),
    (same_host.ENV, same_host.local_p2p, "1"),
    (socket_link.SPIN_ENV, socket_link.spin_setting, None),
]


@pytest.mark.parametrize(("name", "read", "unset"), _READERS)
def test_empty_means_unset_for_every_variable(monkeypatch: pytest.MonkeyPatch, name: str,
                                              read: object, unset: object) -> None:
    """An empty PIPELINE_LOCAL_P2P was an error, an empty PIPELINE_MAX_MESSAGE_BYTES unset."""
    for raw in ("", "  "):
        monkeypatch.setenv(name, raw)
        assert read() == unset  # type: ignore[operator]


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "-inf", "0", "-5", "1e400", "1e8"])
def test_a_bad_init_timeout_names_the_variable_the_value_and_the_range(
        monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """`abc`, `nan` and `inf` raised a raw ValueError or OverflowError on every rank."""
    monkeypatch.setenv(bootstrap.INIT_TIMEOUT_ENV, raw)
    with pytest.raises(PipeConfigError, match=(
            rf"^PIPELINE_INIT_TIMEOUT must be a finite number from 0\.001 to 1e\+07 seconds; "
            rf"got '{raw}': set such a number, or unset it")):
        bootstrap.init_timeout()


def test_init_timeouts_in_range_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, seconds in (("300", 300.0), ("2.5", 2.5), ("1e3", 1000.0), (" 60 ", 60.0)):
        monkeypatch.setenv(bootstrap.INIT_TIMEOUT_ENV, raw)
        assert bootstrap.init_timeout() == seconds


@pytest.mark.parametrize("raw", ["inf", "nan", "0", "soon"])
def test_the_launcher_refuses_an_init_timeout_by_the_same_rule(
        capsys: pytest.CaptureFixture[str], raw: str) -> None:
    """`--init-timeout inf` passed the launcher's check, then every rank overflowed."""
    with pytest.raises(SystemExit) as exit_:
        launch(["--nproc", "1", "--init-timeout", raw, "script.py"])
    assert exit_.value.code == 2
    assert (f"--init-timeout must be a finite number from 0.001 to 1e+07 seconds; got "
            f"'{raw}'") in capsys.readouterr().err


def test_a_message_bound_is_whole_exactly() -> None:
    """4000000000000000000.5 was accepted (a float rounds it to a whole number)."""
    with pytest.raises(PipeConfigError, match=r"PIPELINE_MAX_MESSAGE_BYTES must be a whole "
                                              r"number of bytes .*got '4000000000000000000\.5'"):
        wire.message_limit("4000000000000000000.5")
    assert wire.message_limit("4000000000000000000") == 4 * 10**18


def test_choices_are_listed_with_their_meaning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quiet_exit.ENV, "no")
    with pytest.raises(PipeConfigError, match=r"PIPELINE_QUIET_EXIT must be one of 1 \(exit "
                                              r"quietly\), 0 \(.*\); got 'no'"):
        quiet_exit.arm()
    monkeypatch.setenv(same_host.ENV, "maybe")
    with pytest.raises(PipeConfigError, match=r"PIPELINE_LOCAL_P2P must be one of 1 .*, 0 "
                                              r"\(no links\), require .*; got 'maybe'"):
        same_host.local_p2p()
