import pytest

from benchmarks import send_cost


def test_a_row_per_size_and_burst_with_every_piece_timed(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert send_cost.main(["--bytes", "8192", "--bursts", "1,3", "--messages", "6",
                           "--work", "1"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")]
    assert rows[0].split("|")[1:3] == [" bytes ", " burst "]
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows[1:]]
    assert [(c[0], c[1]) for c in cells] == [("8192", "1"), ("8192", "3")]
    for c in cells:
        times = [float(v) for cell in c[2:7] for v in cell.split(" / ")]
        assert all(t > 0 for t in times)
        assert c[7].endswith("of 6") and int(c[8]) > 0


def test_a_size_that_is_not_whole_rows_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # With layers before each SEND a message is rows of a Linear(1024) output (4096 bytes each):
    # 1000 bytes would be measured as 4096 and reported as 1000.
    with pytest.raises(SystemExit) as exit_:
        send_cost.main(["--bytes", "1000", "--messages", "2", "--work", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--bytes 1000" in err and "multiple of 4096" in err
