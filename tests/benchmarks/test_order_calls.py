import pytest

from benchmarks import order_calls


def test_the_table_counts_calls_of_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert order_calls.main(["--microbatches", "2,4", "--rounds", "1", "--seconds", "0.01"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == "| m | order calls / s | simulate calls / s |"
    assert [row.split("|")[1].strip() for row in rows[2:]] == ["2", "4"]
    assert all(float(v) > 0 for row in rows[2:] for v in row.split("|")[2:4])
