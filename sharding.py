"""Mesh construction and logical-axis sharding rules.

Model code names *logical* axes on every parameter (``logical_axes`` metadata: batch, seq,
embed, q_heads, kv_heads, head_dim, mlp, vocab, expert, layers, norm). A rule table — a tuple
of ``(logical_axis, mesh_axes)`` pairs, overridable from the config — maps them onto the mesh
axes ``data, fsdp, tensor, expert``. Any mesh axis may have size 1. A dimension whose size is
not divisible by its mesh axes is replicated instead, so tiny
test models run on any mesh.

``shard_map`` is reserved for code where communication is the algorithm (MoE dispatch);
everything else is plain ``jax.jit`` with ``in_shardings``/``out_shardings`` from here, plus
``constrain(x, logical_axes)`` on activations (as MaxText's logical constraints): without it,
XLA may shard an FSDP matmul on its contracting dimension and all-reduce replicated
activations instead of gathering the weights (a whole-batch [B, T, F] on every chip).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterable, Mapping, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Activations: batch over data × fsdp (× expert: experts are data-parallel outside MoE layers).
# Weights: FSDP on the embed dimension, tensor parallelism on heads / mlp / vocab.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("seq", None),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("layers", None),
    ("norm", None),
    ("act_embed", None),  # the model dimension of activations (weights' "embed" is FSDP-sharded)
)


def make_mesh(shape: Mapping[str, int] | Sequence[int] | None = None, devices=None) -> Mesh:
    """Mesh with axes (data, fsdp, tensor, expert). ``shape`` maps axis → size; a size of -1
    takes the remaining devices. Axis types are Auto so plain arrays can enter jit/shard_map."""
    devices = list(jax.devices() if devices is None else devices)
    if shape is None:
        shape = {"data": -1}
    if not isinstance(shape, Mapping):
        shape = dict(zip(MESH_AXES, shape))
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh: unknown axis name(s) {unknown}; expected a subset of {MESH_AXES}")
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices are not divisible by the fixed axes' product {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    total = math.prod(sizes)
    if total > len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {total} devices, only {len(devices)} available")
    arr = np.asarray(devices[:total]).reshape(sizes)
    return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def rules_from_config(rules: Optional[Iterable] = None) -> tuple[tuple[str, Any], ...]:
    """Normalise a rule table (list of pairs or mapping) and let it override the defaults."""
    table = dict(DEFAULT_RULES)
    if rules:
        items = rules.items() if isinstance(rules, Mapping) else rules
        for name, axes in items:
            if isinstance(axes, list):
                axes = tuple(axes)
            for a in (axes if isinstance(axes, tuple) else (axes,)):
                if a is not None and a not in MESH_AXES:
                    raise ValueError(f"sharding rule {name!r} -> {axes!r}: {a!r} is not a mesh axis {MESH_AXES}")
            table[name] = axes
    return tuple(table.items())


def _mesh_axes_for(name: Optional[str], rules) -> tuple[str, ...]:
    if name is None:
        return ()
    table = dict(rules)
    if name not in table:
        raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(table)}")
    axes = table[name]
    if axes is None:
        return ()
    return axes if isinstance(axes, tuple) else (axes,)


def logical_to_spec(logical_axes: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh, rules) -> P:
    """PartitionSpec for an array of ``shape`` whose dims are named ``logical_axes``.

    Mesh axes of size 1, axes already used by an earlier dim, and axes that do not divide the
    dim are dropped (the dim is then replicated over them)."""
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical_axes, shape):
        chosen = []
        size = 1
        for a in _mesh_axes_for(name, rules):
            n = mesh.shape[a]
            if n == 1 or a in used or dim % (size * n):
                continue
            chosen.append(a)
            size *= n
        used.update(chosen)
        spec.append(None if not chosen else (chosen[0] if len(chosen) == 1 else tuple(chosen)))
    return P(*spec)


_ACTIVATION_RULES: contextvars.ContextVar = contextvars.ContextVar("pallasite_activation_rules", default=None)


@contextlib.contextmanager
def activation_rules(rules):
    """Use ``rules`` for ``constrain`` while tracing inside this block (default: DEFAULT_RULES)."""
    token = _ACTIVATION_RULES.set(tuple(rules))
    try:
        yield
    finally:
        _ACTIVATION_RULES.reset(token)


def _active_rules():
    return _ACTIVATION_RULES.get() or DEFAULT_RULES


def constrain(x: jax.Array, logical_axes: Sequence[Optional[str]]) -> jax.Array:
    """``with_sharding_constraint`` of an activation by logical axis names, on the ambient mesh
    (``jax.set_mesh``). A no-op without a multi-device pallasite mesh, and inside ``shard_map``
    (manual axes), so model code calls it unconditionally."""
    mesh = ambient_mesh()
    if mesh is None:
        return x
    rules = _active_rules()
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh, rules))


def ambient_mesh():
    """The multi-device pallasite mesh set by ``jax.set_mesh`` that auto-partitioned code runs
    on, or None (no mesh, one device, another library's mesh, or inside ``shard_map``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1 or not set(MESH_AXES) <= set(mesh.axis_names):
        return None
    if any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
        return None
    return mesh


def batch_shards(batch_size: int) -> int:
    """How many shards a batch dim of ``batch_size`` rows has on the ambient mesh (1 without)."""
    mesh = ambient_mesh()
    if mesh is None:
        return 1
    rules = _active_rules()
    spec = logical_to_spec(("batch",), (batch_size,), mesh, rules)[0]
    return math.prod(mesh.shape[a] for a in ((spec,) if isinstance(spec, str) else (spec or ())))


def per_shard(fn, args: Sequence[jax.Array], arg_axes: Sequence[Sequence[Optional[str]]],
              out_axes: Sequence[Optional[str]]):
    """``fn(*args)`` for an opaque kernel (a ``pallas_call``: XLA cannot partition it and would
    gather every input whole onto each chip), run per shard with ``shard_map``. Each arg's dims
    are named by logical axes and sharded by the active rules; ``fn`` must be independent across
    those dims (no communication: batch rows, attention heads). Mesh axes that do not divide
    *every* array dim of a logical axis are dropped for that axis, so all args agree."""
    mesh = ambient_mesh()
    if mesh is None:
        return fn(*args)
    rules = _active_rules()
    dims: dict[str, int] = {}  # per logical name, the gcd of its dims: what every one of them divides
    for axes, x in zip(arg_axes, args):
        for name, dim in zip(axes, x.shape):
            if name is not None:
                dims[name] = math.gcd(dims.get(name, 0), int(dim))
    chosen = dict(zip(dims, logical_to_spec(tuple(dims), tuple(dims.values()), mesh, rules)))

    def spec(axes):
        return P(*[None if n is None else chosen[n] for n in axes])

    if not any(v is not None for v in chosen.values()):
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(a) for a in arg_axes), out_specs=spec(out_axes),
                         check_vma=False)(*args)


def _value(var: nnx.Variable):
    # get_value() also works for abstract state (ShapeDtypeStruct leaves), which var[...] does not.
    return var.get_value()


def _variable_axes(var: nnx.Variable) -> tuple:
    axes = tuple(var.get_metadata().get("logical_axes", ()))
    ndim = len(np.shape(_value(var)))
    if len(axes) < ndim:  # stacked (scanned) layers, or metadata missing: leading dims replicated
        axes = ("layers",) * (ndim - len(axes)) + axes
    return axes[:ndim]


def state_shardings(state: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    """A pytree of NamedSharding matching ``state`` (an nnx.State or any pytree of Variables)."""

    def one(x):
        if isinstance(x, nnx.Variable):
            value = _value(x)
            return NamedSharding(mesh, logical_to_spec(_variable_axes(x), value.shape, mesh, rules))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_state(state: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
    return jax.device_put(state, state_shardings(state, mesh, rules))


def batch_spec(mesh: Mesh, rules=DEFAULT_RULES, ndim: int = 2, batch_size: Optional[int] = None) -> P:
    axes = [a for a in _mesh_axes_for("batch", rules) if mesh.shape[a] > 1]
    if batch_size is not None:
        kept, size = [], 1
        for a in axes:
            if batch_size % (size * mesh.shape[a]) == 0:
                kept.append(a)
                size *= mesh.shape[a]
        axes = kept
    first = None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))
    return P(first, *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES, ndim: int = 2, batch_size: Optional[int] = None) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh, rules, ndim, batch_size))
