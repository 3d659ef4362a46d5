"""A checkpoint is data: every key of its card is checked before it is used (`validate_card`), and
a bad one fails as one line naming the checkpoint and the key, before smp or timm sees it. The
commands run as users run them (in this process), on checkpoints built by hand (`torch.save` of a
bad card), with a watch on every file the process opens: nothing but the checkpoint may be read.
"""

from __future__ import annotations

import copy
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from support.cli import files_opened_below, run_command
from support.inference import compose_cli
from support.prepared import write_split
from support.train import compose_train, small_overrides

from nailseg.inference.segmenter import resolve_spec
from nailseg.io.folder import MARKER
from nailseg.model.checkpoint import (
    CARD_KEY,
    CheckpointError,
    load_net,
    make_card,
    read_checkpoint,
    validate_card,
)

CARD: dict[str, Any] = {
    "format": 1,
    "nailseg_version": "0.1.0",
    "run_id": "0123456789abcdef0123456789abcdef",
    "model": {
        "arch": "Unet",
        "encoder_name": "resnet18",
        "options": {"encoder_depth": 3, "decoder_channels": [16, 8, 4]},
    },
    "image_size": [32, 32],
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
    "threshold": 0.5,
    "group_names": ["a", "b"],
    "data_root": "/data/prepared",
    "data": {"root": "/data/prepared", "splits": {"train": "a" * 64, "valid": None}},
    "config": {"optimizer": {"_target_": "torch.optim.AdamW", "lr": 0.001}},
    "wandb_run_id": "3x4mpl3",
}


def _with(**changes: Any) -> dict[str, Any]:
    """CARD with `changes`; `model_<key>` changes a key of its model."""
    card = copy.deepcopy(CARD)
    for key, value in changes.items():
        if key.startswith("model_"):
            card["model"][key.removeprefix("model_")] = value
        else:
            card[key] = value
    return card


def _checkpoint(path: Path, card: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 0, CARD_KEY: card}, path)
    return path


@pytest.mark.parametrize(
    ("changes", "key", "problem"),
    [
        ({"threshold": 1.5}, "threshold", r"a number in \(0, 1\)"),
        ({"threshold": float("nan")}, "threshold", r"a number in \(0, 1\)"),
        # #45: at 1.0 no pixel is foreground, at 0 every one: both were taken
        ({"threshold": 1.0}, "threshold", r"a number in \(0, 1\)"),
        ({"threshold": 0}, "threshold", r"a number in \(0, 1\)"),
        ({"image_size": [0, 32]}, "image_size", "positive integers"),
        ({"image_size": [32]}, "image_size", r"\[height, width\]"),
        ({"mean": [0.5, 0.5]}, "mean", "3 numbers"),
        ({"std": [0.2, 0.0, 0.2]}, "std", "above 0"),
        ({"std": ["0.2", 0.2, 0.2]}, "std", "3 numbers"),
        ({"format": 99}, "format", "card format"),
        ({"run_id": "../elsewhere"}, "run_id", "hex digits"),
        ({"wandb_run_id": "../../outside"}, "wandb_run_id", "W&B run id"),
        ({"group_names": "ab"}, "group_names", "list of names"),
        ({"nail_size": [9.0, 8.0, 10.0, 11.0, 12.0]}, "nail_size", "at least the one before"),
        ({"nail_size": [0, 8.0, 10.0, 11.0, 12.0]}, "nail_size", "sizes > 0"),
        ({"nail_size": [8.0, 10.0]}, "nail_size", "5 sizes"),
        ({"data": {"root": "/x"}}, "data", "splits"),
        ({"config": ["not", "a", "mapping"]}, "config", "mapping"),
        ({"config": {"trainer": {"x": object.__name__, 3: 1}}}, "config", "refused"),
        ({"surprise": 1}, "surprise", "not a key nailseg writes"),
        ({"model_arch": "builtins.exec"}, "model.arch", "not one of smp's architectures"),
        (
            {"model_encoder_name": "tu-hf-hub:timm/resnet18.a1_in1k"},
            "model.encoder_name",
            "refused",
        ),
        ({"model_encoder_name": "hf_hub:timm/resnet18"}, "model.encoder_name", "refused"),
        ({"model_encoder_name": "tu-/tmp/net.pth"}, "model.encoder_name", "refused"),
        ({"model_encoder_name": "tu-https://example.com/x"}, "model.encoder_name", "refused"),
        ({"model_encoder_name": "tu-resnet18.a1_in1k"}, "model.encoder_name", "refused"),
        (
            {"model_options": {"encoder_weights": "/tmp/w.pth"}},
            "model.options.encoder_weights",
            "refused",
        ),
        ({"model_options": {"in_channels": 4}}, "model.options.in_channels", "refused"),
        (
            {"model_options": {"aux_params": {"classes": 2}}},
            "model.options.aux_params",
            "plain values",
        ),
        ({"model_options": {"encoder_dept": 3}}, "model.options.encoder_dept", "refused"),
        ({"model_options": {"_target_": "os.system"}}, "model.options._target_", "refused"),
        ({"model_path": "/tmp/x"}, "model.path", "not a model key"),
        (
            {
                "model_arch": "Segformer",
                "model_encoder_name": "mit_b0",
                "model_options": {},
                "image_size": [48, 64],
            },
            "image_size",
            "multiples of 32",
        ),
    ],
)
def test_a_bad_card_value_is_refused_naming_checkpoint_and_key(changes, key, problem, tmp_path):
    ckpt = _checkpoint(tmp_path / "bad.ckpt", _with(**changes))
    value = re.escape(f"{ckpt}: card key {key}=")
    with pytest.raises(CheckpointError, match=rf"^{value}.*: .*{problem}") as excinfo:
        resolve_spec(compose_cli("export", [f"ckpt={ckpt}"]))  # predict's spec too
    assert "\n" not in str(excinfo.value)


def test_a_card_model_its_architecture_refuses_fails_in_one_line(tmp_path):
    # each option is one Unet takes, but 2 decoder channels for an encoder of depth 3 are not
    model = {"arch": "Unet", "encoder_name": "resnet18"}
    model["options"] = {"encoder_depth": 3, "decoder_channels": [16, 8]}
    ckpt = _checkpoint(tmp_path / "bad.ckpt", _with(model=model))
    spec = resolve_spec(compose_cli("export", [f"ckpt={ckpt}"]))
    with pytest.raises(
        CheckpointError, match=rf"^model for {re.escape(str(ckpt))}: .*depth"
    ) as err:
        load_net(spec.ckpt, spec.model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("model", ["unet", "segformer"])
def test_the_cards_training_writes_are_valid(model, prepared, tmp_path):
    base = [o for o in small_overrides(prepared) if not o.lstrip("+").startswith("model")]
    cfg = compose_train([*base, f"model={model}"], tmp_path / "run")
    card = make_card(cfg, ["a", "b"])
    assert validate_card(card, "ckpt") == card
    tu = compose_train([*base, "model.encoder_name=tu-mobilenetv3_small_050"], tmp_path / "tu")
    assert validate_card(make_card(tu, ["a"]), "ckpt")["model"]["encoder_name"].startswith("tu-")


def test_the_card_records_how_large_the_training_nails_were_at_the_input_size(tmp_path):
    """A square nail in each 64×64 training photo, trained at 32×32 (small_overrides): at half
    the size, as a disc of its area; the train split of a mixed-in source counts, that of a
    source of weight 0 does not."""
    for root, side in (("a", 16), ("b", 32)):
        masks = np.zeros((4, 64, 64, 1), np.uint8)
        masks[:, :side, :side] = 1
        write_split(tmp_path / root, "train", [np.zeros((64, 64, 3), np.uint8)] * 4, list(masks))
    disc = 2 / np.sqrt(np.pi) / 2  # a square's side to its disc's diameter, at half the size
    cfg = compose_train(small_overrides(tmp_path / "a"), tmp_path / "run")
    assert make_card(cfg, ["a"])["nail_size"] == pytest.approx([16 * disc] * 5, 0.01)
    mix = f"dataset.mix=[{{name: b, root: {tmp_path / 'b'}, weight: 1}}]"
    cfg = compose_train(
        [*small_overrides(tmp_path / "a"), "dataset.weight=0", mix], tmp_path / "run"
    )
    assert make_card(cfg, ["a"])["nail_size"] == pytest.approx([32 * disc] * 5, 0.01)


def test_a_training_that_would_write_an_unusable_card_is_refused(prepared, tmp_path):
    # timm's own arguments to a `tu-` encoder: a checkpoint may not carry them (one loads files)
    base = [o for o in small_overrides(prepared) if not o.lstrip("+").startswith("model")]
    tu = [*base, "model.encoder_name=tu-resnet18", "+model.options.drop_path_rate=0.1"]
    with pytest.raises(
        CheckpointError, match=r"card key model.options.drop_path_rate=0.1: refused"
    ):
        make_card(compose_train(tu, tmp_path / "run"), ["a"])


@pytest.fixture
def photo(tmp_path: Path) -> Path:
    path = tmp_path / "photos" / "one.png"
    path.parent.mkdir()
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(path)
    return path


@pytest.mark.slow
def test_predict_and_export_refuse_a_card_before_smp_or_timm_reads_a_file(photo, tmp_path, capsys):
    """A `tu-` encoder's keyword `checkpoint_path` makes timm load that file, and a hub name makes
    it download: both refused with one line, and the process opens no file of the user's but the
    checkpoint."""
    watch = tmp_path / "watched"
    bait = watch / "bait.pth"
    bait.parent.mkdir()
    torch.save({"conv1.weight": torch.zeros(1)}, bait)
    reads_a_file = _with(model_encoder_name="tu-resnet18", model_options={"checkpoint_path": str(bait)})  # fmt: skip
    downloads = _with(model_encoder_name="tu-hf-hub:timm/resnet18.a1_in1k")
    for command, card, key in (
        ("export", reads_a_file, "model.options.checkpoint_path"),
        ("predict", downloads, "model.encoder_name"),
    ):
        ckpt = _checkpoint(watch / "run.ckpt", card)
        out = tmp_path / "out"
        extra = [f"input={photo}", f"output={out}"] if command == "predict" else []
        with files_opened_below(watch) as opened:
            done = run_command(["-m", "nailseg", command, f"ckpt={ckpt}", *extra], capsys)
        stderr = done.stderr
        assert done.returncode != 0 and "Traceback" not in stderr, stderr[-3000:]
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        assert f"{ckpt}: card key {key}=" in lines[0] and "refused" in lines[0]
        # the checkpoint, and (export) nailseg's own marker where its output would go
        assert opened - {str(watch / MARKER)} == {str(ckpt)} and not out.exists()
        assert sorted(p.name for p in watch.iterdir()) == ["bait.pth", "run.ckpt"]  # nothing new


@pytest.mark.parametrize("keep", [1, 150])
def test_a_cut_checkpoint_is_one_line_naming_it(keep, tmp_path):
    """A checkpoint whose pickle was cut short (a copy stopped part-way, then zipped again):
    CheckpointError naming the file, never the unpickler's own traceback (an IndexError)."""
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(64)}, "epoch": 1}, whole)
    cut = tmp_path / "cut.ckpt"
    with zipfile.ZipFile(whole) as source, zipfile.ZipFile(cut, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.endswith("data.pkl"):
                data = data[:keep]
            target.writestr(item, data)
    with pytest.raises(CheckpointError, match=r"cut\.ckpt"):
        read_checkpoint(cut)
