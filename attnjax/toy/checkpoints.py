"""Orbax checkpoints of a run: the latest few, and the best by exact-match accuracy.

Each checkpoint holds the `TrainState` and a small JSON record (the metrics of a
partly logged window, the best score so far). Orbax writes a step to a temporary
directory and renames it when complete, so a process killed while saving leaves the
previous checkpoints intact and the unfinished one invisible.
"""

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

BEST_METRIC = "exact_match"


class Checkpoints:
    """`save(step, state, record, exact_match=None)` and `restore_latest(template)`."""

    def __init__(self, directory: Path, keep: int):
        best = checkpoint_managers.BestN(get_metric_fn=lambda metrics: metrics[BEST_METRIC], n=1,
                                         keep_checkpoints_without_metrics=False)
        policy = checkpoint_managers.AnyPreservationPolicy(
            [checkpoint_managers.LatestN(n=keep), best])
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(), item_names=("state", "record"),
            options=ocp.CheckpointManagerOptions(preservation_policy=policy))

    def save(self, step: int, state, record: dict, exact_match: float | None = None) -> None:
        """Starts writing step (in the background); the arrays are copied first."""
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          record=ocp.args.JsonSave(record)),
            metrics=None if exact_match is None else {BEST_METRIC: exact_match}, force=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, template):
        """`(step, state, record)` of the latest checkpoint, or None when there is none.

        template is a state of the right structure (shapes and dtypes are read from it).
        """
        step = self.manager.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()))
        return step, restored["state"], restored["record"]

    def close(self) -> None:
        """Waits for the last save to be complete on disk."""
        self.manager.wait_until_finished()
        self.manager.close()
