"""A sweep job's failure is kept in its folder's marker: nothing else is read as one (a user's
`failed.json` is only a file of theirs)."""

from __future__ import annotations

from nailseg.training.run_folder import read_failure, record_failure, release


def test_a_recorded_failure_is_read_from_the_folders_marker(tmp_path):
    record_failure(tmp_path / "job", ValueError("bad value"))
    release(tmp_path / "job")
    assert read_failure(tmp_path / "job") == "ValueError: bad value"


def test_a_users_failed_json_is_not_read_as_a_failure(tmp_path):
    (tmp_path / "failed.json").write_text('{"error": "my note", "traceback": ""}')
    assert read_failure(tmp_path) is None
    record_failure(tmp_path, RuntimeError("the job failed"))  # not nailseg's folder: refused
    assert read_failure(tmp_path) is None
    assert (tmp_path / "failed.json").read_text() == '{"error": "my note", "traceback": ""}'
