"""The benchmarks write only into a folder of their own (`nailseg.tools.output`): a user's folder
is refused in one line and left as it was; in its own folder a benchmark replaces only the files
it recorded, and `make clean` removes those and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.inference import compose_cli

from nailseg.io.atomic import NotOursError, write_text
from nailseg.io.clean import clean
from nailseg.io.folder import MARKER as RUN_MARKER
from nailseg.io.ownership import ForeignFolderError
from nailseg.tools import bench, bench_predict, bench_prepare, bench_scale
from nailseg.tools.output import claim_output, record_outputs


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(
    ("module", "command", "config", "given"),
    [
        (bench, "bench", "bench", []),
        (bench_prepare, "bench-prepare", "bench_prepare", []),
        (bench_predict, "bench-predict", "bench_predict", ["ckpt=x.ckpt"]),
        (bench_scale, "bench-scale", "bench_scale", []),
    ],
)
def test_each_bench_refuses_a_users_folder_in_one_line_and_leaves_it(
    module, command, config, given, tmp_path
):
    """Before, the benches wrote their csv, png and Hydra's folder into any output_dir, replacing
    a user's `bench.csv` there."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    output_file = mine / module.OUTPUTS[0]
    output_file.write_text("the user's table")
    before = _files(mine)
    cfg = compose_cli(config, [*given, f"output_dir={mine}"])
    with pytest.raises(SystemExit) as exit_:
        module.main(cfg)
    message = str(exit_.value.code)
    assert message.startswith(f"nailseg {command}: {mine} is not empty and has no {RUN_MARKER}")
    assert "\n" not in message and str(mine / module.OUTPUTS[0]) in message
    assert _files(mine) == before


def test_a_users_file_where_an_output_goes_is_refused_and_kept(tmp_path):
    out = tmp_path / "bench"
    claim_output(out, ["bench.csv"])  # a new folder: marked
    assert (out / RUN_MARKER).is_file()
    (out / "bench.csv").write_text("the user's")
    with pytest.raises(NotOursError, match=rf"{out / 'bench.csv'} is not a file nailseg wrote"):
        claim_output(out, ["bench.csv"])
    assert (out / "bench.csv").read_text() == "the user's"


def test_a_marker_of_another_kind_is_not_the_benchs(tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    (out / RUN_MARKER).write_text('{"tool": "nailseg", "kind": "bench"}')  # no id: not nailseg's
    with pytest.raises(ForeignFolderError, match="that nailseg did not write"):
        claim_output(out, ["bench.csv"])


def test_recorded_outputs_are_replaced_and_make_clean_removes_them_alone(tmp_path):
    out = tmp_path / "outputs" / "bench" / "loaders"
    claim_output(out, ["bench.csv"])
    write_text(out / "bench.csv", "first")
    record_outputs(out, ["bench.csv"])
    claim_output(out, ["bench.csv"])  # a rerun: its own file, unchanged since, may be replaced
    write_text(out / "bench.csv", "second")
    record_outputs(out, ["bench.csv"])
    (out / "notes.txt").write_text("the user's")
    cleaned = clean(tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert cleaned.kept == [out / "notes.txt"] and cleaned.foreign == []
