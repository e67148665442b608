"""Attention over the KV carry for TPU (Pallas, Mosaic lowering): flash attention with GQA packing.

Query rows are packed as in :mod:`decode_triton` (row ``t * G + j``). Grid ``(B, Hkv, row blocks, kv blocks)`` with
the kv axis sequential and the online-softmax state in VMEM scratch. The number of valid kv rows of each row block,
``max(position) + 1``, is scalar-prefetched: the K/V index maps clamp to the last valid block (the pipeline does not
refetch a repeated block) and compute past it is skipped, so blocks beyond the valid rows are never read. The kv
block must divide S (the dispatcher falls back to the reference otherwise). Proven in TPU interpret mode only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_NEG = -1e30


def kv_block(s: int) -> int | None:
    """Largest supported kv block dividing S (None when S is not a multiple of 8)."""
    for bs in (512, 256, 128, 64, 32, 16, 8):
        if s % bs == 0:
            return bs
    return None


def _kernel(kvl_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, block_kv, n_kv):
    bi, ri, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j * block_kv < kvl_ref[bi, ri])
    def _():
        kb, vb = k_ref[...], v_ref[...]
        sc = lax.dot_general(q_ref[...], kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        idx = j * block_kv + lax.broadcasted_iota(jnp.int32, sc.shape, 1)
        mask = idx <= pos_ref[...]  # [BM, 1] positions broadcast over the block
        sc = jnp.where(mask, sc, _NEG)
        m_old = m_sc[...]
        m_new = jnp.maximum(m_old, jnp.max(sc, axis=1, keepdims=True))
        alpha = jnp.exp(m_old - m_new)
        p = jnp.where(mask, jnp.exp(sc - m_new), 0.0)
        l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = acc_sc[...] * alpha + jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == n_kv - 1)
    def _():
        l = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_rows", "block_kv", "interpret"))
def cached_attention_tpu(q, k_cache, v_cache, q_positions, *, scale=None, block_rows=None, block_kv=None,
                         interpret=False):
    """Same contract as :func:`attention_reference`; S must be a multiple of 8."""
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    grp = hq // hkv
    bs = block_kv or kv_block(s)
    if bs is None or s % bs:
        raise ValueError(f"cache length {s} is not a multiple of a supported kv block")
    rows = t * grp
    bm = block_rows or (max(16, -(-rows // 16) * 16) if rows <= 256 else 256)
    nr = math.ceil(rows / bm)
    mp = nr * bm
    n_kv = s // bs
    scale = d**-0.5 if scale is None else scale
    qr = q.reshape(b, t, hkv, grp, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    pos = jnp.repeat(q_positions.astype(jnp.int32), grp, axis=1)
    if mp != rows:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, mp - rows), (0, 0)))
        pos = jnp.pad(pos, ((0, 0), (0, mp - rows)), constant_values=-1)
    kv_len = jnp.max(pos.reshape(b, nr, bm), axis=-1) + 1  # [B, nr] valid kv rows per row block

    def kv_map(bi, h, ri, j, kvl):
        last = jnp.maximum(lax.div(kvl[bi, ri] + bs - 1, bs) - 1, 0)
        return bi, h, jnp.minimum(j, last), 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, hkv, nr, n_kv),
        in_specs=[
            pl.BlockSpec((None, None, bm, d), lambda bi, h, ri, j, kvl: (bi, h, ri, 0)),
            pl.BlockSpec((None, bm, 1), lambda bi, h, ri, j, kvl: (bi, ri, 0)),
            pl.BlockSpec((None, None, bs, d), kv_map),
            pl.BlockSpec((None, None, bs, d), kv_map),
        ],
        out_specs=pl.BlockSpec((None, None, bm, d), lambda bi, h, ri, j, kvl: (bi, h, ri, 0)),
        scratch_shapes=[pltpu.VMEM((bm, 1), jnp.float32), pltpu.VMEM((bm, 1), jnp.float32),
                        pltpu.VMEM((bm, d), jnp.float32)],
    )
    o = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), block_kv=bs, n_kv=n_kv),
        out_shape=jax.ShapeDtypeStruct((b, hkv, mp, d), q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="cached_attention_tpu",
    )(kv_len, qr, pos[..., None], k_cache, v_cache)
    o = o[:, :, :rows].reshape(b, hkv, t, grp, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
    return o
