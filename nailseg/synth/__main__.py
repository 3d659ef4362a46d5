"""`python -m nailseg.synth out=DIR [n=200] [seed=0] [num_workers=0]`: a synthetic set on its own
(prepare.py makes one by itself for dataset=synthetic)."""

from nailseg.synth.scene import main

if __name__ == "__main__":  # not again in a spawned worker, which imports this module
    main()
