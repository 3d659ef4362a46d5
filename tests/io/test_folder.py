"""The one ownership mechanism: claim, write, reserve, remove, clean, as a user's files meet them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nailseg.io.atomic import NotOursError
from nailseg.io.clean import clean
from nailseg.io.folder import (
    JOURNAL,
    MARKER,
    BusyError,
    ForeignFolderError,
    OwnedFolder,
    is_live,
    lock_shared,
    read_regular,
)
from nailseg.io.loose import check_loose, write_loose


def _claim(path: Path, kind: str = "run") -> OwnedFolder:
    folder = OwnedFolder.claim(path, kind)
    return folder


def test_a_new_folder_is_marked_and_reopened_as_the_same(tmp_path: Path) -> None:
    folder = _claim(tmp_path / "out")
    folder.write("a/b.txt", b"x")
    ident = folder.id
    folder.release()
    again = _claim(tmp_path / "out")
    assert again.id == ident and again.owns("a/b.txt")
    again.release()


def test_a_users_folder_is_refused_naming_a_file(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFolderError, match=r"notes\.txt"):
        _claim(tmp_path / "mine")
    assert not (tmp_path / "mine" / MARKER).exists()


def test_another_kind_is_refused(tmp_path: Path) -> None:
    _claim(tmp_path / "out", "predict").release()
    with pytest.raises(ForeignFolderError, match="predict folder"):
        _claim(tmp_path / "out", "run")


def test_a_copy_is_not_the_original(tmp_path: Path) -> None:
    folder = _claim(tmp_path / "out")
    folder.write("last.ckpt", b"weights")
    folder.release()
    shutil.copytree(tmp_path / "out", tmp_path / "backup", copy_function=shutil.copy2)
    with pytest.raises(ForeignFolderError, match="copy"):
        _claim(tmp_path / "backup")
    cleaned = clean(tmp_path / "backup")
    assert (tmp_path / "backup" / "last.ckpt").read_bytes() == b"weights"
    assert (tmp_path / "backup" / MARKER).exists() and "copy" in cleaned.skipped[
        tmp_path / "backup"
    ]


def test_a_write_killed_right_after_its_rename_is_still_nailsegs(tmp_path: Path) -> None:
    script = (
        "import os, signal, sys; real = os.replace\n"
        "def die(src, dst):\n"
        "    real(src, dst)\n"
        "    if str(dst).endswith('a.npy'): os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.replace = die\n"
        "from nailseg.io.folder import OwnedFolder\n"
        "OwnedFolder.claim(sys.argv[1], 'run').write('a.npy', b'half a run')\n"
    )
    killed = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out")])
    assert killed.returncode == -9 and (tmp_path / "out" / "a.npy").exists()
    folder = _claim(tmp_path / "out")
    assert folder.owns("a.npy")
    folder.release()


def test_a_killed_writes_temporary_file_goes_once_its_path_is_written(tmp_path: Path) -> None:
    folder = _claim(tmp_path / "out")
    left = tmp_path / "out" / "g" / ".a.npy.999999.tmp"  # a write killed before its rename
    left.parent.mkdir()
    left.write_bytes(b"half")
    folder.write("g/a.npy", b"whole")
    folder.release()
    assert not left.exists() and (tmp_path / "out" / "g" / "a.npy").read_bytes() == b"whole"


def test_a_users_file_in_the_way_is_neither_replaced_nor_removed(tmp_path: Path) -> None:
    folder = _claim(tmp_path / "out")
    folder.write("scores.csv", b"ours")
    (tmp_path / "out" / "scores.csv").write_text("edited by the user")
    (tmp_path / "out" / "note.txt").write_text("mine")
    with pytest.raises(NotOursError, match=r"scores\.csv"):
        folder.write("scores.csv", b"again")
    assert folder.write("scores.csv", b"again", strict=False) is None
    assert not folder.remove("note.txt")
    folder.release()
    clean(tmp_path / "out")
    assert (tmp_path / "out" / "scores.csv").read_text() == "edited by the user"
    assert (tmp_path / "out" / "note.txt").read_text() == "mine"


def test_no_write_through_a_link(tmp_path: Path) -> None:
    folder = _claim(tmp_path / "out")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out" / "csv").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NotOursError, match="symbolic link"):
        folder.write("csv/metrics.csv", b"x")
    with pytest.raises(NotOursError, match="symbolic link"):
        folder.reserve("csv")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_reserved_path_holds_what_a_library_wrote_there(tmp_path: Path) -> None:
    folder = _claim(tmp_path / "out")
    folder.reserve("wandb", lasting=True)  # as W&B's: its service writes on after the release
    (tmp_path / "out" / "wandb" / "run-1").mkdir(parents=True)
    (tmp_path / "out" / "wandb" / "run-1" / "log.bin").write_bytes(b"x")
    (tmp_path / "out" / "wandb" / "latest-run").symlink_to("run-1")  # W&B's links go too
    (tmp_path / "out" / "note.txt").write_text("mine, moved in meanwhile")
    (tmp_path / "out" / "my-link").symlink_to("note.txt")  # a user's link, outside the reservation
    folder.release()
    clean(tmp_path / "out")
    assert not (tmp_path / "out" / "wandb").exists()
    assert (tmp_path / "out" / "note.txt").exists() and (tmp_path / "out" / "my-link").is_symlink()


def test_a_users_file_put_into_a_library_folder_later_is_refused_and_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    folder = _claim(out)
    folder.reserve("csv")
    (out / "csv").mkdir()
    (out / "csv" / "metrics.csv").write_text("step\n0\n")  # the library's
    folder.release()  # its files are journaled one by one; the reservation ends
    (out / "csv" / "mine.csv").write_text("the user's")
    folder = _claim(out)
    assert folder.owns("csv/metrics.csv") and not folder.owns("csv/mine.csv")
    with pytest.raises(NotOursError, match=r"csv/mine.csv lies where nailseg would write"):
        folder.reserve("csv")
    (out / "csv" / "mine.csv").unlink()
    folder.reserve("csv")  # the library's own files again: free to write
    folder.release()
    clean(out)
    assert not out.exists()


def test_what_a_killed_writers_library_left_is_adopted_at_the_next_claim(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = (
        "import os; from nailseg.io.folder import OwnedFolder;"
        f"f = OwnedFolder.claim({str(out)!r}, 'run'); f.reserve('tb');"
        f"os.makedirs({str(out / 'tb')!r}); open({str(out / 'tb' / 'events')!r}, 'w').write('x');"
        "os._exit(9)"  # no release: as after kill -9
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    folder = _claim(out)
    assert folder.owns("tb/events") and not folder.journal.reserved
    (out / "tb" / "mine.txt").write_text("the user's")
    assert not folder.owns("tb/mine.txt")
    folder.release()
    clean(out)
    assert [p.name for p in out.rglob("*") if p.is_file()] == ["mine.txt"]


def test_names_with_line_separators_cannot_forge_the_journal(tmp_path: Path) -> None:
    folder = _claim(tmp_path / "out")
    (tmp_path / "out" / "user.txt").write_text("mine")
    forged = 'x\n{"op": "reserve", "path": "user.txt"}'
    with pytest.raises(NotOursError):
        folder.write(forged, b"x")
    folder.write("ok.txt", b"x")
    folder.release()
    clean(tmp_path / "out")
    assert (tmp_path / "out" / "user.txt").exists()
    assert not (tmp_path / "out" / "ok.txt").exists()


def test_a_hard_linked_snapshot_keeps_its_contents_on_append(tmp_path: Path) -> None:
    folder = _claim(tmp_path / "out")
    fd = folder.open_append("train.log")
    os.write(fd, b"first\n")
    os.close(fd)
    os.link(tmp_path / "out" / "train.log", tmp_path / "snapshot.log")
    fd = folder.open_append("train.log")
    os.write(fd, b"second\n")
    os.close(fd)
    assert (tmp_path / "snapshot.log").read_bytes() == b"first\n"
    assert (tmp_path / "out" / "train.log").read_bytes() == b"first\nsecond\n"


_HOLD = """
import sys, time
from nailseg.io.folder import OwnedFolder, lock_shared
if sys.argv[2] == "shared":
    held = lock_shared(sys.argv[1], "dataset.root")
else:
    OwnedFolder.claim(sys.argv[1], "run").write("best.ckpt", b"x")
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["exclusive", "shared"])
def test_a_live_folder_is_neither_cleaned_nor_claimed(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "out"
    if mode == "shared":
        _claim(out).release()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out), mode], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        cleaned = clean(out)
        assert "in use" in cleaned.skipped[out] and (out / MARKER).exists()
        with pytest.raises(BusyError, match="another nailseg command"):
            OwnedFolder.claim(out, "run")
    finally:
        holder.kill()
        holder.wait()
    start = time.monotonic()
    clean(out)
    assert not out.exists() and time.monotonic() - start < 5


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / JOURNAL)
    with pytest.raises(NotOursError, match="not a plain file"):
        read_regular(tmp_path / JOURNAL)


def test_prune_sees_what_a_worker_process_wrote(tmp_path: Path) -> None:
    folder = _claim(tmp_path / "out")
    worker = "from nailseg.io.folder import OwnedFolder as F; F.attach(__import__('sys').argv[1]).write('masks/a.png', b'x')"
    subprocess.run([sys.executable, "-c", worker, str(tmp_path / "out")], check=True)
    folder.prune(keep=[])
    assert not (tmp_path / "out" / "masks").exists()


def test_a_readers_lock_is_shared_by_readers_and_refuses_writers(tmp_path: Path) -> None:
    """`lock_shared`: a prepared root a training reads, marker or none, stays as it is."""
    root = tmp_path / "prepared"
    root.mkdir()
    (root / "train.csv").write_text("the user's")
    readers = [lock_shared(root, "dataset.root") for _ in range(2)]
    assert is_live(root)
    with pytest.raises(BusyError, match="another nailseg command is using"):
        OwnedFolder.claim(root, "prepare")
    for fd in readers:
        os.close(fd)
    assert not is_live(root) and sorted(os.listdir(root)) == ["train.csv"]


def test_a_loose_file_is_replaced_only_while_as_written(tmp_path):
    """export's model, in a folder no command claims: journaled beside it."""
    path = tmp_path / "deploy" / "model.onnx"
    write_loose(path, b"one")
    write_loose(path, b"two")
    assert path.read_bytes() == b"two"
    path.write_bytes(b"edited")
    with pytest.raises(NotOursError, match="nailseg did not write it"):
        write_loose(path, b"three")
    assert path.read_bytes() == b"edited"


def test_a_loose_file_is_never_written_into_a_claimed_folder(tmp_path):
    OwnedFolder.claim(tmp_path / "out", "predict").release()
    with pytest.raises(NotOursError, match="is a nailseg predict folder"):
        check_loose(tmp_path / "out" / "model.onnx")


def test_a_journal_of_many_reruns_is_rewritten_to_what_holds(tmp_path: Path) -> None:
    for _ in range(40):
        folder = _claim(tmp_path / "out")
        for name in ("a", "b"):
            folder.write(name, b"x")
        folder.release()
    assert len((tmp_path / "out" / JOURNAL).read_text().splitlines()) <= 2 * 2 + 64 + 2
