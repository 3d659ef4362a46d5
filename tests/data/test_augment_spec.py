"""The augmentation spec refuses, when it is built (before any batch), parameters that one backend
would run and another fail on mid-epoch, naming the op and the key."""

from __future__ import annotations

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from support.train import CONF, compose_train

from nailseg.data.augment import AugSpec


@pytest.mark.parametrize("sigma", [[0.0, 0.0], [0.0, 1.0], [-1.0, 1.0]])
def test_gaussian_blur_needs_a_sigma_above_0(sigma: list[float]) -> None:
    # Kornia and DALI fail on a sigma of 0 at their first batch; torch would blur by nothing
    with pytest.raises(ValueError, match=r"op 'gaussian_blur': sigma=\[.*\] must lie within"):
        AugSpec.from_config([{"op": "gaussian_blur", "p": 1.0, "sigma": sigma}])
    ops = f"aug.ops=[{{op: gaussian_blur, p: 1.0, sigma: [{sigma[0]}, {sigma[1]}]}}]"
    with pytest.raises(InstantiationException, match=r"'gaussian_blur': sigma="):
        instantiate(compose_train([ops]).aug)


def test_a_small_blur_and_every_aug_yaml_are_accepted() -> None:
    (op,) = AugSpec.from_config([{"op": "gaussian_blur", "p": 1.0, "sigma": [1e-3, 2.0]}]).ops
    assert op.ranges["sigma"] == (1e-3, 2.0)
    for path in sorted((CONF / "aug").glob("*.yaml")):
        assert isinstance(instantiate(compose_train([f"aug={path.stem}"]).aug), AugSpec)
