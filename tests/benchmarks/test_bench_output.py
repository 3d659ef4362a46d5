"""The benchmarks write only into a folder of their own (an `OwnedFolder` of kind `bench`): a
user's folder is refused in one line and left as it was; in its own folder a benchmark replaces
only the files it wrote, and `make clean` removes those and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cli import run_command
from support.inference import compose_cli

from benchmarks import output, predict, prepare, scale, zoomed
from nailseg import bench
from nailseg.io.atomic import NotOursError
from nailseg.io.clean import clean
from nailseg.io.folder import OwnedFolder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("module", "command", "config", "given", "outputs"),
    [
        (bench, "nailseg bench", "bench", [], bench.OUTPUTS),
        (prepare, "benchmarks.prepare", "bench_prepare", [], prepare.OUTPUTS),
        (predict, "benchmarks.predict", "bench_predict", ["ckpt=x.ckpt"], predict.OUTPUTS),
        (scale, "benchmarks.scale", "bench_scale", [], scale.OUTPUTS),
        (zoomed, "benchmarks.zoomed", "bench_zoomed", ["ckpt=x.ckpt"], zoomed.OUTPUTS),
    ],
)
def test_each_bench_refuses_a_users_folder_in_one_line_and_leaves_it(
    module, command, config, given, outputs, tmp_path
):
    """Before, the benches wrote their csv, png and Hydra's folder into any output_dir, replacing
    a user's `bench.csv` there."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    (mine / outputs[0]).write_text("the user's table")
    before = _files(mine)
    cfg = compose_cli(config, [*given, f"output_dir={mine}"])
    with pytest.raises(SystemExit) as exit_:
        module.main(cfg)
    message = str(exit_.value.code)
    assert message.startswith(f"{command}: output_dir={mine} is not a folder nailseg made")
    assert "\n" not in message and str(mine / outputs[0]) in message
    assert _files(mine) == before


def test_a_users_file_where_an_output_goes_is_refused_and_kept(tmp_path):
    out = tmp_path / "bench"
    OwnedFolder.claim(out, "bench").release()  # an earlier run's folder
    (out / "bench_prepare.csv").write_text("the user's")
    cfg = compose_cli("bench_prepare", [f"output_dir={out}"])
    with pytest.raises(SystemExit) as exit_:
        prepare.main(cfg)
    assert f"{out / 'bench_prepare.csv'} lies where nailseg would write" in str(exit_.value.code)
    assert (out / "bench_prepare.csv").read_text() == "the user's"


def test_an_output_dir_inside_the_photos_is_refused_before_anything_is_written(tmp_path, capsys):
    """#45: bench-prepare wrote its marker into the photo tree before refusing the overlap."""
    photos = tmp_path / "photos"
    (photos / "Images").mkdir(parents=True)
    (photos / "Images" / "a.jpg").write_bytes(b"a photo")
    before = sorted(tmp_path.rglob("*"))
    out = photos / "bench"
    argv = ["-m", "benchmarks.prepare", f"input_dir={photos}", f"output_dir={out}"]
    proc = run_command(argv, capsys)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        f"benchmarks.prepare: output_dir={out} and input_dir={photos} overlap (one is, or is "
        "inside, the other): nothing was written; choose an output folder apart from the photos\n"
    )
    assert sorted(tmp_path.rglob("*")) == before


def test_outputs_are_replaced_and_make_clean_removes_them_alone(tmp_path):
    out = tmp_path / "outputs" / "bench" / "loaders"
    with OwnedFolder.claim(out, "bench") as folder:
        folder.write("bench.csv", b"first")
    with OwnedFolder.claim(out, "bench") as folder:
        folder.check_free(["bench.csv"])  # a rerun: its own file, unchanged since
        folder.write("bench.csv", b"second")
    (out / "notes.txt").write_text("the user's")
    clean(tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_users_files_at_the_scratch_name_are_refused_never_removed(tmp_path: Path) -> None:
    """The scratch folder is emptied before use only while it is the benchmark's own: a user's
    folder of that name in the benchmark's folder is refused, naming it, and stays whole."""
    folder = OwnedFolder.claim(tmp_path / "bench", "bench")
    mine = tmp_path / "bench" / output.SCRATCH / "mine.txt"
    mine.parent.mkdir()
    mine.write_text("the user's")
    with pytest.raises(NotOursError, match=output.SCRATCH), output.scratch(folder):
        pass
    folder.release()
    assert mine.read_text() == "the user's"
