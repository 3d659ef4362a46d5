"""What `python train.py` does with the user's defaults (issue #32): it trains on the GPU where
there is one (trainer=auto, the loader on the same device), and it never fills a folder the user
names nor trains on data nobody asked for: a root that is not ready is refused in one line,
before anything is written, naming the `prepare.py` command that makes it."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from support.cli import run_command
from support.image_files import box_mask, photo, save_image
from support.prepared import write_prepared
from support.train import CONF, TINY_UNET, compose_train

from nailseg.device import auto_accelerator, auto_precision
from nailseg.io.folder import read_marker
from nailseg.prep.format import read_table
from nailseg.training.build import build

# small enough that a run which (wrongly) trains ends in seconds
SMALL = [
    "dataset.image_size=[32,32]",
    "loader.batch_size=4",
    "trainer.max_epochs=1",
    "trainer.enable_progress_bar=false",
    "~callbacks.progress_bar",
    *TINY_UNET,
]


@pytest.mark.parametrize(
    ("cuda", "bf16", "chosen"),
    [
        (True, True, ("gpu", "bf16-mixed")),
        (True, False, ("gpu", "16-mixed")),  # a GPU before Ampere: bf16 only emulated
        (False, None, ("cpu", "32-true")),  # the GPU's bf16 is not asked for on the CPU
    ],
)
def test_auto_picks_the_gpu_in_its_fastest_precision_else_the_cpu(cuda, bf16, chosen):
    accelerator = auto_accelerator(cuda)
    assert (accelerator, auto_precision(accelerator, bf16)) == chosen


@pytest.mark.slow
def test_the_default_trainer_is_auto_and_the_loader_runs_where_it_trains(tmp_path):
    """`python train.py model=segformer aug=heavy` trained on the CPU of a GPU machine
    (trainer=cpu was the default)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        choices = compose("train", return_hydra_config=True).hydra.runtime.choices
    assert choices["trainer"] == "auto" and choices["loader"] == "dali"
    data = write_prepared(tmp_path / "prepared", n_train=16, n_valid=4)  # one default batch
    built = build(compose_train([f"dataset.root={data}"], tmp_path / "run"))  # as train.py
    accelerator = auto_accelerator()
    device = built.trainer.strategy.root_device
    assert device.type == {"gpu": "cuda", "cpu": "cpu"}[accelerator]
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert built.trainer.num_devices == 1  # several GPUs: trainer=ddp
    assert built.trainer.precision == auto_precision(accelerator)
    assert built.module.channels_last
    built.datamodule.trainer = built.trainer  # as the fit attaches it
    built.datamodule.setup("fit")
    try:
        assert built.datamodule.train_dataloader().device == device
    finally:
        built.datamodule.teardown("fit")


def test_a_root_that_is_not_there_is_refused_never_filled(tmp_path, capsys):
    """`train.py dataset.root=/some/typo` generated the synthetic photos, prepared them into the
    typo's folder and trained on them, with one INFO line."""
    typo = tmp_path / "some" / "typo"
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    proc = run_command(
        ["train.py", f"dataset.root={typo}", "dataset.synthetic.n=8", run_dir, *SMALL],
        capsys,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        f"train.py: ConfigError: dataset.root={typo} is not prepared (no train.csv), and "
        "train.py makes the synthetic set only in its own folders ("
    )
    assert line.endswith(
        f"to make it here: `python prepare.py dataset=synthetic dataset.synthetic.n=8 "
        f"dataset.root={typo}`"
    )
    assert list(tmp_path.iterdir()) == []  # no data, no run folder, no W&B run


@pytest.mark.slow
def test_the_nails_hint_names_the_photos_and_prepares_them_not_the_synthetic_set(tmp_path, capsys):
    """The hint was `python prepare.py output_dir=data/nails/prepared`, which prepared the
    synthetic photos there; `dataset=nails` then trained on them without a word."""
    photos, root = tmp_path / "photos", tmp_path / "prepared"
    nails = [f"dataset.raw_dir={photos}", f"dataset.root={root}"]
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    proc = run_command(["train.py", "dataset=nails", *nails, run_dir, *SMALL], capsys, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    command = f"python prepare.py dataset=nails input_dir={photos} output_dir={root}"
    assert proc.stderr.strip() == (
        f"train.py: ConfigError: dataset.root={root} is not prepared (no train.csv): prepare "
        f"your photos (input_dir: Images/<group>/, Masks/<group>/) first: `{command}`"
    )
    assert list(tmp_path.iterdir()) == []
    for i in range(6):  # the user's photos, then the hint's command as it reads
        save_image(photos / "Images" / "170517_14" / f"170517_{i}_L_1.png", photo(seed=i))
        save_image(photos / "Masks" / "170517_14" / f"170517_{i}_L_1.png", box_mask())
    prepare_dir = f"hydra.run.dir={tmp_path / 'prepare'}"
    proc = run_command([*command.split()[1:], prepare_dir], capsys, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [read_table(root / f"{split}.csv")["images"] for split in ("train", "valid")]
    assert sorted(name for split in rows for name in split) == [
        f"images/170517_14/170517_{i}_L_1.npy" for i in range(6)
    ]
    assert read_marker(root)["synthetic"] is None and sorted(
        p.name for p in tmp_path.iterdir()
    ) == [
        "photos",
        "prepare",
        "prepared",
    ]
