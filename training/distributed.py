"""Multi-process (multi-host) runtime for ``pallasite train``: start-up, data shares, host values.

* ``initialize(...)`` calls ``jax.distributed.initialize`` when the run is launched as several
  processes: explicitly (coordinator address, process count and id — flags of ``pallasite
  train`` or ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``), or from
  the environment of a launcher jax detects itself (a Cloud TPU slice with several workers,
  SLURM, Open MPI). CPU collectives use gloo, so several processes on one machine form one mesh.
* ``global_batch(rows_fn, shardings, batch_size)`` builds the global batch arrays from the rows
  this process's devices hold only (``rows_fn(start, stop)`` materialises just those rows), so
  no process copies another's share; in one process it is a plain ``device_put``.
* ``host_value(tree)`` pulls arrays to numpy on every process: a replicated array from a local
  shard, a sharded one by an all-gather (``multihost_utils.process_allgather``).
* ``is_main()``: process 0 writes logs, metrics, TensorBoard, the HF export and result files;
  every process takes part in steps and orbax checkpoints.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import jax
import numpy as np

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _launched_as_many_processes() -> bool:
    """A launcher jax's cluster detection understands, with more than one process."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts:
        return True
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(os.environ.get(var, "1") or 1) > 1:
            return True
    return False


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, local_device_ids=None) -> bool:
    """Join the multi-process runtime if launched that way; returns whether it did. Must run
    before anything touches a jax backend."""
    coordinator_address = coordinator_address or os.environ.get(_ENV[0]) or None
    if num_processes is None and os.environ.get(_ENV[1]):
        num_processes = int(os.environ[_ENV[1]])
    if process_id is None and os.environ.get(_ENV[2]):
        process_id = int(os.environ[_ENV[2]])
    if coordinator_address is None and (num_processes is not None or process_id is not None):
        raise ValueError("multi-process run: --num-processes/--process-id need --coordinator HOST:PORT "
                         f"(or {_ENV[0]})")
    if coordinator_address is None and not _launched_as_many_processes():
        return False
    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise ValueError(f"multi-process run with coordinator {coordinator_address!r}: give both "
                         f"--num-processes and --process-id (got {num_processes}, {process_id})")
    if coordinator_address is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} must be in [0, --num-processes={num_processes})")
    # CPU collectives across processes (ignored by accelerator backends)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw = {} if local_device_ids is None else {"local_device_ids": local_device_ids}
    if os.environ.get("PALLASITE_HEARTBEAT_TIMEOUT_S"):  # a loaded CI box: more than jax's 100 s
        kw["heartbeat_timeout_seconds"] = int(os.environ["PALLASITE_HEARTBEAT_TIMEOUT_S"])
    if coordinator_address is None:
        jax.distributed.initialize(**kw)
    else:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=int(num_processes),
                                   process_id=int(process_id), **kw)
    return True


def is_main() -> bool:
    return jax.process_index() == 0


def local_rows(sharding, global_shape) -> tuple[int, int]:
    """[start, stop) of the leading (batch) dimension held by this process's devices."""
    idx = sharding.addressable_devices_indices_map(tuple(global_shape))
    starts, stops = [], []
    for index in idx.values():
        s = index[0] if index else slice(None)
        start, stop, _ = s.indices(global_shape[0])
        starts.append(start)
        stops.append(stop)
    return min(starts), max(stops)


def global_batch(rows_fn: Callable[[int, int], dict], shardings: dict, batch_size: int) -> dict:
    """{key: global array}; this process's rows come from ``rows_fn(start, stop)`` (a dict of
    numpy arrays [stop - start, ...]) alone. All keys share the batch sharding's row split."""
    if jax.process_count() == 1:
        rows = rows_fn(0, batch_size)
        return {k: jax.device_put(np.asarray(rows[k]), shardings[k]) for k in shardings}
    first = next(iter(shardings.values()))
    lo, hi = local_rows(first, (batch_size,))
    rows = rows_fn(lo, hi)
    out = {}
    for k, sharding in shardings.items():
        local = np.asarray(rows[k])
        shape = (batch_size, *local.shape[1:])
        arrays = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            start, stop, _ = index[0].indices(batch_size)
            arrays.append(jax.device_put(local[(slice(start - lo, stop - lo), *index[1:])], device))
        out[k] = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return out


def host_value(tree):
    """numpy copies of every array leaf, on every process (collective when sharded)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


__all__ = ["initialize", "is_main", "local_rows", "global_batch", "host_value", "barrier"]
