"""A tiny trained run laid out as `train.py` leaves it, the predict/export configs to run on it, and
references to check predict against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

import nailseg.inference.export  # noqa: F401  (registers export_schema)
from nailseg.inference.predict import run as predict_run
from nailseg.io.folder import OwnedFolder
from nailseg.training.run import run as train_run
from support.image_files import save_image
from support.train import CONF, compose_train, small_overrides


def make_run(root: Path, run_dir: Path) -> Path:
    """Train the tiny UNet one epoch on `root`; write `.hydra/config.yaml` as Hydra would.
    Returns the run's last checkpoint."""
    cfg = compose_train(
        small_overrides(root, "logger=none", "trainer.max_epochs=1", "test=false"), run_dir
    )
    train_run(cfg)  # first: it claims run_dir, which must be new or nailseg's
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    return run_dir / "checkpoints" / "last.ckpt"


def own_run(ckpt: Path, run_dir: Path) -> Path:
    """A run folder of its own at `run_dir` (nailseg's, as train.py makes one) holding `ckpt` and
    its run's `.hydra/config.yaml`: a test may write beside it. Returns its checkpoint."""
    with OwnedFolder.claim(run_dir, "run") as folder:
        for rel in (f"checkpoints/{ckpt.name}", ".hydra/config.yaml"):
            folder.write(rel, (ckpt.parents[1] / rel).read_bytes())
    return run_dir / "checkpoints" / ckpt.name


def constant_checkpoint(ckpt: Path, logit: float, name: str = "constant.ckpt") -> Path:
    """A copy of `ckpt` (beside it, so it belongs to the same run) whose net outputs `logit`
    everywhere: the segmentation head's weights zeroed, its bias set."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    state["net.segmentation_head.0.weight"].zero_()
    state["net.segmentation_head.0.bias"].fill_(logit)
    out = ckpt.with_name(name)
    torch.save(checkpoint, out)
    return out


def compose_cli(config: str, overrides: list[str]) -> DictConfig:
    """The config `python -m nailseg <command> <overrides>` would run (`config`: its name)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config, overrides=overrides)


def reference_probabilities(ckpt: Path, image, size: tuple[int, int] | None = None):
    """The net's H×W probability map of an RGB uint8 H×W×3 photo as docs/INFERENCE.md states it,
    computed here from the checkpoint's card and weights, not by predict's code: resized to
    `size` (None: the card's input size; bilinear, antialiased), `(x/255 - mean) / std`, the
    sigmoid of the net's logit, brought back to the photo's size bilinearly."""
    import torch.nn.functional as F

    from nailseg.model.checkpoint import CARD_KEY, load_net

    card = torch.load(ckpt, map_location="cpu", weights_only=True)[CARD_KEY]
    net = load_net(ckpt, card["model"])
    x = torch.from_numpy(image).permute(2, 0, 1)[None].float()
    x = F.interpolate(x, size or card["image_size"], mode="bilinear", antialias=True)
    mean, std = (torch.tensor(card[key]).view(1, 3, 1, 1) for key in ("mean", "std"))
    with torch.inference_mode():
        prob = torch.sigmoid(net((x / 255 - mean) / std))
    return F.interpolate(prob, image.shape[:2], mode="bilinear")[0, 0]


def predict_split(ckpt: Path, root: Path, rows: pd.DataFrame, folder: Path, *extra: str) -> dict:
    """`nailseg predict` of a prepared split's photos (saved as PNG files) against its masks:
    the overall scores it reports."""
    for i, (image, mask) in enumerate(zip(rows["images"], rows["masks"], strict=True)):
        save_image(folder / "photos" / f"{i}.png", np.load(root / image))
        save_image(folder / "masks" / f"{i}.png", np.load(root / mask)[..., 0] * 255)
    overrides = [f"ckpt={ckpt}", f"input={folder / 'photos'}", f"output={folder / 'out'}"]
    overrides += [f"masks={folder / 'masks'}", "num_workers=1", *extra]
    return predict_run(compose_cli("predict", overrides), Console(quiet=True)).scores["overall"]
