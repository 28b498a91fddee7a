"""Train a toy task: `python train_toy.py [--config copy] [--set key.sub=value]`.

The logic lives in `attnjax.toy.cli` (also installed as the `attnjax-train` command).
"""

import signal

if __name__ == "__main__":
    # Loading jax, flax and orbax takes seconds: a Ctrl-C or SIGTERM meanwhile is kept
    # for main to honour (exit 130/143, saying nothing was saved) rather than raised in
    # the middle of an import.
    early_signals = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: early_signals.append(signum))

    from attnjax.toy.cli import main

    raise SystemExit(main(early_signals=early_signals))
