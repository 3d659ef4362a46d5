"""`python -m nailseg export`: ONNX with a dynamic batch axis that ONNX Runtime runs like PyTorch."""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from rich.console import Console
from support.cli import run_command
from support.inference import compose_cli, own_run

from nailseg.inference.export import ExportError, main, run
from nailseg.inference.segmenter import resolve_spec
from nailseg.io.folder import JOURNAL
from nailseg.model.checkpoint import ArchitectureMismatch, load_net


@pytest.fixture(scope="module")
def trained(trained_run, tmp_path_factory):
    return own_run(trained_run, tmp_path_factory.mktemp("export_run") / "run")


def export(ckpt, *extra: str):
    return run(compose_cli("export", [f"ckpt={ckpt}", *extra]), console=Console(quiet=True))


@pytest.mark.slow
def test_onnx_matches_pytorch_for_batches_of_1_and_3(trained):
    path = export(trained)
    assert path == trained.with_suffix(".onnx")  # next to the checkpoint by default
    assert not list(trained.parent.glob(".*.tmp"))

    model = onnx.load(str(path))
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    (inp,), (out,) = model.graph.input, model.graph.output
    assert (inp.name, out.name) == ("image", "logits")
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert dims == ["batch", 3, 32, 32]
    # the exporter's own inference declared [batch, 1, batch, ?]
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == [
        "batch", 1, 32, 32,
    ]  # fmt: skip
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["nailseg.image_size"]) == [32, 32]
    assert json.loads(meta["nailseg.inference.threshold"]) == 0.5

    spec = resolve_spec(compose_cli("export", [f"ckpt={trained}"]))
    net = load_net(trained, spec.model)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_outputs()[0].shape == ["batch", 1, 32, 32]
    generator = torch.Generator().manual_seed(123)
    for n in (1, 3):
        batch = torch.randn(n, 3, 32, 32, generator=generator)
        with torch.inference_mode():
            expected = net(batch).numpy()
        (got,) = session.run(["logits"], {"image": batch.numpy()})
        assert got.shape == (n, 1, 32, 32)
        assert np.abs(got - expected).max() <= 1e-3


def test_output_path_and_entry_point(trained, tmp_path, monkeypatch, capsys):
    target = tmp_path / "deploy" / "nails.onnx"
    monkeypatch.setattr(
        sys, "argv", ["nailseg.inference.export", f"ckpt={trained}", f"output={target}"]
    )
    main()
    assert target.is_file() and [p.name for p in target.parent.glob(".*")] == [JOURNAL]
    assert "ONNX Runtime matches PyTorch" in capsys.readouterr().out


@pytest.mark.slow
def test_only_an_earlier_export_is_replaced(trained, tmp_path):
    """The checkpoint itself, a user's file or a folder at `output` stay as they are."""
    kept = trained.read_bytes()
    with pytest.raises(ExportError, match="exists and nailseg did not write it"):
        export(trained, f"output={trained}")
    assert trained.read_bytes() == kept
    (tmp_path / "mine.onnx").write_bytes(b"a model of mine")
    (tmp_path / "folder.onnx").mkdir()
    with pytest.raises(ExportError, match="exists and nailseg did not write it"):
        export(trained, f"output={tmp_path / 'mine.onnx'}")
    with pytest.raises(ExportError, match="is a folder or special file"):
        export(trained, f"output={tmp_path / 'folder.onnx'}")
    assert (tmp_path / "mine.onnx").read_bytes() == b"a model of mine"
    export(trained, f"output={tmp_path / 'ours.onnx'}")
    export(trained, f"output={tmp_path / 'ours.onnx'}")  # a rerun replaces its own export


@pytest.mark.slow
def test_a_model_edited_since_its_export_is_never_replaced(trained, tmp_path, capsys):
    """An exported model the user has since edited (its metadata kept, as onnx tools keep it):
    before, any ONNX file with nailseg's metadata counted as nailseg's, and was replaced."""
    model = tmp_path / "deploy" / "nails.onnx"
    args = ["-m", "nailseg", "export", f"ckpt={trained}", f"output={model}"]
    assert run_command(args, capsys).returncode == 0
    edited = onnx.load(str(model))
    edited.doc_string = "tuned by hand"
    onnx.save(edited, str(model))
    kept = model.read_bytes()
    done = run_command(args, capsys)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert f"{model} exists and nailseg did not write it" in done.stderr
    assert model.read_bytes() == kept


def test_unknown_format_and_wrong_architecture_fail_clearly(trained, tmp_path):
    with pytest.raises(ExportError, match="format=tflite: supported formats are onnx"):
        export(trained, "format=tflite")
    with pytest.raises(ArchitectureMismatch, match=r"different architecture.*pass model="):
        export(trained, "model=unet", f"output={tmp_path / 'x.onnx'}")  # resnet18, full decoder
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.slow
def test_an_opset_or_output_that_cannot_work_is_refused_before_the_export(trained, tmp_path):
    """An opset the exporter lacks failed after tracing the net, printing its whole graph and a
    trace; an output inside a file failed with a trace when the checked model was written."""
    from nailseg.inference.export import exporter_opsets

    lowest, highest = exporter_opsets()  # torch's private constants, looked up at use
    assert lowest <= compose_cli("export", ["ckpt=x"]).opset <= highest
    with pytest.raises(ExportError, match=rf"^opset={highest + 1}: the exporter writes opsets"):
        export(trained, f"opset={highest + 1}", f"output={tmp_path / 'x.onnx'}")
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ExportError, match=r"^output=.*file/x.onnx: .*file is a file, not a folder"):
        export(trained, f"output={tmp_path / 'file' / 'x.onnx'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_large_logits_are_compared_relative_to_their_size(trained, tmp_path):
    # an early UNet-resnet34 at 384² gives logits beyond 2,000 on random inputs, where float32
    # sums in another order differ by ~4e-3: an absolute 1e-3 refused every such export
    from nailseg.inference.engine import TOLERANCE, logits_difference
    from nailseg.inference.export import export_onnx

    cfg = compose_cli("export", [f"ckpt={trained}"])
    spec = resolve_spec(cfg)
    net = load_net(trained, spec.model).eval()
    with torch.no_grad():
        net.segmentation_head[0].weight.mul_(1e5)
        net.segmentation_head[0].bias.mul_(1e5)
    path = tmp_path / "big.onnx"
    diff = export_onnx(net, spec, path, opset=cfg.opset)
    assert path.is_file() and diff is not None and diff <= TOLERANCE
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batch = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = net(batch).numpy()
    (got,) = session.run(["logits"], {"image": batch.numpy()})
    assert np.abs(expected).max() > 1e3  # the logits are large indeed
    assert np.abs(got - expected).max() > 1e-3  # what the absolute rule refused
    assert logits_difference(path.read_bytes(), net, spec.image_size) == pytest.approx(diff)


@pytest.mark.slow
def test_an_smp_export_loads_with_from_pretrained_and_gives_the_checkpoints_logits(
    trained, tmp_path, capsys
):
    """`format=smp` writes the folder smp's `from_pretrained` loads, nailseg's card beside it; a
    rerun replaces only its own files, and a file the user edited there stops it in one line."""
    import segmentation_models_pytorch as smp

    from nailseg.inference.export import CARD_FILE
    from nailseg.model.checkpoint import validate_card

    out = tmp_path / "hub"
    args = ["-m", "nailseg", "export", f"ckpt={trained}", "format=smp", f"output={out}"]
    assert run_command(args, capsys).returncode == 0
    files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert files == sorted(["README.md", "config.json", "model.safetensors", CARD_FILE])
    assert not (out / ".smp").exists()  # smp's scratch folder is gone
    card = validate_card(json.loads((out / CARD_FILE).read_text()), CARD_FILE)
    assert card["image_size"] == [32, 32] and card["model"]["arch"].lower() == "unet"

    net = load_net(trained, card["model"])
    loaded = smp.from_pretrained(str(out)).eval()
    batch = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(batch), net(batch), rtol=0, atol=1e-6)

    kept = {name: (out / name).read_bytes() for name in files}
    assert run_command(args, capsys).returncode == 0  # a rerun: the same files, nothing added
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in kept} == kept
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == files

    (out / "config.json").write_text('{"edited": true}')
    done = run_command(args, capsys)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "config.json lies where nailseg would write" in done.stderr
    assert (out / "config.json").read_text() == '{"edited": true}'
    assert (out / "model.safetensors").read_bytes() == kept["model.safetensors"]


def test_a_segformer_exports_under_smps_own_parameter_names(tmp_path):
    """nailseg's SegFormer runs fused attention (model/net.py); smp builds its own."""
    import segmentation_models_pytorch as smp

    from nailseg.inference.export import export_smp
    from nailseg.model.net import build_net

    net = build_net("Segformer", "mit_b0").eval()
    export_smp(net, {}, tmp_path / "segformer")
    loaded = smp.from_pretrained(str(tmp_path / "segformer")).eval()
    batch = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(batch), net(batch), rtol=0, atol=1e-5)
