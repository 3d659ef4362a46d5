"""Images + masks → npy + CSV. `python prepare.py input_dir=RAW output_dir=PREPARED`.
The checkout's name for `nailseg prepare` (nailseg/prepare.py)."""

from nailseg.__main__ import run

if __name__ == "__main__":
    run("prepare")
