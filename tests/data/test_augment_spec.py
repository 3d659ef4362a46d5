"""The augmentation spec refuses, when it is built (before any batch), parameters that one backend
would run and another fail on mid-epoch, naming the op and the key."""

from __future__ import annotations

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig
from support.loaders import spec_from
from support.train import CONF, compose_train

from nailseg.data.augment import AugSpec


def _spec(cfg: DictConfig) -> AugSpec:
    """The spec `build` makes of a composed config: `aug` with `normalize`'s statistics."""
    return instantiate(cfg.aug, mean=cfg.normalize.mean, std=cfg.normalize.std, _convert_="all")


@pytest.mark.parametrize("sigma", [[0.0, 0.0], [0.0, 1.0], [-1.0, 1.0]])
def test_gaussian_blur_needs_a_sigma_above_0(sigma: list[float]) -> None:
    # Kornia and DALI fail on a sigma of 0 at their first batch; torch would blur by nothing
    with pytest.raises(ValueError, match=r"op 'gaussian_blur': sigma=\[.*\] must lie within"):
        spec_from([{"op": "gaussian_blur", "p": 1.0, "sigma": sigma}])
    ops = f"aug.ops=[{{op: gaussian_blur, p: 1.0, sigma: [{sigma[0]}, {sigma[1]}]}}]"
    with pytest.raises(InstantiationException, match=r"'gaussian_blur': sigma="):
        _spec(compose_train([ops]))


@pytest.mark.slow
def test_a_small_blur_and_every_aug_yaml_are_accepted() -> None:
    (op,) = spec_from([{"op": "gaussian_blur", "p": 1.0, "sigma": [1e-3, 2.0]}]).ops
    assert op.ranges["sigma"] == (1e-3, 2.0)
    for path in sorted((CONF / "aug").glob("*.yaml")):
        assert isinstance(_spec(compose_train([f"aug={path.stem}"])), AugSpec)
