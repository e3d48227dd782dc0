"""Training checkpoints with orbax: one ``CheckpointManager`` per run directory.

Each step directory holds three items: ``state`` (the train-state pytree: step, params, optimizer
state, other variables — ``StandardSave``), ``data`` (the data iterator's JSON state: the next
batch to read) and ``config`` (the experiment config as JSON). Saves are asynchronous (the
arrays are copied off the device, then written in a background thread while training goes on);
``max_to_keep`` prunes old steps; only committed steps count as ``latest_step`` — a process
killed during a write resumes from the previous complete checkpoint.

Restore goes onto an *abstract* state (``ShapeDtypeStruct`` with shardings, from
``training.step.abstract_train_state``), so a checkpoint written on one mesh is read straight
into the shardings of the current one; a shape mismatch is reported naming the tensor.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from pallasite.errors import ResumeError

ITEMS = ("state", "data", "config")


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
        self.directory = directory if "://" in str(directory) else os.path.abspath(directory)  # gs://
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, config_json: dict, *, force: bool = True) -> bool:
        return self.manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                                    config=ocp.args.JsonSave(config_json)),
            force=force,
        )

    def saved_config(self, step: int) -> dict:
        """The experiment config saved with ``step`` (read alone: no state, no shapes to match)."""
        args = ocp.args.Composite(config=ocp.args.JsonRestore())
        out = self.manager.restore(int(step), args=args)
        return dict(out["config"])

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, dict]:
        """(state with the abstract state's shardings, data-iterator state, config dict)."""
        try:
            out = self.manager.restore(
                int(step),
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
                                        config=ocp.args.JsonRestore()),
            )
        except (ValueError, KeyError) as e:
            raise ResumeError(f"checkpoint {self.directory}/{step} does not match the model being trained "
                             f"(different config?): {e}") from e
        _check_shapes(abstract_state, out["state"])
        return out["state"], dict(out["data"]), dict(out["config"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _check_shapes(expected: Any, restored: Any) -> None:
    exp = dict(jax.tree_util.tree_leaves_with_path(expected))
    got = dict(jax.tree_util.tree_leaves_with_path(restored))
    for path, e in exp.items():
        name = jax.tree_util.keystr(path)
        if path not in got:
            raise ResumeError(f"checkpoint is missing tensor {name} (expected shape {tuple(e.shape)})")
        if tuple(got[path].shape) != tuple(e.shape):
            raise ResumeError(f"checkpoint tensor {name} has shape {tuple(got[path].shape)}, expected {tuple(e.shape)}")


__all__ = ["Checkpointer", "ITEMS"]
