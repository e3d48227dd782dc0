"""GPTQ weight quantization (Frantar et al., ICLR 2023), as used by FlatQuant's "-GPTQ" rows and
QuaRot: quantize the input dimension column by column and push each column's rounding error
onto the not-yet-quantized columns through the inverse Hessian ``H = 2 XᵀX / n`` of the layer's
calibration inputs.

Defaults follow the official GPTQ/FlatQuant code: symmetric per-output-channel scale computed
once from the full weight before the sweep (``max(|w|)/7``), dampening ``0.01 · mean(diag H)``,
lazy-batch blocks of 128, dead inputs (``H_ii = 0``) zeroed, no activation reordering
(``act_order`` off). Runs offline in float64 numpy. Weights are in our ``[in, out]`` layout.
"""

from __future__ import annotations

import numpy as np


def hessian_from_inputs(x_NI: np.ndarray) -> np.ndarray:
    x = np.asarray(x_NI, np.float64).reshape(-1, x_NI.shape[-1])
    return 2.0 * x.T @ x / max(1, x.shape[0])


def gptq_quantize(
    w_IO: np.ndarray,
    H_II: np.ndarray,
    *,
    bits: int = 4,
    blocksize: int = 128,
    percdamp: float = 0.01,
    scale_O: np.ndarray | None = None,
):
    """Returns (q int8 [in, out] in [-2^(b-1), 2^(b-1)-1], scale [out]) minimising ‖X(W − Ŵ)‖²."""
    W = np.asarray(w_IO, np.float64).T.copy()  # [out, in] rows = output channels, as in GPTQ
    H = np.asarray(H_II, np.float64).copy()
    n_in = W.shape[1]
    if H.shape != (n_in, n_in):
        raise ValueError(
            f"gptq_quantize: Hessian shape {H.shape} does not match the weight's input dim {n_in}"
        )
    qmax = 2 ** (bits - 1) - 1
    qmin = -qmax - 1
    if scale_O is None:
        amax = np.maximum(np.abs(np.minimum(W.min(1), 0)), np.maximum(W.max(1), 0))
        scale = np.maximum(amax, 1e-5) / qmax
    else:
        scale = np.asarray(scale_O, np.float64)
    dead = np.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H[np.diag_indices(n_in)] += percdamp * np.mean(np.diag(H))
    try:
        Hinv = np.linalg.cholesky(np.linalg.inv(H)).T  # upper Cholesky factor of H^{-1}
    except np.linalg.LinAlgError as e:
        raise ValueError("gptq_quantize: the dampened Hessian is not positive definite") from e
    Q = np.zeros_like(W)
    for i1 in range(0, n_in, blocksize):
        i2 = min(i1 + blocksize, n_in)
        W1 = W[:, i1:i2].copy()
        Err1 = np.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            d = Hinv1[i, i]
            q = np.clip(np.round(w / scale), qmin, qmax)
            Q[:, i1 + i] = q
            err = (w - q * scale) / d
            W1[:, i:] -= np.outer(err, Hinv1[i, i:])
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q.T.astype(np.int8), scale
