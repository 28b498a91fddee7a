"""Toy tasks, training and the command line (layer 6).

  tasks        Vocab, Batch, the copy / reverse / sort generators, the held-out rule
  dates        the date-translation task (17 input formats -> ISO)
  sequences    a task as decoder-only sequences: one vocabulary, prompts, packed rows
  config       frozen config dataclasses, YAML loading and key.sub=value overrides
  train        model (encoder–decoder or decoder-only), optimiser, schedule, the jitted
               train step, greedy evaluation
  checkpoints  orbax checkpoints: the latest few and the best
  report       metrics.jsonl, progress lines, samples.txt, attention.png, curves.png
  cli          `train_toy.py` / `attnjax-train`: run(config, workdir) and main()
"""

from attnjax.toy.config import Config, ConfigError, load_config
from attnjax.toy.dates import DatesTask
from attnjax.toy.tasks import Batch, SequenceTask, Vocab


def make_task(config):
    """The task named by a `TaskConfig`: a `SequenceTask` or the `DatesTask`."""
    if config.name == "dates":
        return DatesTask()
    return SequenceTask(config.name, config.num_symbols, config.min_len, config.max_len)


__all__ = ["Batch", "Config", "ConfigError", "DatesTask", "SequenceTask", "Vocab", "load_config",
           "make_task"]
