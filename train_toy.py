"""Train a toy task: `python train_toy.py [--config configs/copy.yaml] [--set key.sub=value]`.

The logic lives in `attnjax.toy.cli` (also installed as the `attnjax-train` command).
"""

from attnjax.toy.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
