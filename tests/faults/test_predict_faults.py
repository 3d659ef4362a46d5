"""predict never writes over what it reads: one test per way the output could meet the photos or
the true masks, and the order of reads and writes. docs/FAULTS.md lists the cases."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from support.cli import run_command
from support.faulty_writer import FailsAfter
from support.image_files import save_image
from support.inference import compose_cli, own_run
from support.processes import session_processes

import nailseg.inference.predict
import nailseg.inference.request
from nailseg.inference.predict import PredictError, run
from nailseg.io.atomic import temp_path
from nailseg.io.folder import JOURNAL, MARKER, Journal, is_live
from nailseg.model.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(trained_run, tmp_path_factory) -> Path:
    return own_run(trained_run, tmp_path_factory.mktemp("faults_predict") / "run")


@pytest.fixture
def data(tmp_path) -> Path:
    """photos/x.png, its true mask DATA/masks/x.png, and a link to DATA/masks."""
    save_image(tmp_path / "photos" / "x.png", np.full((20, 24, 3), 90, np.uint8))
    mask = np.zeros((20, 24), np.uint8)
    mask[5:10, 5:10] = 255
    save_image(tmp_path / "DATA" / "masks" / "x.png", mask)
    (tmp_path / "link").symlink_to(tmp_path / "DATA" / "masks")
    return tmp_path


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _predict(ckpt: Path, inputs: Path, output: Path, masks: Path | None = None):
    overrides = [f"ckpt={ckpt}", f"input={inputs}", f"output={output}", "num_workers=2"]
    overrides += [f"masks={masks}"] if masks else []
    return run(compose_cli("predict", overrides), console=Console(quiet=True))


def _cases(data: Path) -> dict[str, tuple[Path, Path, Path | None]]:
    """(input, output, masks) that overlap, by name."""
    photos, masks = data / "photos", data / "DATA" / "masks"
    return {
        # the output's masks/ folder is the true masks' folder: Dice 1.0 against itself
        "masks inside output": (photos, data / "DATA", masks),
        "output inside masks": (photos, masks / "pred", masks),
        "output inside input": (photos, photos / "pred", None),
        "input inside output": (photos, data, None),
        # the photo is where its own prediction would be written
        "file input inside output": (masks / "x.png", data / "DATA", None),
        "masks in another case": (photos, data / "data", masks),
        "output a link to the masks": (photos, data / "link", masks),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "masks inside output",
        "output inside masks",
        "output inside input",
        "input inside output",
        "file input inside output",
        "masks in another case",
        "output a link to the masks",
    ],
)
def test_output_overlapping_photos_or_masks_is_refused_before_any_write(case, ckpt, data):
    before = _files(data)
    inputs, output, masks = _cases(data)[case]
    with pytest.raises(PredictError, match=r"overlap \(one is, or is inside, the other\)"):
        _predict(ckpt, inputs, output, masks)
    assert _files(data) == before  # not a byte changed, nothing added


def _fill_the_disk_after(files: int, monkeypatch, fault: str = "disk_full") -> None:
    """predict's next run finds the disk full (or a worker killed: `fault`) once `files` of its
    PNGs are written."""
    monkeypatch.setattr(
        nailseg.inference.predict,
        "PhotoWriter",
        lambda output: FailsAfter(output, files=files, fault=fault),
    )


@pytest.mark.slow
def test_every_true_mask_is_read_before_the_first_write(ckpt, data, tmp_path, monkeypatch):
    for i in range(5):
        save_image(data / "photos" / f"p{i}.png", np.full((20, 24, 3), 30 * i, np.uint8))
        save_image(
            data / "DATA" / "masks" / f"p{i}.png", np.full((20, 24), 255 * (i % 2), np.uint8)
        )
    out = tmp_path / "out"
    written_before = []  # at each true mask's read: what was in the output folder already
    read = nailseg.inference.request.TrueMask.read
    monkeypatch.setattr(
        nailseg.inference.request.TrueMask,
        "read",
        classmethod(lambda cls, *a: written_before.append(list(out.rglob("*"))) or read(*a)),
    )
    summary = _predict(ckpt, data / "photos", out, data / "DATA" / "masks")
    assert summary.scores["overall"]["images"] == 6
    assert written_before == [[]] * 6  # the output files are written by other processes: the
    # folder, not a hook, says whether a write came first


@pytest.mark.slow
def test_a_folder_predict_did_not_make_is_refused_before_any_write(ckpt, data):
    output = data / "mine"
    (output / "masks").mkdir(parents=True)
    (output / "scores.csv").write_text("my own scores\n")
    (output / "masks" / "x.png").write_bytes(b"my own mask")
    before = _files(data)
    with pytest.raises(PredictError, match=r"is not a folder nailseg made \(it holds"):
        _predict(ckpt, data / "photos", output, data / "DATA" / "masks")
    assert _files(data) == before


def test_a_summary_json_holding_predicts_keys_but_not_its_marker_is_refused(
    ckpt, data, tmp_path, capsys
):
    """Ownership by identity, not by name or keys: a summary.json with every key predict writes
    (as an older predict's, or a user's copy of one) but not nailseg's marker is not predict's.
    Through the user's command."""
    output = tmp_path / "old"
    (output / "masks").mkdir(parents=True)
    (output / "masks" / "x.png").write_bytes(b"a mask of the user's where predict would write")
    summary = {"images": 1, "checkpoint": str(ckpt), "threshold": 0.5, "finished": True}
    (output / "summary.json").write_text(json.dumps(summary))
    before = _files(tmp_path)
    args = [f"ckpt={ckpt}", f"input={data / 'photos'}", f"output={output}", "device=cpu"]
    done = run_command(["-m", "nailseg", "predict", *args], capsys)
    assert done.returncode == 1
    assert f"output={output} is not a folder nailseg made (it holds" in done.stderr
    assert _files(tmp_path) == before


def test_a_users_own_summary_json_does_not_make_a_folder_predicts(ckpt, data, tmp_path):
    output = tmp_path / "mine"
    (output / "masks").mkdir(parents=True)
    (output / "masks" / "x.png").write_bytes(b"my own mask")
    (output / "summary.json").write_text(json.dumps({"checkpoint": "my notes"}))
    before = _files(tmp_path)
    with pytest.raises(PredictError, match=r"is not a folder nailseg made \(it holds"):
        _predict(ckpt, data / "photos", output)
    assert _files(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("linked", ["masks", "overlays", "masks/deeper"])
def test_a_link_inside_predicts_own_output_is_never_written_through(ckpt, data, tmp_path, linked):
    """A link under the output could lead the writes into the true masks or the photos: one on
    the way to an output is refused before any write, any other left alone."""
    output = tmp_path / "out"
    _predict(ckpt, data / "photos", output)  # predict's own folder
    link = output / linked
    if link.exists():
        for path in sorted(link.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        link.rmdir()
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(data / "DATA" / "masks")
    before = _files(data / "DATA")  # where the link leads
    if linked == "masks/deeper":
        assert _predict(ckpt, data / "photos", output, data / "DATA" / "masks").images == 1
    else:
        with pytest.raises(PredictError, match=rf"{link} is a symbolic link \(to "):
            _predict(ckpt, data / "photos", output, data / "DATA" / "masks")
    assert _files(data / "DATA") == before and link.is_symlink()


@pytest.mark.slow
def test_a_run_that_stops_part_way_leaves_no_earlier_scores_and_says_unfinished(
    ckpt, data, tmp_path, monkeypatch
):
    output = tmp_path / "out"
    for i in range(3):
        save_image(data / "photos" / f"p{i}.png", np.full((20, 24, 3), 40 * i, np.uint8))
    assert _predict(ckpt, data / "photos", output, data / "DATA" / "masks").images == 4
    assert (output / "scores.csv").exists()
    _fill_the_disk_after(2, monkeypatch)
    for old in (output / "masks").glob("*.png"):
        old.unlink()
    with pytest.raises(OSError, match="No space left"):
        _predict(ckpt, data / "photos", output, data / "DATA" / "masks")
    assert not (output / "scores.csv").exists()
    assert json.loads((output / "summary.json").read_text())["finished"] is False
    monkeypatch.undo()
    assert _predict(ckpt, data / "photos", output).images == 4  # its own folder: rerun
    assert json.loads((output / "summary.json").read_text())["finished"] is True


@pytest.mark.slow
def test_a_photo_whose_output_name_the_filesystem_refuses_is_skipped_and_named(
    ckpt, data, tmp_path
):
    """A name of 250 characters is a legal file name; its mask's temporary name is not."""
    long = data / "photos" / f"{'n' * 246}.png"
    save_image(long, np.full((20, 24, 3), 60, np.uint8))
    summary = _predict(ckpt, data / "photos", tmp_path / "out")
    assert summary.images == 1 and (tmp_path / "out" / "masks" / "x.png").exists()
    [skipped] = summary.skipped
    assert skipped.path == long and "cannot write" in skipped.reason
    assert "File name too long" in skipped.reason


@pytest.mark.slow
def test_a_photo_whose_mask_would_be_another_photos_folder_is_left_out_first(ckpt, data, tmp_path):
    """`q.jpg` beside a folder `q.png/`: the mask of one would be the folder of the other's."""
    save_image(data / "photos" / "q.png" / "y.png", np.full((20, 24, 3), 60, np.uint8))
    save_image(data / "photos" / "q.jpg", np.full((20, 24, 3), 90, np.uint8))
    summary = _predict(ckpt, data / "photos", tmp_path / "out")
    assert summary.images == 2 and (tmp_path / "out" / "masks" / "q.png" / "y.png").exists()
    [skipped] = summary.skipped
    assert skipped.path == data / "photos" / "q.jpg" and "would be the folder" in skipped.reason


@pytest.mark.slow
def test_photos_are_found_as_prepare_finds_them_links_followed_and_a_dead_link_named(
    ckpt, data, tmp_path
):
    """A linked folder's photos are predicted (prepare follows it too); a link to nothing is
    reported, not silently passed over."""
    elsewhere = tmp_path / "elsewhere"
    save_image(elsewhere / "y.png", np.full((20, 24, 3), 60, np.uint8))
    (data / "photos" / "linked").symlink_to(elsewhere)
    (data / "photos" / "gone.jpg").symlink_to(tmp_path / "nothing.jpg")
    summary = _predict(ckpt, data / "photos", tmp_path / "out")
    assert summary.images == 2 and (tmp_path / "out" / "masks" / "linked" / "y.png").is_file()
    [skipped] = summary.skipped
    assert skipped.path == data / "photos" / "gone.jpg" and "unreadable" in skipped.reason


def test_a_photo_whose_name_is_not_utf8_is_scored_and_its_name_escaped(ckpt, data, tmp_path):
    """Linux names may hold any bytes; Python keeps those that are not UTF-8 as surrogates, and
    writing scores.csv refused them, after every mask was written: every score was lost."""
    name = os.fsdecode(b"bad\xff")
    save_image(data / "photos" / f"{name}.png", np.full((20, 24, 3), 60, np.uint8))
    save_image(data / "DATA" / "masks" / f"{name}.png", np.zeros((20, 24), np.uint8))
    summary = _predict(ckpt, data / "photos", tmp_path / "out", data / "DATA" / "masks")
    assert summary.images == 2 and summary.scores["overall"]["images"] == 2
    assert (tmp_path / "out" / "masks" / f"{name}.png").is_file()
    table = (tmp_path / "out" / "scores.csv").read_text(encoding="utf-8")
    assert "bad\\udcff" in table  # as summary.json's JSON escapes it
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["finished"] is True


@pytest.mark.parametrize("threshold", [-1, 65535, 70000])
def test_a_mask_threshold_outside_the_mask_values_is_refused_before_any_write(
    threshold, ckpt, data, tmp_path
):
    """As prepare refuses it: below 0 every true pixel counted as nail, at the top none."""
    overrides = [f"ckpt={ckpt}", f"input={data / 'photos'}", f"output={tmp_path / 'out'}"]
    overrides += [f"masks={data / 'DATA' / 'masks'}", f"mask_threshold={threshold}"]
    with pytest.raises(PredictError, match=rf"mask_threshold={threshold} is outside 0\.\.65534"):
        run(compose_cli("predict", overrides), console=Console(quiet=True))
    assert not (tmp_path / "out").exists()


def _journaled(output: Path) -> list[str]:
    """The files the output folder's journal shows as nailseg's."""
    return sorted(Journal(output).files)


def _outputs(output: Path) -> list[str]:
    return sorted(p.relative_to(output).as_posix() for p in output.rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_rerun_leaves_only_its_own_outputs(ckpt, data, tmp_path):
    """A rerun with a photo removed and overlays=false: the removed photo's mask and every overlay
    of the run before stayed, beside a summary that did not count them. A user's own files in
    predict's folder, even one under masks/, stay."""
    output = tmp_path / "out"
    for name in ("a", "b"):
        save_image(data / "photos" / f"{name}.png", np.full((20, 24, 3), 70, np.uint8))
    _predict(ckpt, data / "photos", output)
    assert (output / "overlays" / "b.png").is_file() and (output / "masks" / "b.png").is_file()
    (output / "masks" / "mine.png").write_bytes(b"my own mask")
    (output / "notes.txt").write_text("mine")
    (data / "photos" / "b.png").unlink()
    overrides = [f"ckpt={ckpt}", f"input={data / 'photos'}", f"output={output}", "overlays=false"]
    assert run(compose_cli("predict", overrides), console=Console(quiet=True)).images == 2
    assert _outputs(output) == [
        JOURNAL, MARKER, "masks/a.png", "masks/mine.png", "masks/x.png", "notes.txt",
        "summary.json",
    ]  # fmt: skip
    assert _journaled(output) == ["masks/a.png", "masks/x.png", "summary.json"]


@pytest.mark.slow
@pytest.mark.parametrize("mine", ["masks/x.png", "overlays/x.png", "scores.csv"])
def test_a_users_file_where_a_rerun_would_write_is_refused_before_any_write(
    mine, ckpt, data, tmp_path
):
    """In predict's own folder, a file it did not write (by its journal) where this run would
    write: predict replaced it (and removed a user's scores.csv at every rerun)."""
    output = tmp_path / "out"
    _predict(ckpt, data / "photos", output)  # no masks=: no scores.csv of predict's
    (output / "masks" / "x.png").unlink()
    (output / "overlays" / "x.png").unlink()
    (output / mine).write_bytes(b"my own file")
    before = _files(output)
    with pytest.raises(PredictError, match=rf"{output / mine} lies where nailseg would write"):
        _predict(ckpt, data / "photos", output, data / "DATA" / "masks")
    assert _files(output) | {JOURNAL: b""} == before | {JOURNAL: b""}  # the journal: compacted
    assert not is_live(output)  # the refused run holds the folder no more


@pytest.mark.slow
def test_a_users_scores_csv_stays_through_a_run_that_writes_none(ckpt, data, tmp_path):
    output = tmp_path / "out"
    _predict(ckpt, data / "photos", output)
    (output / "scores.csv").write_text("my own scores\n")
    _predict(ckpt, data / "photos", output)
    assert (output / "scores.csv").read_text() == "my own scores\n"


@pytest.mark.slow
def test_a_run_stopped_part_way_leaves_every_output_journaled(ckpt, data, tmp_path, monkeypatch):
    """What a stopped run wrote is journaled as it is written, so the next run removes it."""
    output = tmp_path / "out"
    for i in range(3):
        save_image(data / "photos" / f"p{i}.png", np.full((20, 24, 3), 40 * i, np.uint8))
    _predict(ckpt, data / "photos", output)
    _fill_the_disk_after(3, monkeypatch)
    (data / "photos" / "p2.png").unlink()
    with pytest.raises(OSError, match="No space left"):
        _predict(ckpt, data / "photos", output)
    assert set(_outputs(output)) - {JOURNAL, MARKER} <= set(_journaled(output))
    assert not (output / "masks" / "p2.png").exists()  # the run before's: gone first
    monkeypatch.undo()
    _predict(ckpt, data / "photos", output)
    assert len(_outputs(output)) == 3 + 2 * 3  # the marker, the journal, summary.json; p0, p1, x


@pytest.mark.slow
def test_a_rerun_removes_the_temporary_files_a_killed_run_left_for_its_outputs_only(
    ckpt, data, tmp_path
):
    """`kill -9` between an atomic write's start and its rename leaves a hidden temporary file;
    the next run removes those of the outputs listed as predict's, and no other file, nor a
    folder so named (an atomic write makes none: before, the run crashed removing it)."""
    output = tmp_path / "out"
    _predict(ckpt, data / "photos", output)
    left = [temp_path(output / rel) for rel in ("masks/x.png", "overlays/x.png", "summary.json")]
    mine = [temp_path(output / rel) for rel in ("masks/mine.png", "notes.txt")]
    for path in left + mine:
        path.write_bytes(b"part of a file")
    folder = output / "masks" / ".x.png.7.tmp"  # a temporary name of a listed output's
    (folder / "inside").mkdir(parents=True)
    _predict(ckpt, data / "photos", output)
    assert [path.exists() for path in left + mine] == [False] * len(left) + [True] * len(mine)
    assert (folder / "inside").is_dir()


@pytest.mark.slow
def test_a_second_predict_into_a_folder_being_written_fails_at_once_and_writes_nothing(
    ckpt, data, tmp_path
):
    """Two runs into one folder interleaved their files, and the second removed what the first
    had written as an earlier run's outputs; the second now stops at the first's claim."""
    output = tmp_path / "out"
    hold = (
        "import sys, time; from nailseg.io.folder import OwnedFolder\n"
        "OwnedFolder.claim(sys.argv[1], 'predict'); print('held', flush=True); time.sleep(120)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(output)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        before = _files(output)
        with pytest.raises(PredictError, match=rf"another nailseg command is using {output}"):
            _predict(ckpt, data / "photos", output)
        assert _files(output) == before
    finally:
        holder.kill()
        holder.wait()
    assert _predict(ckpt, data / "photos", output).images == 1  # the lock died with its holder


@pytest.mark.slow
def test_a_forged_journal_never_leads_a_removal_outside_the_folder(ckpt, data, tmp_path):
    output = tmp_path / "out"
    _predict(ckpt, data / "photos", output)
    victim, notes = tmp_path / "victim.txt", output / "notes.txt"
    victim.write_text("keep")
    notes.write_text("keep")
    # each line with its file's own record, so only the path's check keeps it
    lines = [(victim, "../victim.txt"), (victim, str(victim)), (notes, "masks/../notes.txt")]
    with (output / JOURNAL).open("a") as journal:
        for path, rel in lines:
            st = path.stat()
            rec = [st.st_size, st.st_mtime_ns, st.st_ino]
            journal.write(json.dumps({"op": "add", "path": rel, "rec": rec}) + "\n")
    _predict(ckpt, data / "photos", output)
    assert victim.read_text() == notes.read_text() == "keep"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("num_workers=-1", r"num_workers=-1: must be at least 1"),
        ("num_workers=0", r"num_workers=0: must be at least 1"),
        ("image_size=[0,64]", r"image_size must be \[height, width\], both >= 1"),
        ("std=[0,1,1]", r"std=\[0.0, 1.0, 1.0\]: every value must be above 0"),
    ],
)
def test_a_bad_setting_is_refused_before_any_write(override, message, ckpt, data, tmp_path):
    """Each was taken, `summary.json` written, then the run failed (or with num_workers=0 ran
    on one thread per core, as null does; with std 0 it wrote masks of NaN)."""
    overrides = [f"ckpt={ckpt}", f"input={data / 'photos'}", f"output={tmp_path / 'out'}", override]
    with pytest.raises((PredictError, CheckpointError), match=message):
        run(compose_cli("predict", overrides), console=Console(quiet=True))
    assert not (tmp_path / "out").exists()


def _preloading(pid: int) -> bool:
    """Whether process `pid`, a forkserver, is still importing its preload: the server's own
    SIGCHLD handler, set once the preload is done, is not yet set (/proc's SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        masks = dict(line.split(":\t") for line in status)
    except (OSError, ValueError):  # gone meanwhile
        return False
    return not int(masks["SigCgt"], 16) & 1 << (signal.SIGCHLD - 1)


def _predict_in_a_session(ckpt: Path, photos: Path, out: Path) -> subprocess.Popen:
    """`python -m nailseg predict` on the CPU, one photo a batch, in a session (and process
    group) of its own, as a terminal's foreground job: a test can send it Ctrl-C."""
    args = [f"ckpt={ckpt}", f"input={photos}", f"output={out}", "num_workers=2"]
    return subprocess.Popen(
        [sys.executable, "-m", "nailseg", "predict", *args, "device=cpu", "batch_size=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _interrupted_alone(command: subprocess.Popen, out: Path) -> None:
    """After Ctrl-C: predict stopped with its own KeyboardInterrupt only, leaving no temporary
    file, no process, and a summary that says unfinished."""
    _, stderr = command.communicate(timeout=120)
    assert command.returncode != 0, "the run ended before it could be interrupted"
    assert stderr.count("Traceback") == 1 and "KeyboardInterrupt" in stderr, stderr
    assert "ForkServerProcess" not in stderr, stderr
    assert json.loads((out / "summary.json").read_text())["finished"] is False
    assert not list(out.rglob("*.tmp"))
    deadline = time.monotonic() + 10
    while session_processes(command.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_processes(command.pid) == {}


@pytest.mark.slow
def test_ctrl_c_stops_predict_without_the_workers_tracebacks_or_leftovers(ckpt, tmp_path):
    """Ctrl-C, sent to the command's process group as a terminal sends it, part-way through a
    run: predict stops with its own KeyboardInterrupt only (its worker processes leave the
    interrupt to it and are shut down; before, each idle worker printed a traceback of its own),
    leaves no temporary file and no process behind, and its summary says unfinished."""
    for i in range(1500):
        save_image(tmp_path / "photos" / f"p{i:04d}.png", np.full((20, 24, 3), i % 256, np.uint8))
    out = tmp_path / "out"
    command = _predict_in_a_session(ckpt, tmp_path / "photos", out)
    while command.poll() is None and len(list(out.glob("masks/*.png"))) < 10:
        time.sleep(0.01)
    os.killpg(command.pid, signal.SIGINT)
    _interrupted_alone(command, out)


@pytest.mark.slow
def test_ctrl_c_while_the_workers_start_leaves_the_interrupt_to_predict(ckpt, data, tmp_path):
    """Ctrl-C while multiprocessing's forkserver, the workers' parent, imports its preload: the
    server ignores Ctrl-C only once that is done, so before, it died printing a traceback of its
    own beside the command's."""
    out = tmp_path / "out"
    command = _predict_in_a_session(ckpt, data / "photos", out)
    importing = False
    while command.poll() is None and not importing:
        servers = [pid for pid, line in session_processes(command.pid).items() if "forkserver" in line]  # fmt: skip
        importing = any(_preloading(pid) for pid in servers)
    assert importing, "predict ended before its forkserver was seen importing its preload"
    os.killpg(command.pid, signal.SIGINT)
    _interrupted_alone(command, out)


@pytest.mark.slow
def test_a_worker_killed_part_way_stops_the_run_with_one_line_naming_it(
    ckpt, data, tmp_path, monkeypatch
):
    """A worker process killed mid-run (the kernel's out-of-memory killer, say): predict stops with
    a PredictError saying so (before, concurrent.futures' BrokenProcessPool and a traceback), its
    summary unfinished; a rerun into the same folder completes."""
    output = tmp_path / "out"
    for i in range(3):
        save_image(data / "photos" / f"p{i}.png", np.full((20, 24, 3), 40 * i, np.uint8))
    _fill_the_disk_after(2, monkeypatch, fault="killed")
    with pytest.raises(PredictError, match=r"a worker process .* died"):
        _predict(ckpt, data / "photos", output)
    assert json.loads((output / "summary.json").read_text())["finished"] is False
    monkeypatch.undo()
    assert _predict(ckpt, data / "photos", output).images == 4


@pytest.mark.slow
def test_export_never_replaces_a_link_where_its_model_would_go(ckpt, tmp_path, capsys):
    """A link at `output` to a model exported earlier (the user's own copy, kept elsewhere):
    before, export replaced the link with a new file; now it is refused, named, both kept."""
    theirs = tmp_path / "kept" / "model.onnx"
    args = ["-m", "nailseg", "export", f"ckpt={ckpt}"]
    assert run_command([*args, f"output={theirs}"], capsys).returncode == 0
    kept = theirs.read_bytes()
    link = tmp_path / "model.onnx"
    link.symlink_to(theirs)
    done = run_command([*args, f"output={link}"], capsys)
    assert done.returncode == 1
    assert f"output={link}: {link} is a symbolic link (to {theirs})" in done.stderr
    assert link.is_symlink() and theirs.read_bytes() == kept


def test_make_clean_keeps_a_users_copy_of_a_predict_folder(ckpt, data, tmp_path):
    """A `cp -a` copy of predict's folder (a backup) is the user's: `make clean` removed its
    masks, overlays and summary, their listing and stamps copied with them."""
    project = tmp_path / "project"
    output, copy = project / "outputs" / "predict", project / "outputs" / "backup"
    _predict(ckpt, data / "photos", output)
    subprocess.run(["cp", "-a", str(output), str(copy)], check=True)
    kept = _files(copy)
    shutil.copy(ROOT / "Makefile", project / "Makefile")
    done = subprocess.run(
        ["make", "clean", f"PY={sys.executable}"],
        cwd=project,
        check=True,
        capture_output=True,
        text=True,
    )
    assert _files(copy) == kept and not output.exists()
    assert "kept outputs/backup: a copy of a nailseg folder" in done.stdout


def test_masks_set_to_the_photo_folder_is_refused_in_one_line(ckpt, data, tmp_path, capsys):
    """Each photo was scored against itself as its own true mask."""
    photos = data / "photos"
    args = [f"ckpt={ckpt}", f"input={photos}", f"output={tmp_path / 'out'}", f"masks={photos}"]
    done = run_command(["-m", "nailseg", "predict", *args, "device=cpu"], capsys)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert f"masks={photos} and input={photos} overlap" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("line_break", ["\n", "\r", "\u2028"])
def test_a_photo_named_with_a_line_break_never_makes_a_users_file_predicts(
    line_break, ckpt, data, tmp_path
):
    """predict listed its outputs a line each (outputs.txt, each with its stamp): a photo in a
    folder named `q<line break><stamp><tab>masks` listed a user's `masks/mine.png`, with its own
    stamp, as predict's, and the next run removed it. A line break that `nailseg.io.folder` never
    writes in a name leaves the photo out, named; any other is written and journaled."""
    output = tmp_path / "out"
    _predict(ckpt, data / "photos", output)
    mine = output / "masks" / "mine.png"
    mine.write_bytes(b"my own mask")
    forged = data / "photos" / f"q{line_break}{mine.stat().st_mtime_ns}\tmasks" / "mine.png"
    save_image(forged, np.full((20, 24, 3), 60, np.uint8))
    summary = _predict(ckpt, data / "photos", output)
    _predict(ckpt, data / "photos", output)
    assert mine.read_bytes() == b"my own mask"
    if line_break == "\u2028":
        assert summary.images == 2 and not summary.skipped
    else:
        [skipped] = summary.skipped
        assert skipped.path == forged and "line break" in skipped.reason


@pytest.mark.slow
@pytest.mark.parametrize("name", ["outputs.txt", "summary.json", "masks/x.png", JOURNAL])
def test_a_fifo_in_predicts_own_folder_is_never_waited_on(name, ckpt, data, tmp_path, capsys):
    """predict read its listing, `outputs.txt`, whatever it was: a FIFO there hung it. A FIFO
    where predict writes, or at the journal it reads, is refused in one line; any other is
    left alone. (A hang here ends at the alarm, not in a stuck test.)"""
    output = tmp_path / "out"
    _predict(ckpt, data / "photos", output)
    if (output / name).exists():
        (output / name).unlink()
    os.mkfifo(output / name)
    args = [f"ckpt={ckpt}", f"input={data / 'photos'}", f"output={output}", "device=cpu"]

    def hung(*_):  # a BaseException: no handler of predict's takes it for an I/O error
        raise KeyboardInterrupt(f"predict waited on the FIFO at {name}")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        done = run_command(["-m", "nailseg", "predict", *args], capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert (output / name).is_fifo() and "Traceback" not in done.stderr
    if name == "outputs.txt":
        assert done.returncode == 0
    else:
        assert done.returncode == 1 and done.stderr.count("\n") == 1
        assert f"{output / name} " in done.stderr


@pytest.mark.slow
def test_damaged_files_are_one_line_naming_them(ckpt, data, tmp_path, capsys):
    """A photo that is not an image is skipped, named; a truncated checkpoint is refused by
    predict and export in one line naming it."""
    (data / "photos" / "x.png").write_bytes(b"not an image")
    args = [f"input={data / 'photos'}", f"output={tmp_path / 'out'}", "device=cpu"]
    done = run_command(["-m", "nailseg", "predict", f"ckpt={ckpt}", *args], capsys)
    assert f"skipped {data / 'photos' / 'x.png'}: unreadable" in done.stdout
    assert done.stderr == "predict failed: none of the 1 input files could be read\n"
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(ckpt.read_bytes()[:100_000])
    for command in (["predict", *args], ["export"]):
        done = run_command(["-m", "nailseg", *command, f"ckpt={truncated}"], capsys)
        assert done.returncode == 1 and done.stderr.count("\n") == 1
        assert f"ckpt={truncated} is not a checkpoint" in done.stderr
