"""GPU checks (`make gpu-check` runs them; skipped with a reason on a machine without CUDA):
the DALI GPU pipeline's pairing and sample counts, short fits, and the loader benchmark."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from support.loaders import loader_settings, spec_from
from support.loggers import KeptRows
from support.train import TINY_UNET, compose_train, small_overrides, train

from nailseg.data.datamodule import read_split
from nailseg.data.loaders.base import read_records
from nailseg.data.loaders.dali import DaliLoader
from nailseg.model.checkpoint import load_net
from nailseg.model.module import StepValues
from nailseg.prep.format import CSV_COLUMNS
from nailseg.training.run import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# every op that keeps a constant image's median value where it was (brightness would move it)
PAIRING = spec_from(
    [
        {"op": "hflip", "p": 0.5},
        {"op": "vflip", "p": 0.5},
        {"op": "gaussian_noise", "p": 0.5, "sigma": [0, 0.33]},
        {"op": "gaussian_blur", "p": 0.5, "sigma": [0.5, 1.5]},
    ]
)


def _constant_samples(root: Path, n: int) -> pd.DataFrame:
    """Sample i: image of constant value 8*i (a label no flip, resize or blur can move) and a mask
    that is all 1 for odd i, all 0 for even i."""
    rows = []
    for i in range(n):
        image = np.full((40 + i % 3, 50, 3), 8 * i, np.uint8)
        mask = np.full((40 + i % 3, 50, 1), i % 2, np.uint8)
        for kind, array in (("images", image), ("masks", mask)):
            (root / kind / "g").mkdir(parents=True, exist_ok=True)
            np.save(root / kind / "g" / f"{i}.npy", array, allow_pickle=False)
        rows.append([f"images/g/{i}.npy", f"masks/g/{i}.npy", "g", image.shape[0], 50, i % 2])
    return pd.DataFrame(rows, columns=CSV_COLUMNS)


def test_dali_gpu_pairs_and_counts_every_epoch(tmp_path):
    records = _constant_samples(tmp_path, 30)
    mean, std = torch.tensor(PAIRING.mean).view(3, 1, 1), torch.tensor(PAIRING.std).view(3, 1, 1)
    loader = DaliLoader(read_records(records, tmp_path, {"g": 0}), PAIRING, **loader_settings(DaliLoader, train=True, batch_size=8,
                        image_size=(32, 32), device="gpu"))  # fmt: skip
    for _ in range(3):
        rows = []
        for batch in loader:
            assert batch["image"].device.type == "cuda" and batch["mask"].device.type == "cuda"
            assert set(batch["mask"].unique().tolist()) <= {0.0, 1.0}
            pixels = (batch["image"].cpu() * std + mean) * 255  # photometric ops move values a bit
            for value, mask, row in zip(
                pixels[:, 0], batch["mask"].cpu(), batch["index"].tolist(), strict=True
            ):
                assert abs(float(value.median()) / 8 - row) < 1.5 or float(value.std()) > 20
                assert bool(mask.min() == mask.max() == row % 2)
            rows += batch["index"].tolist()
        assert len(rows) == len(set(rows)) == 24  # drop_last: 3 full batches of 8, no repeats
    for world in (1, 2, 3):
        seen = []
        for rank in range(world):
            evaluation = DaliLoader(read_records(records, tmp_path, {"g": 0}), PAIRING, **loader_settings(DaliLoader, train=False,
                                    batch_size=7, image_size=(32, 32), device="gpu",
                                    rank=rank, world_size=world))  # fmt: skip
            seen += [i for batch in evaluation for i in batch["index"].tolist()]
            evaluation.close()
        assert sorted(seen) == list(range(30))


def test_taking_a_dali_batch_does_not_wait_for_queued_work(tmp_path):
    """A batch is handed over on torch's stream: taking it must not wait on the host for the work
    already queued there (the previous training step), or the CPU could not run ahead of the
    GPU."""
    records = _constant_samples(tmp_path, 16)
    loader = DaliLoader(read_records(records, tmp_path, {"g": 0}), PAIRING, **loader_settings(DaliLoader, train=True, batch_size=4,
                        image_size=(32, 32), device="gpu"))  # fmt: skip
    batches = iter(loader)
    taken = [next(batches)]
    time.sleep(0.5)  # the next batch, prefetched, is made meanwhile
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # one GPU thread spinning for ~2 s, queued on torch's stream
    queued = torch.cuda.Event()
    queued.record()
    taken.append(next(batches))
    assert not queued.query()  # the batch came back while the queued work still ran
    torch.cuda.synchronize()
    taken += list(batches)
    rows = [row for batch in taken for row in batch["index"].tolist()]
    assert sorted(rows) == list(range(16))
    for batch in taken:  # the data is the batch's own once the stream reaches it
        for mask, row in zip(batch["mask"].cpu(), batch["index"].tolist(), strict=True):
            assert bool(mask.min() == mask.max() == row % 2)
    loader.close()


def test_a_logged_steps_loss_reaches_the_loggers_without_waiting_for_queued_work():
    """A logged step's loss must not make the host wait for the GPU (Lightning's `.item()` did,
    at every `log_every_n_steps`-th step): it is handed over once it has arrived. A process's
    first logged step may wait once: it loads the step's kernels (CUDA loads each lazily, and
    loading one waits for the running kernels) and allocates pinned host memory. So a first step
    runs here before the work is queued, as in a fit, whose later steps wait for neither."""
    values, logger = StepValues(), KeptRows()
    loss = torch.full((), 0.25, device="cuda")
    values.record({"train/loss_step": loss * 2}, step=8, epoch=1)
    values.hand_over([logger], wait=True)
    torch.cuda._sleep(4_000_000_000)  # one GPU thread spinning for ~2 s, queued on torch's stream
    queued = torch.cuda.Event()
    queued.record()
    values.record({"train/loss_step": loss * 3}, step=9, epoch=1)  # computed after the queued work
    values.hand_over([logger])
    assert not queued.query() and len(logger.rows) == 1  # neither call waited for the device
    values.hand_over([logger], wait=True)
    assert logger.rows == [
        (8, {"train/loss_step": 0.5, "epoch": 1}),
        (9, {"train/loss_step": 0.75, "epoch": 1}),
    ]


def test_closing_a_gpu_loader_returns_its_memory(prepared):
    """A sweep runs its jobs in one process: a closed loader's GPU memory must not stay in DALI's
    pool, out of reach of torch and of the next job. At 1024² one batch of 8 is ~130 MB and the
    pipeline holds several, far above the tolerance."""
    records = read_split(prepared, "train")
    groups = {g: i for i, g in enumerate(sorted(set(records["group"])))}
    torch.zeros(1, device="cuda")  # the CUDA context exists before the baseline
    free_before = torch.cuda.mem_get_info()[0]
    loader = DaliLoader(read_records(records, prepared, groups), PAIRING, **loader_settings(DaliLoader, train=True, batch_size=8,
                        image_size=(1024, 1024), device="gpu"))  # fmt: skip
    batches = sum(1 for _ in loader)
    assert batches == len(loader) > 0
    assert torch.cuda.mem_get_info()[0] < free_before - 256 * 2**20  # the pipeline's buffers
    loader.close()
    assert torch.cuda.mem_get_info()[0] >= free_before - 64 * 2**20


@pytest.mark.parametrize("model", ["unet", "segformer"])
def test_short_fit_on_gpu(model, prepared, tmp_path):
    extra = ["trainer.max_epochs=2", "logger=csv", "aug=heavy"]
    if model == "segformer":
        extra += ["model=segformer", *(f"~{o.lstrip('+').split('=')[0]}" for o in TINY_UNET[1:])]
    train(prepared, tmp_path / "run", *extra, device="gpu")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["fit"]["train/samples"] == 12 and metrics["fit"]["val/samples"] == 5
    final = metrics["final"]["metrics"]
    assert final["val_best/samples"] == 5 and 0 <= final["val_best/dice"] <= 1


def test_a_fit_resumed_on_the_gpu_goes_on_from_its_checkpoint(prepared, tmp_path):
    """A resumed fit counts its batches on a CPU twin of its loader (build.fit_steps) before the
    GPU loader starts; then it trains on from the checkpoint's step."""
    common = ["logger=csv", "test=false", "scheduler=none"]
    train(prepared, tmp_path / "run", "trainer.max_epochs=1", *common, device="gpu")
    train(prepared, tmp_path / "run", "trainer.max_epochs=2", "ckpt_path=last", *common,
          device="gpu")  # fmt: skip
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (metrics["epochs"], metrics["global_step"]) == (2, 6)
    assert metrics["resumed_from"] == str(tmp_path / "run" / "checkpoints" / "last.ckpt")


def test_training_and_validation_steps_do_not_wait_for_the_gpu(prepared, tmp_path):
    """The module's metric updates and the progress bar's step loss once synced every step, and
    Lightning's logging of the step loss and of the learning rate every logged step (here every
    step); the timeline's CUDA events must not wait either (they are read when the fit ends)."""
    run = tmp_path / "run"  # beside the prepared data: a run folder holds only the run's files
    train(prepared, run, "trainer.max_epochs=2", "logger=csv", "test=false",
          "+callbacks.no_sync._target_=support.syncs.NoSyncInSteps",
          "+callbacks.timeline._target_=benchmarks.timeline.GpuTimeline", device="gpu")  # fmt: skip
    assert json.loads((run / "metrics.json").read_text())["fit"]["train/samples"] == 12
    rows = pd.read_csv(run / "timeline.csv")
    assert (rows.steps == 3).all() and (rows.train_ms >= rows.steps_ms).all()
    assert "CUDA events" in (run / "timeline.txt").read_text()


def test_fit_with_cuda_graphs(prepared, tmp_path):
    """compile_mode=reduce-overhead under Lightning: graph outputs are overwritten by the next
    replay, so a step that kept one (in a log, a metric, a callback) would fail or miscount here;
    train drops the last batch but val/test end in a partial one (a second graph)."""
    extra = ["trainer.max_epochs=2", "logger=csv", "module.compile=true", "module.compile_mode=reduce-overhead"]  # fmt: skip
    cfg = compose_train(small_overrides(prepared, *extra, device="gpu"), tmp_path / "run")
    run(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["fit"]["train/samples"] == 12 and metrics["fit"]["val/samples"] == 5
    final = metrics["final"]["metrics"]
    assert final["val_best/samples"] == 5 and 0 <= final["val_best/dice"] <= 1
    load_net(metrics["best"]["checkpoint"], cfg.model)  # the eager net loads what was compiled


def test_bench_on_gpu(prepared, tmp_path):
    from hydra import compose, initialize_config_dir

    from nailseg.bench import run

    with initialize_config_dir(
        config_dir=str(Path(__file__).parents[1] / "conf"), version_base="1.3"
    ):
        cfg = compose("bench", overrides=[
            f"dataset.root={prepared}", "image_size=[64,64]", "warmup_batches=1", "measure_batches=3",
            "repeats=1", f"output_dir={tmp_path / 'bench'}", "loaders.torch.batch_size=4",
            "loaders.kornia.batch_size=4", "loaders.dali.batch_size=4",
        ])  # fmt: skip
    rows = run(cfg)
    assert set(rows["loader"]) == {"torch", "kornia", "dali"} and (rows["device"] == "cuda").all()
    assert rows[["loader_img_s", "train_img_s", "ceiling_img_s"]].gt(0).all().all()
    assert (tmp_path / "bench" / "bench.csv").is_file() and (
        tmp_path / "bench" / "bench.png"
    ).is_file()


def test_predict_decodes_jpegs_on_the_gpu_as_the_cpu_does(prepared, tmp_path):
    from PIL import Image
    from support.inference import compose_cli, make_run

    from nailseg.inference.predict import run as predict

    ckpt = make_run(prepared, tmp_path / "run")

    def smooth(h: int, w: int) -> np.ndarray:
        # photo-like (noise would be decoded differently by nvJPEG's and libjpeg's chroma
        # upsampling), and asymmetric, so a wrong orientation shows
        y, x = np.mgrid[0:h, 0:w]
        return np.stack([255 * y / h, 255 * x / w, 128 + 100 * np.sin(x / 7.0)], -1).astype(
            np.uint8
        )

    photos = tmp_path / "photos"
    photos.mkdir()
    for i, (h, w) in enumerate([(48, 64), (100, 75), (33, 90)]):
        exif = Image.Exif()
        exif[0x0112] = (1, 6, 3)[i]  # upright, turned, upside down
        Image.fromarray(smooth(h, w)).save(photos / f"p{i}.jpg", quality=95, exif=exif.tobytes())
    Image.fromarray(smooth(40, 41)).save(photos / "q.png")
    masks = {}
    runs = {
        "true": ["gpu_decode=true"],
        "false": ["gpu_decode=false"],
        "eager": ["cuda_graphs=false"],
    }
    for name, options in runs.items():
        out = tmp_path / name
        overrides = [f"ckpt={ckpt}", f"input={photos}", f"output={out}", *options]
        summary = predict(compose_cli("predict", [*overrides, "device=cuda", "batch_size=2"]))
        assert summary.images == 4 and not summary.skipped
        assert (summary.capture_seconds > 0) == (name != "eager")
        masks[name] = {p.name: np.asarray(Image.open(p)) for p in (out / "masks").glob("*.png")}
    for name, eager in masks["eager"].items():  # the net as a CUDA graph (the default) and eager
        assert (masks["true"][name] == eager).mean() > 0.999, name
    assert masks["true"]["p1.png"].shape == (75, 100)  # EXIF 6: turned upright
    for name, cpu in masks["false"].items():  # decoders differ by a level or two
        assert masks["true"][name].shape == cpu.shape
        assert (masks["true"][name] == cpu).mean() > 0.98, name
    # the decoded pixels themselves: nvJPEG against libjpeg (PIL), EXIF orientation applied
    from nailseg.inference.pipeline import to_device
    from nailseg.inference.request import Photo
    from nailseg.inference.workers import load
    from nailseg.prep.imageio import read_rgb

    files = sorted(photos.iterdir())
    listed = [Photo(path, path.stem) for path in files]
    decoded = to_device(listed, [load(p, gpu_jpeg=True) for p in listed], torch.device("cuda"))
    for path, image in zip(files, decoded, strict=True):
        expected = read_rgb(path).astype(int)
        got = image.permute(1, 2, 0).cpu().numpy().astype(int)
        # chroma is upsampled differently (2.3 levels on average for p0.jpg on the H200); a
        # photo turned the wrong way differs by tens of levels
        assert got.shape == expected.shape and np.abs(got - expected).mean() < 4.0, path.name
        assert np.abs(got - np.rot90(expected, 2)).mean() > 20.0, path.name


def test_a_graphed_net_gives_the_eager_nets_probabilities_for_every_batch(monkeypatch):
    from nailseg.inference.engine import GraphedNet
    from nailseg.inference.views import probabilities
    from nailseg.model.net import build_net

    # one cuDNN algorithm for eager and captured convolutions (a fit leaves autotuning on, and
    # two bf16 algorithms may differ by a rounding step)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    torch.manual_seed(0)
    net = build_net("unet", "resnet18").cuda().eval().to(memory_format=torch.channels_last)
    graphed = GraphedNet(net)

    def batch(n: int, seed: int) -> torch.Tensor:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(n, 3, 64, 64, device="cuda", generator=generator)
        return x.contiguous(memory_format=torch.channels_last)

    with torch.inference_mode():
        apart = probabilities(net, batch(4, 1)) - probabilities(net, batch(4, 2))
        assert apart.abs().max() > 0.05  # so a stale captured input would show
        # full, new values, a smaller batch (padded), a larger one (captured again), with TTA
        for n, seed, tta in [
            (4, 1, False),
            (4, 2, False),
            (3, 3, False),
            (6, 4, False),
            (2, 5, True),
        ]:
            x = batch(n, seed)
            expected = probabilities(net, x, tta)
            torch.testing.assert_close(probabilities(graphed, x, tta), expected, rtol=0, atol=1e-3)
    assert {len(c.inputs) for c in graphed.captured.values()} == {6}  # 6 rows: 6, and 2 x 3 (TTA)


def test_a_net_a_cuda_graph_cannot_capture_is_refused_before_anything_is_written(tmp_path):
    from nailseg.inference.engine import GraphedNet, capture
    from nailseg.inference.predict import PredictError
    from nailseg.inference.segmenter import InferenceSpec

    class Syncing(torch.nn.Module):  # asks the host for a value mid-forward: no graph holds that
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x) * float(x.sum().item() >= 0)

    spec = InferenceSpec(ckpt=tmp_path / "x.ckpt", model={}, image_size=(32, 32), mean=(0, 0, 0),
                         std=(1, 1, 1), threshold=0.5, data_root=None)  # fmt: skip
    with pytest.raises(PredictError, match="cannot run as a CUDA graph") as raised:
        capture(GraphedNet(Syncing().cuda()), spec, batch_size=2, tta=False)
    assert "\n" not in str(raised.value) and str(raised.value).endswith(
        "cuda_graphs=false runs it eagerly"
    )
    assert torch.ones(4, device="cuda").sum().item() == 4  # the device still works
    assert torch.rand(4, device="cuda").max().item() < 1  # and its random generator too


def test_queueing_a_batch_of_predictions_never_waits_for_the_gpu():
    """predict queues a batch's work (upload, resize, the net as a graph, full-size maps,
    threshold, copy to the host) while the GPU still runs the batch before: none of it may wait
    for the GPU. Normalising once did: a plain copy of the mean and std to the GPU waits for
    all the work queued there, so the host idled a batch's length every batch."""
    from nailseg.inference.engine import GraphedNet
    from nailseg.inference.pipeline import to_host
    from nailseg.inference.segmenter import InferenceSpec
    from nailseg.inference.views import full_size_probabilities, image_tensors
    from nailseg.model.net import build_net

    net = build_net("unet", "resnet18").cuda().eval().to(memory_format=torch.channels_last)
    graphed = GraphedNet(net)
    spec = InferenceSpec(ckpt=Path("x.ckpt"), model={}, image_size=(64, 64), mean=(0.5, 0.4, 0.3),
                         std=(0.2, 0.2, 0.2), threshold=0.5, data_root=None)  # fmt: skip
    sizes = [(50, 70), (50, 70), (90, 60)]
    rng = np.random.default_rng(0)
    photos = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]

    def queue() -> object:
        maps = full_size_probabilities(graphed, image_tensors(photos, torch.device("cuda")), spec)
        return to_host(maps, lambda flat: flat > 0.5)

    first = queue()()  # captures the graph (which waits, once)
    torch.cuda.set_sync_debug_mode("error")
    try:
        copy = queue()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, want in zip(copy(), first, strict=True):
        np.testing.assert_array_equal(got, want)
    assert [a.shape for a in first] == sizes


def test_a_batch_comes_back_from_the_gpu_as_it_was_when_its_copy_was_queued():
    """predict queues a batch's copy to the host before the next batch's work and waits for the
    copy only: what is queued after it (here: changing the tensor) must not reach it."""
    from nailseg.inference.pipeline import to_host

    maps = [torch.rand(300, 400, device="cuda"), torch.rand(50, 70, device="cuda")]
    expected = [(m > 0.5).cpu().numpy() for m in maps]
    copy = to_host(maps, lambda flat: flat > 0.5)
    for m in maps:
        m.sub_(1.0)  # every value below 0.5 once this has run
    assert inspect.getclosurevars(copy).nonlocals["flat"].is_pinned()  # the copy's host buffer
    for got, want in zip(copy(), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert not (maps[0] > 0.5).any()  # the later work did run


def test_a_checkpoint_snapshot_holds_the_values_at_the_save():
    from nailseg.training.checkpoint_io import host_snapshot

    weights = torch.arange(1_000_000, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    snapshot, copies = host_snapshot({"w": weights, "step": torch.tensor(3)}, lambda _: stream)
    weights.mul_(-1)  # the next optimizer step, queued at once
    copies()  # waits for the copies
    assert snapshot["w"].device.type == "cpu" and snapshot["w"].is_pinned()
    assert torch.equal(snapshot["w"], torch.arange(1_000_000, dtype=torch.float32))
    assert snapshot["step"].item() == 3
