"""Symmetric per-row quantisation of weights (int8, packed int4), on numpy or jax arrays.

Used by the serving layout (:mod:`jaxmtp.param_layout`) for the drafts' copy of the LM head and the int8 MTP layer;
the kernels that read these layouts are in :mod:`jaxmtp.pallas.matmul`.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxmtp.pallas.matmul.reference import INT4_BLOCK

DRAFT_HEAD_ROWS_PER_CHUNK = 8192  # quantise the head in slabs (bounds the float32 temporaries)


def array_module(a):
    """numpy for host arrays, jax.numpy for device arrays (the quantisers run where the weight is)."""
    return np if isinstance(a, np.ndarray) else jax.numpy


def _quantize_rows(w, qmax: int, transposed: bool, rows_per_chunk: int, pack=None):
    """Symmetric per-row quantisation to -qmax..qmax in slabs of rows (bounds the float32 temporaries):
    ``(pack(q) for each slab, concatenated; scale float32 [N])``."""
    xp = array_module(w)
    n = w.shape[1] if transposed else w.shape[0]
    qs, scales = [], []
    for start in range(0, n, rows_per_chunk):
        blk = w[:, start : start + rows_per_chunk].T if transposed else w[start : start + rows_per_chunk]
        blk = xp.asarray(blk, dtype=xp.float32)
        amax = xp.max(xp.abs(blk), axis=1)
        scale = xp.where(amax > 0, amax / qmax, 1.0).astype(xp.float32)
        q = xp.clip(xp.round(blk / scale[:, None]), -qmax, qmax)
        qs.append(pack(q) if pack else q.astype(xp.int8))
        scales.append(scale)
    return xp.concatenate(qs, axis=0), xp.concatenate(scales, axis=0)


def quantize_rows(w, *, transposed: bool = False, rows_per_chunk: int = DRAFT_HEAD_ROWS_PER_CHUNK):
    """Symmetric int8 per row: ``w [N, K]`` (or ``[K, N]`` with ``transposed``) -> (q int8 [N, K], scale float32
    [N]) with ``w ~= q * scale[:, None]``."""
    return _quantize_rows(w, 127, transposed, rows_per_chunk)


def quantize_rows_int4(w, *, transposed: bool = False, rows_per_chunk: int = DRAFT_HEAD_ROWS_PER_CHUNK):
    """Symmetric int4 per row, packed: ``w [N, K]`` (or ``[K, N]`` with ``transposed``) -> (uint8 [N, K/2], scale
    float32 [N]) with ``w ~= q * scale[:, None]``, q in -7..7 stored as :func:`jaxmtp.pallas.matmul.reference.unpack_int4` reads it. K must be a
    multiple of :data:`INT4_BLOCK`."""
    xp = array_module(w)
    k = w.shape[0] if transposed else w.shape[1]
    if k % INT4_BLOCK:
        raise ValueError(f"int4 packing needs K to be a multiple of {INT4_BLOCK}, got {k}")

    def pack(q):  # block b, byte j: column 128 b + j (low nibble) and 128 b + 64 + j (high), as q + 8
        u = (q + 8).astype(xp.uint8).reshape(q.shape[0], k // INT4_BLOCK, 2, INT4_BLOCK // 2)
        return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(q.shape[0], k // 2).astype(xp.uint8)

    return _quantize_rows(w, 7, transposed, rows_per_chunk, pack)


def quantize_fp8_blocks(w, *, block: int = 128):
    """Block FP8 as the official Qwen3.5 FP8 checkpoints store it: ``w [..., N, K]`` -> (e4m3 [..., N, K], float32
    scale [..., ceil(N/block), ceil(K/block)]) with ``w ~= q * scale`` of q's block: scale = absmax of the block /
    448 (1 for an all-zero block), q = w / scale rounded to nearest e4m3. Runs on numpy (host, through ml_dtypes) or
    jax arrays, block row by block row (bounds the float32 temporaries)."""
    from jaxmtp.pallas.matmul.reference import FP8_DTYPE, FP8_MAX

    xp = array_module(w)
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    qs, scales = [], []
    for r in range(nb):
        rows = xp.asarray(w[..., r * block : (r + 1) * block, :], dtype=xp.float32)
        pad = kb * block - k
        padded = xp.concatenate([rows, xp.zeros((*rows.shape[:-1], pad), xp.float32)], axis=-1) if pad else rows
        blocks = padded.reshape(*rows.shape[:-1], kb, block)
        amax = xp.max(xp.abs(blocks), axis=(-3, -1))  # [..., kb]
        scale = xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(xp.float32)
        per_col = xp.repeat(scale, block, axis=-1)[..., :k]
        q = xp.clip(rows / per_col[..., None, :], -FP8_MAX, FP8_MAX)
        qs.append(q.astype(FP8_DTYPE))
        scales.append(scale[..., None, :])
    return xp.concatenate(qs, axis=-2), xp.concatenate(scales, axis=-2)
