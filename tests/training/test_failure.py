"""A sweep job's failure record: only nailseg's own `failed.json` is read as one or removed."""

from __future__ import annotations

import json

from nailseg.training.failure import FAILED, clear_failure, read_failure, write_failure


def _record(run_dir) -> None:
    try:
        raise ValueError("bad value")
    except ValueError as err:
        write_failure(run_dir, err)


def test_a_recorded_failure_is_read_then_cleared(tmp_path):
    _record(tmp_path / "job")
    assert read_failure(tmp_path / "job") == "ValueError: bad value"
    assert "raise ValueError" in json.loads((tmp_path / "job" / FAILED).read_text())["traceback"]
    clear_failure(tmp_path / "job")
    assert not (tmp_path / "job" / FAILED).exists() and read_failure(tmp_path / "job") is None


def test_a_users_own_failed_json_is_neither_read_nor_removed(tmp_path):
    mine = {
        "a": '{"error": "my note", "photos": ["x.png"]}',  # another key beside `error`
        "b": "[1, 2]",
        "c": "not json",
    }
    for name, text in mine.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / FAILED).write_text(text)
        assert read_failure(tmp_path / name) is None
        clear_failure(tmp_path / name)
        assert (tmp_path / name / FAILED).read_text() == text
