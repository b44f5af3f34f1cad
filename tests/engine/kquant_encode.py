"""Plain K-quant encoders for tests (the gguf package writes no K-quant): Q4_K, Q5_K and Q6_K
blocks in ggml's layout, with min/max scales (llama.cpp's quantizer searches better ones; the
layout, which is what the loader and the kernels read, is the same). Checked by decoding with
the gguf package (tests/engine/test_kquant_model.py)."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(a.shape[0], 2)


def _scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and minimums a block -> ggml's 12 bytes (the inverse of gguf's
    Q4_K.get_scale_min)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _k_codes(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[B, 256] -> (codes [B, 8, 32] in 0..levels-1, d|dmin fp16 bytes [B, 4], scales [B, 12])."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    step = np.maximum((sub.max(axis=2) - lo) / (levels - 1), 1e-8)
    d = (step.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (np.maximum(-lo.min(axis=1), 1e-8) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(step / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.ceil(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    scale = d[:, None] * sc
    minimum = dmin[:, None] * mn
    q = np.rint((sub + minimum[:, :, None]) / scale[:, :, None])
    codes = np.clip(q, 0, levels - 1).astype(np.uint8)
    head = np.concatenate([_f16(d), _f16(dmin)], axis=1)
    return codes, head, _scale_bytes(sc, mn)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> Q4_K rows [N, K / 256 * 144]."""
    n = w.shape[0]
    codes, head, scales = _k_codes(w.reshape(-1, QK_K), 16)
    pairs = codes.reshape(-1, 4, 2, 32)  # chunk c: sub-blocks 2c (low nibble), 2c+1 (high)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, scales, qs], axis=1).reshape(n, -1)


def encode_q5_k(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> Q5_K rows [N, K / 256 * 176]."""
    n = w.shape[0]
    codes, head, scales = _k_codes(w.reshape(-1, QK_K), 32)
    low = codes & 0x0F
    pairs = low.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    bits = (codes >> 4).reshape(-1, 8, 32)  # sub-block j's 5th bits: bit j of qh[l]
    qh = np.zeros((bits.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= bits[:, j] << j
    return np.concatenate([head, scales, qh, qs], axis=1).reshape(n, -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [N, K] -> Q6_K rows [N, K / 256 * 210]."""
    n = w.shape[0]
    sub = w.reshape(-1, 16, 16)
    step = np.maximum(np.abs(sub).max(axis=2) / 31, 1e-8)
    d = (step.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(step / d[:, None]), 1, 127).astype(np.int8)
    scale = d[:, None] * sc
    q = np.clip(np.rint(sub / scale[:, :, None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # [B, half, quarter, l]
    lo = q & 0x0F
    ql = np.concatenate(
        [lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2
    )
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    rows = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)]
    return np.concatenate(rows, axis=1).reshape(n, -1)
