"""Communication accounting for expert-parallel dispatch (Occult, Luo et al., ICML 2025).

Everything is computed from an actual routing (selected experts per token), never assumed:

* ``CT`` — mean number of distinct destination devices per token (Occult's "communication
  times"); bounds ``ceil(k·N_d/N_e) ≤ CT ≤ min(k, N_d)`` are checked by ``check_ct_bounds``.
* rows sent **off-device** by the dispatch all-to-all (and the same number back by the
  combine): standard EP sends one row per (token, expert) pair whose expert lives on another
  device than the token; Occult sends one row per (token, other device) pair.
* bytes = rows × (d_model × activation bytes) for the payload, plus the routing metadata the
  receiver needs (standard: one int32 local-expert id per row; Occult: per row, S =
  min(k, E_loc) int32 ids and S float32 gate weights), both directions (the combine returns
  one activation row per dispatched row, no metadata).

Tokens live on the device that holds their batch shard: with ``N`` tokens split evenly over
``N_d`` devices in order, token n sits on device ``n // (N / N_d)``. That is how the
``shard_map`` in ``moe_dispatch.py`` places them when the batch is sharded over ``expert``.
A ragged transport would send exactly these rows; the CPU path pads its buffers to a static
worst case (see ``buffer_rows``), which is also reported.
"""

from __future__ import annotations

import math

import numpy as np


def devices_of(experts_NK, num_experts: int, num_devices: int) -> np.ndarray:
    return np.asarray(experts_NK) // (num_experts // num_devices)


def communication_times(experts_NK, num_experts: int, num_devices: int, keep_NK=None) -> float:
    """CT: mean number of distinct devices among each token's (kept) experts."""
    dev = devices_of(experts_NK, num_experts, num_devices)
    keep = np.ones(dev.shape, bool) if keep_NK is None else np.asarray(keep_NK, bool)
    present = np.zeros((dev.shape[0], num_devices), bool)
    rows = np.repeat(np.arange(dev.shape[0]), dev.shape[1]).reshape(dev.shape)
    present[rows[keep], dev[keep]] = True
    return float(present.sum(axis=1).mean())


def ct_bounds(top_k: int, num_experts: int, num_devices: int) -> tuple[int, int]:
    return int(math.ceil(top_k * num_devices / num_experts)), min(top_k, num_devices)


def check_ct_bounds(ct: float, top_k: int, num_experts: int, num_devices: int) -> None:
    lo, hi = ct_bounds(top_k, num_experts, num_devices)
    if not (lo - 1e-9 <= ct <= hi + 1e-9):
        raise AssertionError(f"CT={ct} outside [ceil(k·N_d/N_e)={lo}, min(k, N_d)={hi}]")


def communication_stats(experts_NK, *, num_experts: int, num_devices: int, d_model: int, act_bytes: int = 4,
                        keep_NK=None, token_device_N=None) -> dict:
    """Rows and bytes moved off-device per layer (dispatch + combine) for standard and Occult."""
    e = np.asarray(experts_NK)
    N, K = e.shape
    E_loc = num_experts // num_devices
    S = min(K, E_loc)
    keep = np.ones(e.shape, bool) if keep_NK is None else np.asarray(keep_NK, bool)
    if token_device_N is None:
        if N % num_devices:
            raise ValueError(f"{N} tokens do not split evenly over {num_devices} devices; pass token_device_N")
        token_device_N = np.arange(N) // (N // num_devices)
    src = np.asarray(token_device_N)[:, None]
    dev = e // E_loc
    off = keep & (dev != src)
    std_rows = int(off.sum())
    present = np.zeros((N, num_devices), bool)
    rows_idx = np.repeat(np.arange(N), K).reshape(N, K)
    present[rows_idx[keep], dev[keep]] = True
    present_off = present.copy()
    present_off[np.arange(N), np.asarray(token_device_N)] = False
    occ_rows = int(present_off.sum())
    row_bytes = d_model * act_bytes
    std_bytes = 2 * std_rows * row_bytes + std_rows * 4
    occ_bytes = 2 * occ_rows * row_bytes + occ_rows * S * 8
    ct = float(present.sum(axis=1).mean())
    return {
        "tokens": N,
        "ct": ct,
        "ct_bounds": ct_bounds(K, num_experts, num_devices),
        "rows_standard": std_rows,
        "rows_occult": occ_rows,
        "bytes_standard": std_bytes,
        "bytes_occult": occ_bytes,
        "bytes_reduction_occult": 1.0 - occ_bytes / max(std_bytes, 1),
    }


def padded_buffer_bytes(n_tokens: int, top_k: int, num_experts: int, num_devices: int, d_model: int,
                        mode: str, act_bytes: int = 4) -> int:
    """Bytes a device sends off-device through the static-shape CPU all-to-all (dispatch + combine)."""
    E_loc = num_experts // num_devices
    n_loc = n_tokens // num_devices
    rows = n_loc * (min(top_k, E_loc) if mode == "standard" else 1)
    per_row = 2 * d_model * act_bytes + (4 if mode == "standard" else min(top_k, E_loc) * 8)
    return num_devices * (num_devices - 1) * rows * per_row
