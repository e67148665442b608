"""Attention over the KV carry for GPU (Pallas, Triton lowering): flash-decoding with GQA packing.

The T queries of the Hq / Hkv heads sharing a kv head are packed into the rows of one tile
(row ``t * G + j`` = token t, query head ``kv_head * G + j``), so each K/V block is read once for the whole group.
Grid ``(B, Hkv, row blocks, splits)``: a program runs online softmax over its share of the kv blocks that hold
valid rows (up to ``max(position) + 1`` of its query rows: blocks beyond are never read, whatever the cache length),
masking ``kv_index <= position`` per query row. With one split the program writes the normalised output; with
several (decode with few programs: split-K) it writes float32 partials ``(acc, max, sum)`` that a small jnp step
combines. The last kv block is shifted back to end at S (its already-seen rows masked), so no read goes past the
cache and S needs no padding. Large T (prefill) simply gives more row blocks.

:func:`attention_core` is the launch on already packed queries, returning its raw outputs;
:func:`cached_attention_triton` packs, launches and combines with jnp, and :mod:`.prelude_triton` surrounds the launch
with its own two kernels instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import mm, next_pow2
from jaxmtp.pallas.policy import device_num_sms

_NEG = -1e30


def _kernel(q_ref, pos_ref, k_ref, v_ref, *out_refs, scale, block_kv, n_split, s_len, interpret):
    f32 = jnp.float32
    q = q_ref[...]
    pos = pos_ref[...]
    bm = q.shape[0]
    n_valid = jnp.max(pos) + 1
    n_blocks = (n_valid + block_kv - 1) // block_kv
    if n_split == 1:
        start, end = 0, n_blocks
    else:
        per = (n_blocks + n_split - 1) // n_split
        start = pl.program_id(3) * per
        end = jnp.minimum(start + per, n_blocks)

    def body(j, carry):
        m, l, acc = carry
        off = jnp.minimum(j * block_kv, s_len - block_kv)
        kb = k_ref[pl.ds(off, block_kv), :]
        vb = v_ref[pl.ds(off, block_kv), :]
        sc = mm(q, kb, tb=True, dtype=kb.dtype, interpret=interpret) * scale
        idx = off + lax.broadcasted_iota(jnp.int32, (bm, block_kv), 1)
        mask = (idx <= pos[:, None]) & (idx >= j * block_kv)
        sc = jnp.where(mask, sc, _NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(sc - m_new[:, None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + mm(p, vb, dtype=vb.dtype, interpret=interpret)
        return m_new, l, acc

    d = v_ref.shape[-1]
    init = (jnp.full((bm,), _NEG, f32), jnp.zeros((bm,), f32), jnp.zeros((bm, d), f32))
    m, l, acc = lax.fori_loop(start, end, body, init)
    if n_split == 1:
        o_ref, = out_refs
        o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def plan(b, t, hq, hkv, s, num_sms=None):
    """Static tiling for a call: (rows per tile BM, kv block BS, number of splits); ``num_sms``: default the
    device's."""
    num_sms = num_sms or device_num_sms()
    rows = t * (hq // hkv)
    bm = max(16, next_pow2(rows)) if rows <= 64 else 64
    bs = 64 if s >= 64 else max(16, 1 << (s.bit_length() - 1))
    n_row_blocks = math.ceil(rows / bm)
    programs = b * hkv * n_row_blocks
    n_split = 1
    if programs < num_sms:  # split-K until about one wave of programs (measured: more splits cost more than they win)
        n_split = max(1, min(math.ceil(num_sms / programs), math.ceil(s / bs)))
    return bm, bs, n_split


def pack_queries(q, q_positions, hkv, mp):
    """q [B, T, Hq, D], q_positions [B, T] -> (qr [B, Hkv, MP, D], pos [B, MP] int32) in the kernel's row layout:
    row ``t * G + j`` = token t, query head ``kv * G + j`` (G = Hq / Hkv); rows past T * G are zeros at position -1."""
    b, t, hq, d = q.shape
    grp, rows = hq // hkv, t * (hq // hkv)
    qr = q.reshape(b, t, hkv, grp, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
    pos = jnp.repeat(q_positions.astype(jnp.int32), grp, axis=1)
    if mp != rows:
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, mp - rows), (0, 0)))
        pos = jnp.pad(pos, ((0, 0), (0, mp - rows)), constant_values=-1)
    return qr, pos


def unpack_rows(o, t, hq):
    """o [B, Hkv, MP, D] in the packed row layout -> [B, T, Hq, D] (padding rows dropped)."""
    b, hkv, _, d = o.shape
    grp = hq // hkv
    return o[:, :, : t * grp].reshape(b, hkv, t, grp, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)


def combine_splits(acc, m, l):
    """Split-K partials ``acc [B, Hkv, NS, MP, D]``, ``m, l [B, Hkv, NS, MP]`` (float32) -> o [B, Hkv, MP, D] float32
    (rows that saw no kv row: zeros)."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    l_all = jnp.sum(w * l, axis=2)
    return jnp.sum(w[..., None] * acc, axis=2) / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def attention_core(qr, pos, k_cache, v_cache, *, scale, block_rows, block_kv, n_split, num_warps=None,
                   num_stages=None, interpret=False):
    """The attention launch on packed queries ``qr [B, Hkv, MP, D]`` (MP a multiple of ``block_rows``) at row
    positions ``pos [B, MP]`` (-1: padding). Returns its raw outputs: ``(o [B, Hkv, MP, D] in qr.dtype,)`` with
    one split, else the float32 partials ``(acc [B, Hkv, NS, MP, D], m [B, Hkv, NS, MP], l [B, Hkv, NS, MP])``
    for :func:`combine_splits`."""
    b, hkv, mp, d = qr.shape
    s = k_cache.shape[2]
    bm, bs = block_rows, block_kv
    nr = mp // bm
    in_specs = [
        pl.BlockSpec((None, None, bm, d), lambda bi, h, ri, sp: (bi, h, ri, 0)),
        pl.BlockSpec((None, bm), lambda bi, h, ri, sp: (bi, ri)),
        pl.BlockSpec((None, None, s, d), lambda bi, h, ri, sp: (bi, h, 0, 0)),
        pl.BlockSpec((None, None, s, d), lambda bi, h, ri, sp: (bi, h, 0, 0)),
    ]
    if n_split == 1:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, mp, d), qr.dtype)]
        out_specs = [pl.BlockSpec((None, None, bm, d), lambda bi, h, ri, sp: (bi, h, ri, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, n_split, mp, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, n_split, mp), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, n_split, mp), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, bm, d), lambda bi, h, ri, sp: (bi, h, sp, ri, 0)),
                     pl.BlockSpec((None, None, None, bm), lambda bi, h, ri, sp: (bi, h, sp, ri)),
                     pl.BlockSpec((None, None, None, bm), lambda bi, h, ri, sp: (bi, h, sp, ri))]
    return tuple(pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), block_kv=bs, n_split=n_split, s_len=s,
                          interpret=bool(interpret)),
        out_shape=out_shape,
        grid=(b, hkv, nr, n_split),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages or 3),
        interpret=interpret,
        name="cached_attention",
    )(qr, pos, k_cache, v_cache))


@functools.partial(jax.jit, static_argnames=("scale", "block_rows", "block_kv", "n_split", "num_warps",
                                             "num_stages", "interpret"))
def cached_attention_triton(q, k_cache, v_cache, q_positions, *, scale=None, block_rows=None, block_kv=None,
                            n_split=None, num_warps=None, num_stages=None, interpret=False):
    """Same contract as :func:`attention_reference`; S must be at least 16."""
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    if s < 16:
        raise ValueError("the kernel needs a cache of at least 16 rows")
    bm0, bs0, ns0 = plan(b, t, hq, hkv, s)
    bm, bs = block_rows or bm0, block_kv or bs0
    n_split = n_split or (ns0 if block_rows is None else 1)
    scale = d**-0.5 if scale is None else scale
    qr, pos = pack_queries(q, q_positions, hkv, math.ceil(t * (hq // hkv) / bm) * bm)
    outs = attention_core(qr, pos, k_cache, v_cache, scale=scale, block_rows=bm, block_kv=bs, n_split=n_split,
                          num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    o = outs[0] if n_split == 1 else combine_splits(*outs)
    return unpack_rows(o, t, hq).astype(q.dtype)
