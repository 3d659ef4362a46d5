"""Train a nail segmentation model. `python train.py model=segformer aug=heavy`; `-m` sweeps.
The checkout's name for `nailseg train` (nailseg/train.py)."""

from nailseg.__main__ import run

if __name__ == "__main__":
    run("train")
