"""LUT-mode MoLE inference: the step's LUT rows reach the device inside the pure forward
(Jie et al., ICML 2025, §3.3 / Fig. 1: the device holds the dense model plus the routers; each
token's ``L·N·d`` values come from where the LUT lives).

* ``with_lut_rows(model, rows_BTLND)`` / ``lut_forward(...)``: a LUT-mode model with one step's rows.
* ``serve_with_store(lut_model, store)``: one host callback per forward fetches the rows (RAM or a
  memory-mapped file); the one generation engine runs the model unchanged.
* ``serve_in_host_memory(lut_model, store)``: the LUT in the backend's host memory space
  (``pinned_host``); the compiled graph gathers the rows there (``compute_on("device_host")``) and
  moves only them to the device, with no Python round trip per step.
* ``serve_on_device(lut_model, lut)``: the whole LUT in device memory (no offloading).
Scope: the host-memory path was verified on XLA:CPU only, where both memory spaces are one RAM;
on GPU/TPU it is XLA's host-offload path, not yet run there. Figures: docs/experts.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.compute_on import compute_on

from pallasite.models.mole import LUTRows, mole_config_of
from pallasite.models.mole_lut import decode_payload

HOST_MEMORY_KIND = "pinned_host"


def with_lut_rows(model, rows_BTLND: jax.Array):
    """A copy of the LUT-mode ``model`` whose per-layer ``lut_rows`` hold ``rows [B, T, L, N, d]``
    (functional: split → replace the ``LUTRows`` leaves → merge; nothing is mutated, so it is
    valid inside any trace, e.g. the engine's ``while_loop`` body)."""
    cfg = model.cfg
    m = mole_config_of(cfg)
    if m.mode != "lut":
        raise ValueError("with_lut_rows: the model is not in LUT mode (mole.mode='lut'); "
                         "use models.mole_lut.to_lut_model")
    want = (cfg.n_layers, m.n_experts, cfg.d_model)
    if rows_BTLND.ndim != 5 or tuple(rows_BTLND.shape[2:]) != want:
        raise ValueError(f"with_lut_rows: rows have shape {tuple(rows_BTLND.shape)}, "
                         f"expected [B, T, {want[0]}, {want[1]}, {want[2]}]")
    graphdef, rows_state, rest = nnx.split(model, LUTRows, ...)
    new = []
    for path, var in nnx.to_flat_state(rows_state):
        if cfg.scan_layers:  # ('layers', 'ffn', 'lut_rows'): stacked over the layer axis
            value = jnp.moveaxis(rows_BTLND, 2, 0)
        else:  # ('layers', i, 'ffn', 'lut_rows')
            value = rows_BTLND[:, :, int(path[1])]
        new.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(new), rest)


def lut_forward(graphdef, state, rows_BTLND, tokens_BT, positions_BT=None, *, cache=None, segment_ids_BT=None):
    """Pure forward of a LUT-mode MoLE model: (float32 logits, cache, aux)."""
    model = with_lut_rows(nnx.merge(graphdef, state), rows_BTLND)
    return model(tokens_BT, positions_BT, cache=cache, segment_ids_BT=segment_ids_BT)


class LUTTable(nnx.Variable):
    """A whole LUT ``[V, L, N, d]`` held in the model state, i.e. in device memory (on a CPU
    backend that is host RAM, gathered without any host round trip). Not a parameter."""


class HostLUTArray(nnx.Variable):
    """One LUT array (the fp16 table, or NF codes / scales) placed in the backend's host memory
    space (memory kind ``pinned_host``). Not a parameter and not device-resident."""


@compute_on("device_host")
@jax.jit
def _gather_on_host(table_VX, ids_BT):
    """Runs in host memory next to the table (``ids`` are clipped by the caller: constants made
    by bounds handling here would land in device memory and fail to compile)."""
    return table_VX.at[ids_BT].get(mode="promise_in_bounds")


def host_memory_sharding(device=None, memory_kind: str = HOST_MEMORY_KIND):
    """``SingleDeviceSharding`` of ``device``'s host memory space; a clear error where the
    backend has none."""
    device = device or jax.devices()[0]
    kinds = [m.kind for m in device.addressable_memories()]
    if memory_kind not in kinds:
        raise ValueError(f"host-memory LUT serving needs memory kind {memory_kind!r}, but {device} "
                         f"({device.platform}) offers {kinds}; use serve_with_store (host callback) instead")
    return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


class LUTServing(nnx.Module):
    """A LUT-mode MoLE model that fetches its own rows: ``serve_with_store(lut_model, store)``.

    Called like the Transformer (``(tokens, positions, cache=, segment_ids=, return_hidden=)``,
    with ``cfg``, ``embed``, ``lm_head`` and ``head`` exposed), so the project's one generation engine
    (``inference.engine``: jitted prefill, ``while_loop`` decode) and ``models.forward`` run it
    unchanged. Per forward: ONE ``jax.pure_callback`` hands the token ids to the host, the store
    gathers exactly those tokens' rows for all layers (from RAM or the memory-mapped file) and
    returns them (NF-quantized stores return the packed codes + scales, unpacked on the device);
    then ``with_lut_rows`` and the wrapped model's forward. With ``host_arrays`` (see
    ``serve_in_host_memory``) the same rows come from an in-graph gather in host memory instead."""

    def __init__(self, lut_model, store=None, table=None, host_arrays=None, lut_meta=None):
        self.inner = lut_model
        self.store = store  # static attribute (identity-hashed): lives on the host, never on the device
        self.table = None if table is None else LUTTable(jnp.asarray(table))
        # host-memory serving keeps only the arrays (in host memory) and the table's metadata:
        # holding the numpy store as well would double the host RAM of a multi-GB LUT
        self.host_arrays = None if host_arrays is None else nnx.List([HostLUTArray(a) for a in host_arrays])
        self.lut_meta = lut_meta
        self.cfg = lut_model.cfg

    @property
    def embed(self):
        return self.inner.embed

    @property
    def lm_head(self):
        return self.inner.lm_head

    def head(self, h_BTD: jax.Array) -> jax.Array:
        return self.inner.head(h_BTD)

    def fetch_rows(self, tokens_BT: jax.Array) -> jax.Array:
        if self.table is not None:  # device-resident LUT: one in-graph gather
            return jnp.take(self.table[...], tokens_BT, axis=0)
        if self.host_arrays is not None:  # LUT in host memory: gather there, move only the rows
            # ids reaching here are valid (the engine checks prompts; sampled ids are < vocab);
            # clipping on the device keeps the host gather free of bounds logic
            ids = jnp.clip(tokens_BT.astype(jnp.int32), 0, self.cfg.vocab_size - 1)
            ids = jax.device_put(ids, jax.memory.Space.Host)
            payload = tuple(jax.device_put(_gather_on_host(a[...], ids), jax.memory.Space.Device)
                            for a in self.host_arrays)
            return decode_payload(self.lut_meta, payload)
        store = self.store
        payload = jax.pure_callback(store.host_fetch, store.payload_shapes(tokens_BT.shape),
                                    tokens_BT.astype(jnp.int32), vmap_method="sequential")
        return store.decode(payload)

    def __call__(self, tokens_BT, positions_BT=None, *, cache=None, segment_ids_BT=None, return_hidden=False):
        model = with_lut_rows(self.inner, self.fetch_rows(tokens_BT))
        return model(tokens_BT, positions_BT, cache=cache, segment_ids_BT=segment_ids_BT, return_hidden=return_hidden)


def serve_with_store(lut_model, store) -> LUTServing:
    """Check ``store`` against the LUT-mode model (shapes and fingerprint) and wrap them."""
    if mole_config_of(lut_model.cfg).mode != "lut":
        raise ValueError("serve_with_store: the model is not in LUT mode; use models.mole_lut.to_lut_model first")
    store.check_model(lut_model)
    return LUTServing(lut_model, store)


def serve_in_host_memory(lut_model, store, *, device=None, memory_kind: str = HOST_MEMORY_KIND) -> LUTServing:
    """Check ``store`` against the LUT-mode model, copy its arrays (fp16 table or NF codes +
    scales) into the host memory space of ``device`` and wrap them: the compiled forward gathers
    the step's rows in host memory and moves only those to the device (no host callback)."""
    if mole_config_of(lut_model.cfg).mode != "lut":
        raise ValueError("serve_in_host_memory: the model is not in LUT mode; use models.mole_lut.to_lut_model first")
    store.check_model(lut_model)
    sharding = host_memory_sharding(device, memory_kind)
    arrays = tuple(jax.device_put(np.asarray(a), sharding) for a in store.arrays)
    return LUTServing(lut_model, host_arrays=arrays, lut_meta=store.meta)


def host_resident_bytes(model) -> int:
    """Bytes of a serving model's arrays that live in host memory spaces (not device memory)."""
    state = nnx.state(model, HostLUTArray)
    return int(sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes")))


def serve_on_device(lut_model, lut_VLND) -> LUTServing:
    """The LUT kept in device memory (no offloading): the reference point that isolates the cost
    of the host round trip from MoLE's own compute. Device bytes grow by the whole table."""
    cfg = lut_model.cfg
    m = mole_config_of(cfg)
    want = (cfg.vocab_size, cfg.n_layers, m.n_experts, cfg.d_model)
    if m.mode != "lut" or tuple(lut_VLND.shape) != want:
        raise ValueError(f"serve_on_device: need a LUT-mode model and a LUT of shape {want}, got "
                         f"mode={m.mode!r}, LUT {tuple(lut_VLND.shape)}")
    return LUTServing(lut_model, None, lut_VLND)
