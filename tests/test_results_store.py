"""The results store under damage: torn rows, foreign column orders, concurrent writers, no disk."""

import fcntl
import os
import tempfile
import threading
import time

import pandas as pd
import pytest

from cs336_systems.measure.results import (
    COLUMNS,
    ResultsNotWritable,
    TornRowWarning,
    append_rows,
    check_writable,
    load_results,
    make_row,
)


def _rows(n, start=0, **kw):
    return [
        make_row(problem="demo", name=f"r{i}", metric="forward_time", unit="ms", samples=[i, i + 1.0],
                 x_name="context_length", x_value=i, config={"i": i, "text": "a, \"quoted\" b"}, **kw)
        for i in range(start, start + n)
    ]  # fmt: skip


@pytest.mark.parametrize("cut", ["inside_a_quoted_field", "at_a_field_boundary", "inside_the_last_field"])
def test_a_torn_last_row_is_skipped_and_reported_never_fatal(tmp_path, cut):
    """Item 1: a run killed mid-row leaves a partial last line; every earlier row must still load."""
    path = append_rows("demo", _rows(3), tmp_path)
    full = path.read_text().splitlines()[-1]
    at = {
        "inside_a_quoted_field": full.index('"{') + 5,  # config_json: an unclosed quote
        "at_a_field_boundary": full.index(",cpu"),  # too few fields
        "inside_the_last_field": len(full) - 4,  # the right number of fields, a truncated timestamp
    }[cut]
    with open(path, "a") as f:
        f.write(full[:at])  # no newline: the writer died here
    with pytest.warns(TornRowWarning, match="line"):
        df = load_results("demo", tmp_path)
    assert list(df["name"]) == ["r0", "r1", "r2"] and df.attrs["torn_lines"] == [5]
    assert list(df["x_value"]) == [0, 1, 2]

    # The next append sets the fragment aside (nothing lost) and the file is whole again.
    append_rows("demo", _rows(1, start=3), tmp_path)
    assert (tmp_path / "demo.csv.torn").read_text() == full[:at] + "\n"
    df = load_results("demo", tmp_path)
    assert list(df["name"]) == ["r0", "r1", "r2", "r3"] and df.attrs["torn_lines"] == []


def test_a_torn_row_inside_the_file_is_skipped(tmp_path):
    path = append_rows("demo", _rows(2), tmp_path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1], lines[2][:40], lines[2]]) + "\n")
    with pytest.warns(TornRowWarning):
        df = load_results("demo", tmp_path)
    assert list(df["name"]) == ["r0", "r1"] and df.attrs["torn_lines"] == [3]


def test_newlines_inside_values_keep_one_row_per_line(tmp_path):
    path = append_rows(
        "demo", [make_row(problem="demo", metric="m", unit="ms", note="line 1\nline 2")], tmp_path
    )
    assert len(path.read_text().splitlines()) == 2
    assert load_results("demo", tmp_path)["note"].item() == "line 1\\nline 2"


def test_appends_align_by_column_name_never_by_position(tmp_path):
    """Item 2: a file whose header has another order keeps it, and every value lands under its name."""
    path = tmp_path / "demo.csv"
    first = pd.DataFrame(_rows(1)).reindex(columns=COLUMNS[::-1])
    first.to_csv(path, index=False)
    append_rows("demo", _rows(2, start=1), tmp_path)
    assert path.read_text().splitlines()[0].split(",") == COLUMNS[::-1]
    df = load_results("demo", tmp_path)
    assert list(df.columns[: len(COLUMNS)]) == COLUMNS
    assert list(df["name"]) == ["r0", "r1", "r2"] and list(df["x_value"]) == [0, 1, 2]
    assert list(df["unit"]) == ["ms"] * 3 and list(df["mean"]) == [0.5, 1.5, 2.5]


def test_a_file_missing_a_schema_column_is_widened_not_shifted(tmp_path):
    path = tmp_path / "demo.csv"
    old = [c for c in COLUMNS if c != "num_gpus"]
    pd.DataFrame(_rows(1)).reindex(columns=old).to_csv(path, index=False)
    append_rows("demo", _rows(1, start=1), tmp_path)
    assert path.read_text().splitlines()[0].split(",") == [*old, "num_gpus"]
    df = load_results("demo", tmp_path)
    assert pd.isna(df["num_gpus"].iloc[0]) and df["num_gpus"].iloc[1] == 0
    assert list(df["timestamp"].str.len() > 10) == [True, True] and list(df["x_value"]) == [0, 1]


def test_concurrent_first_appends_write_one_header(tmp_path):
    """Item 3: writers racing on a new file: one header, every row whole and present."""
    writers, files = 8, 12
    barrier = threading.Barrier(writers)
    errors = []

    def write(k):
        try:
            for f in range(files):
                barrier.wait()
                append_rows(f"race{f}", _rows(3, start=10 * k), tmp_path)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for f in range(files):
        text = (tmp_path / f"race{f}.csv").read_text()
        assert text.count("problem,name,") == 1
        assert len(load_results(f"race{f}", tmp_path)) == 3 * writers


def test_an_append_waits_for_the_writer_holding_the_file(tmp_path):
    path = append_rows("demo", _rows(1), tmp_path)
    done = threading.Event()
    with open(path, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t = threading.Thread(target=lambda: (append_rows("demo", _rows(1, start=1), tmp_path), done.set()))
        t.start()
        time.sleep(0.3)
        assert not done.is_set()  # blocked on the lock
    t.join(timeout=10)
    assert done.is_set() and len(load_results("demo", tmp_path)) == 2


def test_an_unwritable_results_dir_fails_before_work_and_rows_are_rescued(tmp_path, monkeypatch, capsys):
    """Item 4: `check_writable` fails up front; rows that cannot be written are kept and located."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the results directory should be")
    bad = blocker / "results"  # unwritable even for root
    with pytest.raises(ResultsNotWritable, match=str(bad)):
        check_writable(bad)
    assert check_writable(tmp_path / "fine") == tmp_path / "fine"

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tempfile.tempdir)
    rescued = append_rows("demo", _rows(2), bad)
    assert rescued.is_relative_to(tmp_path / "tmp") and rescued.exists()
    assert str(rescued) in capsys.readouterr().err
    assert list(pd.read_csv(rescued)["name"]) == ["r0", "r1"]


def test_text_columns_stay_text_whatever_they_look_like(tmp_path):
    """A commit like 5498e64123 read back as the float inf, a Triton version 3.6 as a number."""
    row = make_row(problem="demo", metric="m", unit="ms", value=1.0)
    row.update(git_sha="5498e64123", triton_version="3.6", torch_version="2.11")
    append_rows("demo", [row], tmp_path)
    got = load_results("demo", tmp_path).iloc[0]
    assert (got["git_sha"], got["triton_version"], got["torch_version"]) == ("5498e64123", "3.6", "2.11")
