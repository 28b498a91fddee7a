"""A training run reduced to its losses, for the tests of sharded training; also run as
one of several processes (`python -m tests.training_run CONFIG MESH COORDINATOR N ID`),
which prints its losses as JSON."""

import json
import sys

import numpy as np


def losses(config, mesh) -> np.ndarray:
    """The loss of each of config.steps train steps on mesh (no evaluation, no files)."""
    import jax

    from attnjax.toy import make_task
    from attnjax.toy import train as training

    task = make_task(config.task)
    model = training.make_model(config, task)
    optimizer = training.make_optimizer(config.optim, config.steps)
    state = training.init_state(model, optimizer, task, config.seed, mesh)
    step = training.make_train_step(model, optimizer, config.optim, config.steps, config.seed,
                                    state, mesh)
    per_step = []
    for i in range(config.steps):
        state, metrics = step(state, training.train_batch(task, config, i, mesh))
        per_step.append(metrics["loss"])
    return np.asarray(jax.device_get(per_step), np.float64)


def main(config_path: str, mesh: str, coordinator: str, num_processes: str,
         process_id: str) -> None:
    import jax

    # jax.distributed first: nothing may touch a device before it
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, int(num_processes), int(process_id))
    from attnjax.parallel import mesh as mesh_lib
    from attnjax.toy.config import load_config

    run = losses(load_config(config_path), mesh_lib.make_mesh(mesh_lib.parse_mesh(mesh)))
    print(json.dumps(run.tolist()))


if __name__ == "__main__":
    main(*sys.argv[1:])
