"""Settings that used to pass silently or fail late: a misspelt architecture option, a warm-up as
long as the whole schedule, a CUDA device on a machine without one, the `+` an option needs."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from nailseg.config import CONF_DIR
from nailseg.device import resolve_device
from nailseg.model.net import build_net
from nailseg.model.schedules import WarmupCosineLR


@pytest.mark.parametrize(
    ("arch", "decoder"), [("Unet", {"decoder_channels": [16, 8, 4]}), ("Segformer", {})]
)
def test_a_misspelt_architecture_option_is_refused_naming_it(arch: str, decoder: dict) -> None:
    # smp drops a keyword the encoder does not take: this trained the default depth
    with pytest.raises(
        ValueError, match=rf"^model\.options\.encoder_dept=3: .*not an argument {arch}"
    ):
        build_net(arch, "resnet18", options={"encoder_dept": 3, **decoder})
    net = build_net(arch, "resnet18", options={"encoder_depth": 3, **decoder})
    assert len(net.encoder.out_channels) == 4  # the input and 3 stages: the option reached it


@pytest.mark.parametrize(("steps", "fraction"), [(10, 0.95), (20, 0.98), (100, 0.05), (1, 0.5)])
def test_warmup_cosine_ends_at_its_minimum_whatever_the_warmup(steps: int, fraction: float):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = WarmupCosineLR(
        optimizer, total_steps=steps, warmup_fraction=fraction, min_lr_ratio=0.1
    )
    assert schedule.factor(steps - 1) == pytest.approx(0.1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("name", ["gpu", "cuda", "cuda:0", "cuda:7"])
def test_a_cuda_device_torch_does_not_see_is_refused_naming_the_setting(name: str) -> None:
    with pytest.raises(ValueError, match=rf"device='{name}': torch sees no CUDA device"):
        resolve_device(name)


def test_an_architecture_option_composes_with_a_plus_as_the_model_files_say() -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["+model.options.encoder_depth=4"])
        assert cfg.model.options.encoder_depth == 4
        with pytest.raises(ConfigCompositionException, match="encoder_depth"):
            compose("train", overrides=["model.options.encoder_depth=4"])
