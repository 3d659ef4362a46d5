"""`model.encoder_weights=<file or folder>`: pretrained encoders from a local file, offline.

Each test writes its own weights file (a freshly built encoder's state dict with one tensor set to
a known value) and builds through `build(cfg)` from the real config, the path `train.py` takes:
the built encoder holds exactly the file's tensors, a file that does not fit fails naming the file
and the keys, a missing path fails at build naming `model.encoder_weights`, and a checkpoint of
such a run restores without the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import timm
import torch
from support.prepared import write_prepared
from support.train import TINY_UNET, compose_train, small_overrides

from nailseg.model.checkpoint import load_net, make_card, plain_model
from nailseg.model.net import EncoderWeightsError, build_net
from nailseg.training import resume
from nailseg.training.build import build

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download

KNOWN = 0.5
MODELS = {"unet": ("Unet", "resnet18"), "segformer": ("Segformer", "mit_b0")}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_prepared(tmp_path_factory.mktemp("encoder_weights") / "prepared")


def _encoder_state(model: str, encoder_name: str | None = None) -> dict[str, torch.Tensor]:
    """A fresh encoder's state dict (initialised apart from build's seed), its first weight set to
    KNOWN."""
    arch, name = MODELS[model]
    torch.manual_seed(1234)
    state = build_net(arch, encoder_name or name).encoder.state_dict()
    first = next(k for k, v in state.items() if v.is_floating_point() and k.endswith("weight"))
    state[first].fill_(KNOWN)
    return state


def _build(data: Path, run_dir: Path, model: str, weights: str | Path):
    base = [o for o in small_overrides(data) if o not in TINY_UNET]
    overrides = [*base, "logger=none", f"model={model}", f"model.encoder_weights={weights}"]
    return build(compose_train(overrides, run_dir))


def _assert_holds(encoder: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    loaded = encoder.state_dict()
    assert loaded.keys() == state.keys()
    different = [k for k in state if not torch.equal(loaded[k], state[k])]
    assert not different, f"tensors not loaded from the file: {different[:3]}"
    assert any((v == KNOWN).all() for v in loaded.values() if v.is_floating_point())


def _error(excinfo: pytest.ExceptionInfo) -> str:
    """The message of the EncoderWeightsError, also when Hydra's instantiate wrapped it."""
    err = excinfo.value
    while not isinstance(err, EncoderWeightsError) and err.__cause__ is not None:
        err = err.__cause__
    assert isinstance(err, EncoderWeightsError), excinfo.value
    return str(err)


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_weights_file_is_what_the_built_encoder_holds(model, data, tmp_path):
    state = _encoder_state(model)
    torch.save(state, tmp_path / "weights.pth")
    built = _build(data, tmp_path / "run", model, tmp_path / "weights.pth")
    _assert_holds(built.module.net.encoder, state)


@pytest.mark.slow
def test_a_folder_holds_the_file_named_after_the_encoder(data, tmp_path):
    state = _encoder_state("unet")
    (tmp_path / "weights").mkdir()
    torch.save(state, tmp_path / "weights" / "resnet18.pth")
    torch.save(_encoder_state("unet", "resnet34"), tmp_path / "weights" / "resnet34.pth")
    built = _build(data, tmp_path / "run", "unet", tmp_path / "weights")
    _assert_holds(built.module.net.encoder, state)


@pytest.mark.slow
def test_a_folder_without_the_encoders_file_is_refused(data, tmp_path):
    (tmp_path / "weights").mkdir()
    torch.save(_encoder_state("unet", "resnet34"), tmp_path / "weights" / "resnet34.pth")
    with pytest.raises(Exception) as excinfo:
        _build(data, tmp_path / "run", "unet", tmp_path / "weights")
    message = _error(excinfo)
    assert f"model.encoder_weights={tmp_path / 'weights'}" in message
    assert "resnet18.pth" in message and "resnet34.pth" in message


def test_a_missing_path_fails_at_build_naming_the_key(data, tmp_path):
    missing = tmp_path / "nowhere" / "resnet18.pth"
    with pytest.raises(Exception) as excinfo:
        _build(data, tmp_path / "run", "unet", missing)
    assert f"model.encoder_weights={missing}: no such file or folder" in _error(excinfo)


@pytest.mark.slow
def test_another_encoders_file_is_refused_naming_file_and_keys(data, tmp_path):
    torch.save(_encoder_state("unet", "resnet34"), tmp_path / "r34.pth")
    with pytest.raises(Exception) as excinfo:
        _build(data, tmp_path / "run", "unet", tmp_path / "r34.pth")
    message = _error(excinfo)
    assert f"{tmp_path / 'r34.pth'} does not fit encoder resnet18" in message
    assert "unexpected keys (" in message and "layer1.2." in message
    assert "missing keys" not in message  # resnet34 holds every resnet18 key: still refused


@pytest.mark.slow
def test_a_tensor_of_another_shape_is_refused_and_nothing_is_loaded(tmp_path):
    state = _encoder_state("unet")
    state["conv1.weight"] = torch.zeros(8, 3, 7, 7)
    del state["bn1.bias"]
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(EncoderWeightsError) as excinfo:
        build_net("Unet", "resnet18", str(tmp_path / "bad.pth"))
    message = str(excinfo.value)
    assert str(tmp_path / "bad.pth") in message and "encoder resnet18" in message
    assert "missing keys (1): bn1.bias" in message
    assert "conv1.weight (8, 3, 7, 7) vs (64, 3, 7, 7)" in message


def test_a_file_that_is_no_state_dict_is_refused(tmp_path):
    (tmp_path / "w.pth").write_text("not a torch file")
    with pytest.raises(EncoderWeightsError, match="cannot be read as a torch state dict"):
        build_net("Unet", "resnet18", str(tmp_path / "w.pth"))
    torch.save([1, 2], tmp_path / "list.pth")
    with pytest.raises(EncoderWeightsError, match="holds no state dict"):
        build_net("Unet", "resnet18", str(tmp_path / "list.pth"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", ["state_dict", "model", "whole_net", "nailseg_checkpoint", "timm", "timm_features"]
)
def test_other_layouts_of_the_same_weights_load(layout, tmp_path):
    encoder = "tu-resnet18" if layout == "timm_features" else "resnet18"
    state = _encoder_state("unet", encoder)
    if layout == "state_dict":
        saved = {"state_dict": state, "epoch": 3}
    elif layout == "model":
        saved = {"model": state, "optimizer": {}}
    elif layout == "whole_net":  # an smp net's state dict: only its encoder is taken
        saved = {f"encoder.{k}": v for k, v in state.items()} | {"decoder.x": torch.zeros(1)}
    elif layout == "nailseg_checkpoint":
        saved = {"state_dict": {f"net.encoder.{k}": v for k, v in state.items()}}
    else:  # the backbone's own timm state dict, classifier head included
        backbone = timm.create_model("resnet18", pretrained=False)
        backbone.load_state_dict(
            {k.removeprefix("model."): v for k, v in state.items()}
            | {"fc.weight": backbone.fc.weight, "fc.bias": backbone.fc.bias}
        )
        saved = backbone.state_dict()
    torch.save(saved, tmp_path / "w.pth")
    _assert_holds(build_net("Unet", encoder, str(tmp_path / "w.pth")).encoder, state)


@pytest.mark.slow
def test_a_run_with_a_local_file_restores_from_its_checkpoint_without_it(data, tmp_path):
    state = _encoder_state("unet")
    torch.save(state, tmp_path / "weights.pth")
    built = _build(data, tmp_path / "run", "unet", tmp_path / "weights.pth")
    card = make_card(built.cfg, built.datamodule.group_names)
    assert "encoder_weights" not in card["model"]  # the card's model spec needs no file
    ckpt = tmp_path / "run.ckpt"
    net_state = {f"net.{k}": v for k, v in built.module.net.state_dict().items()}
    fit_state = {"optimizer_states": [], "lr_schedulers": [], "loops": {}, "callbacks": {}}
    torch.save({"state_dict": net_state, "nailseg": card, **fit_state}, ckpt)
    (tmp_path / "weights.pth").unlink()

    _assert_holds(load_net(ckpt, card["model"]).encoder, state)  # predict / export
    # resuming or evaluating with model.encoder_weights left at null matches the card
    plain = compose_train([o for o in small_overrides(data) if o not in TINY_UNET])
    resume.check_matches(resume.Resume(ckpt, tmp_path, card), plain)
    assert plain_model(plain.model, "model") == card["model"]
    # the same command as the fit (the file named, now gone) resumes or evaluates: the checkpoint
    # holds every weight, so build does not read the file
    base = [o for o in small_overrides(data) if o not in TINY_UNET]
    again = [
        *base,
        "logger=none",
        "model=unet",
        f"model.encoder_weights={tmp_path / 'weights.pth'}",
    ]
    for mode in ("train=true", "train=false"):
        build(compose_train([*again, f"ckpt_path={ckpt}", mode], tmp_path / "again"))
    with pytest.raises(Exception, match=r"weights\.pth"):  # without a checkpoint it is needed
        build(compose_train(again, tmp_path / "fresh"))
