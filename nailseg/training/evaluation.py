"""An evaluation-only run (`train=false ckpt_path=X`) takes the model and input size from the
checkpoint's card, as predict does; a value the command line restates must be the card's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from nailseg.model.checkpoint import CheckpointError, plain_model

# each key a card fixes: (the config key, the card key)
CARD_KEYS = (("model", "model"), ("dataset.image_size", "image_size"))


def given_keys() -> Collection[str] | None:
    """The keys this job's command line sets (`model` for `model=unet`), or None when not started
    by Hydra (a config composed by a script): then every value counts as given."""
    if not HydraConfig.initialized():
        return None
    return [arg.lstrip("+~").partition("=")[0] for arg in HydraConfig.get().overrides.task]


def take_card(cfg: DictConfig, card: Mapping[str, Any], ckpt: str) -> None:
    """Set `cfg`'s model and image size to the card's, unless the command line gave them: a given
    value that differs from the card's raises a `CheckpointError` naming the key."""
    given = given_keys()
    for key, card_key in CARD_KEYS:
        theirs = card.get(card_key)
        if theirs is None:  # a checkpoint older than cards
            continue
        ours = _value(cfg, key)
        if ours == theirs:
            continue
        if given is None or any(k == key or k.startswith(f"{key}.") for k in given):
            raise CheckpointError(
                f"{key}: {ckpt} was trained with {theirs}, not {ours}: leave {key} out to "
                "evaluate the checkpoint with its own"
            )
        if key == "model":  # arch, encoder_name and options, each replaced whole
            for name, value in theirs.items():
                cfg.model[name] = value
        else:
            OmegaConf.update(cfg, key, list(theirs), merge=False)


def _value(cfg: DictConfig, key: str) -> Any:
    if key == "model":
        return plain_model(cfg.model, "model")
    return OmegaConf.to_container(OmegaConf.select(cfg, key), resolve=True)
