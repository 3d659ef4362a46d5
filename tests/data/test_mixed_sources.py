"""Mixed sources (`dataset.mix`): other prepared roots' train splits mixed into training by weight.

The plan (data/sampling.py) gives each source its exact share of every epoch, draws a source's rows
without repeats until all were drawn, is identical on every rank and sharded as the plain plan,
and is the plain plan, bit for bit, when nothing is mixed in. The datamodule, built through the
composed config as `train.py` builds it, trains on every source (extra sources' groups named
`<name>/<group>`), validates and tests on the primary root only, and refuses a bad mix before any
training, naming the key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from support.loaders import loader_settings, spec_from
from support.prepared import write_prepared, write_split
from support.train import compose_train, small_overrides, train

from nailseg.data.datamodule import read_split
from nailseg.data.loaders.base import SOURCE, read_records
from nailseg.data.loaders.dali import DaliLoader
from nailseg.data.loaders.kornia_batch import KorniaLoader
from nailseg.data.loaders.torch_workers import TorchLoader
from nailseg.data.sampling import epoch_batches, num_batches, source_shares
from nailseg.model.checkpoint import CheckpointError
from nailseg.prep.format import read_table, write_table
from nailseg.training.build import build
from nailseg.training.run import run

# three sources: 10, 7 and 3 rows; weights 1 : 0.5 : 2 of 20 samples -> 6, 3, 11 an epoch
SOURCES = np.array([0] * 10 + [1] * 7 + [2] * 3)
WEIGHTS = [1.0, 0.5, 2.0]
SHARES = [6, 3, 11]
N_MIX = 8  # train rows of the mixed-in root in the datamodule tests


def _plan(world: int = 1, rank: int = 0, drop_last: bool = False, **kw) -> list[np.ndarray]:
    settings = {"seed": 3, "epoch": 0, "sources": SOURCES, "weights": WEIGHTS} | kw
    n = len(settings["sources"])
    return epoch_batches(
        n, 4, train=True, rank=rank, world_size=world, drop_last=drop_last, **settings
    )


def _rows(batches: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(batches) if batches else np.zeros(0, np.int64)


def test_each_source_makes_up_its_exact_share_of_every_epoch():
    assert source_shares(20, WEIGHTS).tolist() == SHARES
    for epoch in range(5):
        rows = _rows(_plan(epoch=epoch))
        assert len(rows) == 20
        assert np.bincount(SOURCES[rows], minlength=3).tolist() == SHARES
    rng = np.random.default_rng(0)
    for _ in range(200):  # the rounding always totals the epoch, each within 1 of its exact share
        weights = rng.uniform(0.01, 5, size=rng.integers(2, 6)).tolist()
        total = int(rng.integers(1, 500))
        shares = source_shares(total, weights)
        exact = total * np.array(weights) / sum(weights)
        assert shares.sum() == total and (np.abs(shares - exact) < 1).all()


def test_no_row_repeats_before_every_row_of_its_source_was_drawn():
    sources = SOURCES
    for epoch in range(4):
        rows = _rows(_plan(epoch=epoch))
        for k in range(3):
            mine = np.flatnonzero(sources == k)
            drawn = rows[SOURCES[rows] == k]  # in the order batches yield them
            for start in range(0, len(drawn), len(mine)):  # each round of the source: no repeat
                tile = drawn[start : start + len(mine)]
                assert len(set(tile.tolist())) == len(tile) and set(tile) <= set(mine)
    # a source's share within its rows: no row twice in the epoch; tiled: all rows, then again
    rows = _rows(_plan(epoch=0))
    assert np.bincount(rows[SOURCES[rows] == 0]).max() == 1  # 6 of 10
    tiled = np.bincount(rows[SOURCES[rows] == 2], minlength=20)[17:]
    assert sorted(tiled.tolist()) == [3, 4, 4]  # 11 draws of 3 rows


def test_without_a_mix_the_plan_is_the_plain_one_bit_for_bit():
    """The plain plan, written out as it was before sources existed."""
    for n, world, epoch, drop_last in [(12, 1, 0, True), (37, 3, 5, False), (20, 2, 2, True)]:
        order = np.random.default_rng((7, epoch)).permutation(n)
        share = n // world
        for rank in range(world):
            mine = order[rank * share : (rank + 1) * share]
            expected = [mine[i : i + 4] for i in range(0, len(mine), 4)]
            if drop_last and len(expected[-1]) < 4:
                expected.pop()
            plain = epoch_batches(
                n, 4, train=True, seed=7, epoch=epoch, rank=rank, world_size=world,
                drop_last=drop_last,
            )  # fmt: skip
            one_source = epoch_batches(
                n, 4, train=True, seed=7, epoch=epoch, rank=rank, world_size=world,
                drop_last=drop_last, sources=np.zeros(n, np.int64), weights=[0.3],
            )  # fmt: skip
            for got in (plain, one_source):
                assert len(got) == len(expected)
                assert all(
                    g.dtype == np.int64 and (g == e).all()
                    for g, e in zip(got, expected, strict=True)
                )


def test_identical_on_every_rank_and_sharded_into_disjoint_parts():
    for epoch in range(3):
        whole = _rows(_plan(epoch=epoch))  # the epoch's one plan (every rank computes it alike)
        shards = [_rows(_plan(world=2, rank=r, epoch=epoch)) for r in range(2)]
        assert len(shards[0]) == len(shards[1]) == 10
        # rank r takes the r-th half of the plan: disjoint slots, together the whole epoch
        assert (np.concatenate(shards) == whole).all()
    # sources within their rows (no tiling): the ranks' rows are disjoint sets too
    sources, weights = np.array([0] * 12 + [1] * 12), [1.0, 1.0]
    shards = [set(_rows(_plan(2, r, sources=sources, weights=weights)).tolist()) for r in range(2)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 24


def test_a_source_weighted_0_is_never_drawn_and_the_epoch_keeps_its_length():
    for epoch in range(3):
        rows = _rows(_plan(1, 0, weights=[0.0, 0.5, 2.0], epoch=epoch, drop_last=False))
        assert len(rows) == 20 and not (SOURCES[rows] == 0).any()
        assert np.bincount(SOURCES[rows], minlength=3).tolist() == [0, 4, 16]


def test_len_is_the_plain_count():
    for world, drop_last in [(1, True), (2, False), (3, True)]:
        for rank in range(world):
            count = num_batches(20, 4, train=True, rank=rank, world_size=world, drop_last=drop_last)
            assert count == len(_plan(world, rank, drop_last))


# --- the datamodule, built through the composed config as train.py builds it -------------------


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    """A primary root (12 train, 5 valid and 3 test rows; groups a, b) and a root to mix in (8
    train rows, 4 valid, 2 test; groups a, b) whose images are a flat 200 everywhere."""
    primary = write_prepared(tmp_path / "real" / "prepared")
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (40, 48, 3), dtype=np.uint8) for _ in range(3)]
    masks = [np.ones((40, 48, 1), np.uint8) for _ in range(3)]
    write_split(primary, "test", images, masks, prefix="test_")
    mix = tmp_path / "synth" / "prepared"
    for split, n in (("train", N_MIX), ("valid", 4), ("test", 2)):
        images = [np.full((36, 44, 3), 200, np.uint8) for _ in range(n)]
        masks = [np.zeros((36, 44, 1), np.uint8) for _ in range(n)]
        write_split(mix, split, images, masks, prefix=f"{split}_")
    return primary, mix


def _mix(*sources: tuple[str, Path | str, float]) -> str:
    entries = ", ".join(f"{{name: {n}, root: '{r}', weight: {w}}}" for n, r, w in sources)
    return f"dataset.mix=[{entries}]"


def _build(primary: Path, run_dir: Path, *extra: str, loader: str = "torch"):
    overrides = small_overrides(primary, f"loader={loader}", "logger=none", *extra)
    if loader == "torch":
        overrides.append("loader.num_workers=0")
    return build(compose_train(overrides, run_dir))


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["torch", "dali"])
def test_datamodule_trains_on_every_source_and_evaluates_on_the_primary_only(
    loader, roots, tmp_path
):
    primary, mix = roots
    built = _build(primary, tmp_path / "run", _mix(("synth", mix, 0.5)), loader=loader)
    dm = built.datamodule
    assert dm.group_names == ["a", "b", "synth/a", "synth/b"]  # the primary's ids unchanged
    assert [(s.name, s.rows, s.weight) for s in dm.sources] == [("", 12, 1.0), ("synth", 8, 0.5)]
    train = dm.train_rows
    assert len(train) == 20 and train[SOURCE].tolist() == [0] * 12 + [1] * N_MIX
    assert all(Path(p).is_absolute() and Path(p).is_file() for p in train["images"][12:])
    for split in ("train", "valid", "test"):  # the primary's CSVs, which evaluations read
        assert dm.splits[split].equals(read_table(primary / f"{split}.csv"))
    assert dm.final_split == "test"

    shares = source_shares(20, [1.0, 0.5]).tolist()  # 13 primary, 7 mixed in
    for epoch in range(2):
        train_loader = dm.train_dataloader()
        train_loader.set_epoch(epoch)
        rows, groups, flat = [], [], []
        for batch in train_loader:
            rows += batch["index"].tolist()
            groups += batch["group"].tolist()
            image = batch["image"].cpu()
            flat += (image.flatten(2).std(dim=2).amax(dim=1) < 1e-4).tolist()
        assert len(rows) == len(train_loader) * 4 == 20  # drop_last: 5 batches of 4
        rows = np.array(rows)
        assert (rows < 12).sum() == shares[0] and (rows >= 12).sum() == shares[1]
        names = [dm.group_names[g] for g in groups]
        assert {"synth/a", "synth/b"} <= set(names)
        # the mixed-in rows are the mixed-in root's files (flat images), under its groups
        assert [n.startswith("synth/") for n in names] == (rows >= 12).tolist() == flat
        assert np.bincount(rows[rows >= 12]).max() == 1  # 7 of 8: none twice
    dm.teardown("fit")

    # two ranks: each yields its half of the one plan, the halves together the whole epoch
    halves = []
    for rank in range(2):
        shard = dm.loader(
            records=dm.train_records,
            spec=dm.eval_spec,
            train=True,
            image_size=dm.image_size,
            rank=rank,
            world_size=2,
        )
        shard.set_epoch(3)
        halves.append([i for b in shard for i in b["index"].tolist()])
        shard.close()
        assert len(halves[-1]) == len(shard) * 4 == 8  # 10 each, the last partial batch dropped
    sources = train[SOURCE].to_numpy()
    whole = epoch_batches(20, 10, train=True, seed=42, epoch=3, sources=sources, weights=[1, 0.5])
    assert halves == [whole[0][:8].tolist(), whole[1][:8].tolist()]

    for stage, expected in ((dm.val_dataloader, 5), (dm.test_dataloader, 3)):
        got = [
            (i, g)
            for b in stage()
            for i, g in zip(b["index"].tolist(), b["group"].tolist(), strict=True)
        ]
        assert [i for i, _ in got] == list(range(expected))
        assert {dm.group_names[g] for _, g in got} <= {"a", "b"}
    dm.teardown("test")


@pytest.mark.slow
def test_without_a_mix_the_datamodule_is_as_before(roots, tmp_path):
    primary, _ = roots
    dm = _build(primary, tmp_path / "run").datamodule
    assert dm.group_names == ["a", "b"] and len(dm.sources) == 1
    assert dm.splits["train"].equals(read_table(primary / "train.csv"))  # no source columns
    loader = dm.train_dataloader()
    loader.set_epoch(4)
    got = [b["index"].tolist() for b in loader]
    assert got == [b.tolist() for b in epoch_batches(12, 4, train=True, seed=42, epoch=4)]
    dm.teardown("fit")


@pytest.mark.slow  # ~6 s on 2 cores: a fit and a final evaluation
def test_a_run_with_a_mix_trains_on_both_and_reports_only_the_primary(roots, tmp_path):
    """One epoch of what `train.py` runs: the ledger shows the epoch's rows per source, the
    validation and the final test (the primary's test split) report only the primary's groups."""
    primary, mix = roots
    run_dir = tmp_path / "run"
    overrides = small_overrides(
        primary,
        "loader=torch",
        "loader.num_workers=0",
        "logger=none",
        "callbacks=audit",
        "trainer.max_epochs=1",
        _mix(("synth", mix, 1.0)),
    )
    run(compose_train(overrides, run_dir))
    (entry,) = [json.loads(p.read_text()) for p in (run_dir / "ledger").glob("train_*.json")]
    rows = np.array(entry["rows"])
    assert len(rows) == 20 and (rows < 12).sum() == 10 and (rows >= 12).sum() == 10
    report = json.loads((run_dir / "metrics.json").read_text())
    assert report["evaluated_on"] == "test"
    final, fit = report["final"]["metrics"], report["fit"]
    assert final["test/samples"] == 3 and fit["val/samples"] == 5
    groups = [k for k in [*final, *fit] if "_group_" in k]
    assert groups and all(k.endswith(("_group_a", "_group_b")) for k in groups)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ((("synth", "{missing}", 1.0),), FileNotFoundError, None),  # message checked below
        ((("synth", "{mix}", 0),), ValueError, r"dataset\.mix\[0\]\.weight=0(\.0)?: .*> 0"),
        ((("synth", "{mix}", -1.5),), ValueError, r"dataset\.mix\[0\]\.weight=-1\.5"),
        (
            (("synth", "{mix}", 1.0), ("synth", "{mix2}", 1.0)),
            ValueError,
            r"dataset\.mix\[1\]\.name=synth: two sources are named synth",
        ),
        ((("synth", "{primary}", 1.0),), ValueError, r"dataset\.mix\[0\]\.root=.* is dataset\.root"),
        ((("synth", "{primary}/.", 1.0),), ValueError, r"dataset\.mix\[0\]\.root=.* is dataset\.root"),
        (
            (("synth", "{mix}", 1.0), ("other", "{mix}", 1.0)),
            ValueError,
            r"dataset\.mix\[1\]\.root=.* is dataset\.mix\[0\]\.root",
        ),
        ((("syn/th", "{mix}", 1.0),), ValueError, r"dataset\.mix\[0\]\.name='syn/th'"),
    ],
    ids=["unprepared", "weight-0", "weight-negative", "duplicate-name", "primary-root",
         "primary-root-spelt-otherwise", "duplicate-root", "slash-in-name"],
)  # fmt: skip
def test_a_bad_mix_is_refused_before_training_naming_the_key(
    extra, error, message, roots, tmp_path
):
    primary, mix = roots
    mix2 = tmp_path / "synth2"
    mix2.symlink_to(mix.parent, target_is_directory=True)
    paths = {"mix": mix, "mix2": mix2 / "prepared", "primary": primary}
    paths["missing"] = tmp_path / "synthetic-mix" / "prepared"
    sources = [(n, r.format(**paths), w) for n, r, w in extra]
    with pytest.raises(error) as raised:
        _build(primary, tmp_path / "run", _mix(*sources))
    text = str(raised.value)
    if message is not None:
        assert re.search(message, text), text
    else:
        missing = paths["missing"]
        assert f"dataset.mix[0].root={missing} is not a prepared root" in text
        assert (
            "python prepare.py dataset=synthetic_mix "
            f"dataset.raw_dir={missing.parent / 'raw'} dataset.root={missing}"
        ) in text


@pytest.mark.slow
def test_a_primary_weighted_0_only_validates_and_tests(roots, tmp_path):
    primary, mix = roots
    dm = _build(primary, tmp_path / "run", "dataset.weight=0", _mix(("synth", mix, 1.0))).datamodule
    train_loader = dm.train_dataloader()
    groups = [dm.group_names[g] for b in train_loader for g in b["group"].tolist()]
    assert len(groups) == 20 and all(g.startswith("synth/") for g in groups)
    assert {dm.group_names[g] for b in dm.val_dataloader() for g in b["group"].tolist()} <= {
        "a",
        "b",
    }
    dm.teardown("fit")


@pytest.mark.slow
def test_the_primary_weight_is_checked_and_an_empty_mixed_root_refused(roots, tmp_path):
    primary, mix = roots
    with pytest.raises(ValueError, match=r"dataset\.weight=0: dataset\.root then only validates"):
        _build(primary, tmp_path / "run", "dataset.weight=0")
    with pytest.raises(ValueError, match=r"dataset\.weight=-1(\.0)?: .*>= 0 \(0: it only"):
        _build(primary, tmp_path / "run", "dataset.weight=-1", _mix(("synth", mix, 1.0)))
    empty = tmp_path / "empty"
    empty.mkdir()
    write_table(empty / "train.csv", read_table(mix / "train.csv").iloc[:0])
    with pytest.raises(ValueError, match=r"dataset\.mix\[0\]\.root=.*has no rows"):
        _build(primary, tmp_path / "run", _mix(("synth", empty, 1.0)))
    with pytest.raises(Exception, match=r"dataset\.mix\[0\]\.weight"):  # a key left out
        _build(primary, tmp_path / "run", f"dataset.mix=[{{name: s, root: '{mix}'}}]")


@pytest.mark.slow
def test_every_dataset_yaml_sets_weight_and_an_empty_mix_but_nails_synthetic():
    from support.train import CONF

    for path in sorted((CONF / "dataset").glob("*.yaml")):
        cfg = compose_train([f"dataset={path.stem}"])
        assert cfg.dataset.weight == 1.0
        if path.stem == "nails_synthetic":
            (source,) = cfg.dataset.mix
            assert source.name == "synthetic" and source.weight == 1.0
            assert source.root == compose_train(["dataset=synthetic_mix"]).dataset.root
            assert cfg.dataset.root == compose_train(["dataset=nails"]).dataset.root
        else:
            assert list(cfg.dataset.mix) == []


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["torch", "kornia", "dali"])
def test_a_row_drawn_twice_in_an_epoch_is_augmented_afresh(loader, roots, tmp_path):
    # the mixed-in source (8 flat rows) takes 10 of 11 parts of a 20-sample epoch: repeats
    primary, mix = roots
    noise = "aug.ops=[{op: gaussian_noise, p: 1.0, sigma: [0.2, 0.3]}]"
    dm = _build(primary, tmp_path / "run", _mix(("synth", mix, 10.0)), noise, loader=loader)
    images: dict[int, list[np.ndarray]] = {}
    for batch in dm.datamodule.train_dataloader():
        for row, image in zip(batch["index"].tolist(), batch["image"].cpu().numpy(), strict=True):
            images.setdefault(row, []).append(image)
    repeated = [draws for draws in images.values() if len(draws) > 1]
    assert repeated
    for first, *others in repeated:
        assert all(np.abs(first - other).max() > 0.1 for other in others)
    dm.datamodule.teardown("fit")


# --- a row drawn twice, its copies on different ranks --------------------------------------------

# 12 rows, the last 3 a source weighted 3: 9 of an epoch's 12 samples, each of its rows drawn thrice
TILED_SOURCES = np.array([0] * 9 + [1] * 3)
TILED_WEIGHTS = [1.0, 3.0]
NOISE = spec_from([{"op": "gaussian_noise", "p": 1.0, "sigma": [0.2, 0.3]}])


def _keys(world: int, rank: int, epoch: int) -> list[tuple[int, int]]:
    """(row, draw) of each sample this rank yields, in order."""
    batches = _plan(
        world, rank, epoch=epoch, sources=TILED_SOURCES, weights=TILED_WEIGHTS, draws=True
    )
    return [(int(r), int(d)) for rows, draws in batches for r, d in zip(rows, draws, strict=True)]


def test_draws_are_counted_over_the_whole_epoch_plan():
    for epoch in range(4):
        single = _keys(1, 0, epoch)
        rows = [row for row, _ in single]
        # one rank: each row's earlier draws in the order batches yield them, as it always was
        assert [draw for _, draw in single] == [rows[:i].count(row) for i, row in enumerate(rows)]
        assert max(draw for _, draw in single) == 2  # the tiled source: thrice
        for world in (2, 3, 4):
            sharded = [key for rank in range(world) for key in _keys(world, rank, epoch)]
            assert sharded == single  # the ranks' parts of the one plan, keys unchanged
            assert len(set(sharded)) == len(sharded)  # no (row, draw) twice, on any ranks
    for rank in range(2):  # eval: every row once
        for rows, draws in epoch_batches(20, 4, train=False, rank=rank, world_size=2, draws=True):
            assert (draws == 0).all() and len(rows) == len(draws)


def _samples(backend: type, root: Path, rank: int, world: int) -> list[tuple[int, np.ndarray]]:
    """(row, augmented image) of each sample rank `rank` of `world` yields in epoch 2."""
    records = read_split(root, "train").assign(**{SOURCE: TILED_SOURCES})
    workers = {} if backend is DaliLoader else {"num_workers": 0}
    loader = backend(read_records(records, root, {"a": 0, "b": 1}, TILED_WEIGHTS), NOISE, **loader_settings(
        backend, train=True, batch_size=2, image_size=(32, 32), seed=1, rank=rank, world_size=world, drop_last=False,
        **workers,
    ))  # fmt: skip
    loader.set_epoch(2)
    out = [
        (row, image)
        for batch in loader
        for row, image in zip(batch["index"].tolist(), batch["image"].cpu().numpy(), strict=True)
    ]
    loader.close()
    return out


@pytest.mark.parametrize("backend", [TorchLoader, KorniaLoader, DaliLoader])
@pytest.mark.parametrize("world", [2, 3])
def test_copies_of_a_row_on_any_ranks_are_augmented_afresh(backend, world, prepared):
    sharded = [s for rank in range(world) for s in _samples(backend, prepared, rank, world)]
    copies: dict[int, list[np.ndarray]] = {}
    for row, image in sharded:
        copies.setdefault(row, []).append(image)
    assert sorted(len(c) for c in copies.values() if len(c) > 1) == [3, 3, 3]
    for images in copies.values():
        for i, first in enumerate(images):
            assert all(np.abs(first - other).max() > 0.1 for other in images[i + 1 :])
    if backend is TorchLoader:  # seeded by sample alone: the same images on any number of ranks
        single = _samples(backend, prepared, 0, 1)
        assert [row for row, _ in sharded] == [row for row, _ in single]
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(sharded, single, strict=True))


@pytest.mark.slow
def test_a_final_evaluation_on_the_train_split_reads_the_primarys_rows_only(roots, tmp_path):
    # eval_split=train once evaluated the mixed-in source's train rows too
    primary, mix = roots
    dm = _build(primary, tmp_path / "run", _mix(("synth", mix, 0.5)), "eval_split=train").datamodule
    assert len(dm.train_rows) == 20  # training still draws from both sources
    test = dm.test_dataloader()
    groups = {dm.group_names[g] for b in test for g in b["group"].tolist()}
    assert sum(len(b["index"]) for b in test) == 12 and groups == {"a", "b"}
    dm.teardown("test")


@pytest.mark.slow
def test_a_resume_on_other_mixed_in_data_is_refused_naming_it(roots, tmp_path):
    """`dataset.mix` was no part of the data identity: a fit resumed with another source mixed in
    (or none, or another weight) went on silently. The checkpoint's card now records each source,
    and a resume compares it as it compares the root's split files."""
    primary, mix = roots
    once = ("loader=torch", "loader.num_workers=0", "logger=none", "test=false", "scheduler=none")
    train(primary, tmp_path / "run", *once, "trainer.max_epochs=1", _mix(("synth", mix, 0.5)))
    again = (*once, "trainer.max_epochs=2", "ckpt_path=last")
    for other in (_mix(("synth", mix, 2.0)), "dataset.mix=[]"):
        with pytest.raises(CheckpointError, match=r"another dataset .*mixed in: synth") as refused:
            train(primary, tmp_path / "run", *again, other)
        assert "\n" not in str(refused.value)
    train(primary, tmp_path / "run", *again, _mix(("synth", mix, 0.5)))  # the same mix resumes
