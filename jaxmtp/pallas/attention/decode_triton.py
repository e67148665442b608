"""Attention over the KV carry for GPU (Pallas, Triton lowering): flash attention with GQA packing.

The T queries of the Hq / Hkv heads sharing a kv head are packed into the rows of one tile
(row ``t * G + j`` = token t, query head ``kv_head * G + j``), so each K/V block is read once for the whole group.
Grid ``(B, Hkv, row blocks, splits)``: a program runs online softmax (base 2: ``exp2``, log2(e) folded into the
scale) over its share of the kv blocks that hold valid rows (up to ``max(position) + 1`` of its query rows: blocks
beyond are never read, whatever the cache length). Blocks wholly at or below the lowest position of the tile's
valid rows run without a mask; the rest mask ``kv_index <= position`` per query row (padding rows, position -1, do
not count: they only get zeros at the end). The last kv block is shifted back to end at S (its already-seen rows
masked), so no read goes past the cache and S needs no padding. With one split the program writes the normalised
output; with several (decode with few programs: split-K) it writes float32 partials ``(acc, max, sum)``, the max in
base-2 units, that :func:`combine_splits` (or the epilogue kernel) combines. Row blocks run in reverse order, so the
causal tiles with the most kv blocks start first.

:func:`launch_plan` picks the launch from the :class:`~jaxmtp.pallas.policy.KernelPolicy`: below
``attention_prefill_min_rows`` packed rows the decode plan (one tile of up to 64 rows, ``attention_decode_*``), from
there the prefill tiles (``attention_prefill_*``, or ``attention_wide_*`` where those fill
``attention_wide_min_waves`` waves); either splits the kv range until about
``attention_split_waves`` waves of programs run.
:func:`attention_core` is the launch on already packed queries, returning its raw outputs;
:func:`cached_attention_triton` packs, launches and combines with jnp, and :mod:`.prelude_triton` surrounds the launch
with its own two kernels instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import mm, next_pow2
from jaxmtp.pallas.policy import DEFAULT_POLICY, KernelPolicy

_NEG = -1e30
_LOG2E = 1.4426950408889634


def kv_ranges(pos, block_kv, s_len, n_split=1, split=0):
    """The kv blocks one program reads, for its tile's row positions ``pos [BM]`` (-1: padding) and a cache of
    ``s_len`` rows: ``(full_start, full_end, masked_start, end)``. The blocks holding rows 0..max(pos) are divided
    evenly over ``n_split`` splits (this program: split ``split``); of its share, blocks below
    ``(min(valid positions) + 1) // block_kv`` lie wholly at or below every valid row's position and need no mask
    (``[full_start, full_end)``, never the shifted last block), the rest are masked (``[masked_start, end)``).
    Padding rows do not count; a tile of padding rows reads nothing."""
    bs = block_kv
    n_blocks = (jnp.max(pos) + bs) // bs
    n_full = jnp.minimum((jnp.min(jnp.where(pos >= 0, pos, s_len)) + 1) // bs, jnp.minimum(n_blocks, s_len // bs))
    if n_split == 1:
        start, end = 0, n_blocks
    else:
        per = (n_blocks + n_split - 1) // n_split
        start = split * per
        end = jnp.minimum(start + per, n_blocks)
    return start, jnp.minimum(end, n_full), jnp.maximum(start, n_full), end


def _kernel(q_ref, pos_ref, k_ref, v_ref, *out_refs, scale, block_kv, n_split, s_len, interpret):
    f32, bs = jnp.float32, block_kv
    scale2 = scale * _LOG2E  # scores in base 2: exp2(scale2 * s) = exp(scale * s)
    q = q_ref[...]
    pos = pos_ref[...]
    bm = q.shape[0]
    valid = pos >= 0
    full_start, full_end, masked_start, end = kv_ranges(pos, bs, s_len, n_split,
                                                        pl.program_id(3) if n_split > 1 else 0)

    def full_block(j, carry):
        m, l, acc = carry
        off = pl.multiple_of(j * bs, bs)
        kb = k_ref[pl.ds(off, bs), :]
        vb = v_ref[pl.ds(off, bs), :]
        sc = mm(q, kb, tb=True, dtype=kb.dtype, interpret=interpret)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1) * scale2)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(sc * scale2 - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + mm(p, vb, dtype=vb.dtype, interpret=interpret)
        return m_new, l, acc

    def masked_block(j, carry):
        m, l, acc = carry
        off = jnp.minimum(j * bs, s_len - bs)
        kb = k_ref[pl.ds(off, bs), :]
        vb = v_ref[pl.ds(off, bs), :]
        sc = mm(q, kb, tb=True, dtype=kb.dtype, interpret=interpret)
        idx = off + lax.broadcasted_iota(jnp.int32, (bm, bs), 1)
        mask = (idx <= pos[:, None]) & (idx >= j * bs)
        sc = jnp.where(mask, sc * scale2, _NEG)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(mask, jnp.exp2(sc - m_new[:, None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + mm(p, vb, dtype=vb.dtype, interpret=interpret)
        return m_new, l, acc

    d = v_ref.shape[-1]
    carry = (jnp.full((bm,), _NEG, f32), jnp.zeros((bm,), f32), jnp.zeros((bm, d), f32))
    carry = lax.fori_loop(full_start, full_end, full_block, carry)
    m, l, acc = lax.fori_loop(masked_start, end, masked_block, carry)
    if n_split == 1:
        o_ref, = out_refs
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]
        o_ref[...] = jnp.where(valid[:, None], o, 0.0).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = jnp.where(valid[:, None], acc, 0.0)
        m_ref[...] = jnp.where(valid, m, _NEG)
        l_ref[...] = jnp.where(valid, l, 0.0)


class Plan(NamedTuple):
    """Static launch settings of one call (:func:`launch_plan`)."""

    block_rows: int  # packed query rows per tile (BM)
    block_kv: int  # kv rows per block (BS)
    n_split: int  # split-K programs per row tile
    num_warps: int
    num_stages: int


def launch_plan(b, t, hq, hkv, s, policy: KernelPolicy | None = None) -> Plan:
    """Tiles and split count for ``b`` rows of ``t`` tokens, ``hq`` / ``hkv`` heads, a cache of ``s`` rows.

    Packed rows ``t * hq / hkv`` below ``policy.attention_prefill_min_rows``: the decode plan (one tile of the
    rows rounded up to a power of two in [16, 64], ``attention_decode_*`` block, warps, stages); from there the
    prefill tiles (``attention_prefill_*``). Either way, with fewer than ``attention_split_waves`` waves of
    programs (``policy.sms`` per wave) the kv range is split until about that many run (at most one split per kv
    block). The kv block is at most the largest power of two <= s."""
    policy = policy or DEFAULT_POLICY
    rows = t * (hq // hkv)
    wide = policy.attention_wide_block_rows
    if rows >= policy.attention_prefill_min_rows and (
            b * hkv * math.ceil(rows / wide) >= policy.attention_wide_min_waves * policy.sms):
        bm, bs = wide, policy.attention_prefill_block_kv
        warps, stages = policy.attention_wide_num_warps, policy.attention_wide_num_stages
    elif rows >= policy.attention_prefill_min_rows:
        bm, bs = policy.attention_prefill_block_rows, policy.attention_prefill_block_kv
        warps, stages = policy.attention_prefill_num_warps, policy.attention_prefill_num_stages
    else:
        bm, bs = 64, policy.attention_decode_block_kv
        warps, stages = policy.attention_decode_num_warps, policy.attention_decode_num_stages
    bm = min(bm, max(16, next_pow2(rows)))
    bs = min(bs, 1 << (s.bit_length() - 1))
    programs = b * hkv * math.ceil(rows / bm)
    target = policy.attention_split_waves * policy.sms
    n_split = 1
    if programs < target:
        n_split = max(1, min(math.ceil(target / programs), math.ceil(s / bs)))
    return Plan(bm, bs, n_split, warps, stages)


def plan(b, t, hq, hkv, s, num_sms=None, policy: KernelPolicy | None = None):
    """``(block_rows, block_kv, n_split)`` of :func:`launch_plan`; ``num_sms`` overrides the policy's."""
    policy = policy or DEFAULT_POLICY
    if num_sms:
        policy = dataclasses.replace(policy, num_sms=num_sms)
    return launch_plan(b, t, hq, hkv, s, policy)[:3]


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
    """Split-K partials ``acc [B, Hkv, NS, MP, D]``, ``m, l [B, Hkv, NS, MP]`` (float32; ``m`` the running max of
    the base-2 scores) -> o [B, Hkv, MP, D] float32 (rows that saw no kv row: zeros)."""
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_all)
    l_all = jnp.sum(w * l, axis=2)
    return jnp.sum(w[..., None] * acc, axis=2) / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def attention_core(qr, pos, k_cache, v_cache, *, scale, block_rows, block_kv, n_split, num_warps=None,
                   num_stages=None, interpret=False):
    """The attention launch on packed queries ``qr [B, Hkv, MP, D]`` (MP a multiple of ``block_rows``) at row
    positions ``pos [B, MP]`` (-1: padding), ``scale > 0``. Returns its raw outputs: ``(o [B, Hkv, MP, D] in
    qr.dtype,)`` with one split, else the float32 partials ``(acc [B, Hkv, NS, MP, D], m [B, Hkv, NS, MP],
    l [B, Hkv, NS, MP])`` for :func:`combine_splits`. ``num_warps`` / ``num_stages``: default 4 / 3."""
    b, hkv, mp, d = qr.shape
    s = k_cache.shape[2]
    bm, bs = block_rows, block_kv
    if not scale > 0:
        raise ValueError(f"the kernel needs a positive scale, got {scale}")
    nr = mp // bm
    rb = lambda ri: nr - 1 - ri  # noqa: E731 - row blocks in reverse: the causal tiles with the most kv blocks first
    in_specs = [
        pl.BlockSpec((None, None, bm, d), lambda bi, h, ri, sp: (bi, h, rb(ri), 0)),
        pl.BlockSpec((None, bm), lambda bi, h, ri, sp: (bi, rb(ri))),
        pl.BlockSpec((None, None, s, d), lambda bi, h, ri, sp: (bi, h, 0, 0)),
        pl.BlockSpec((None, None, s, d), lambda bi, h, ri, sp: (bi, h, 0, 0)),
    ]
    if n_split == 1:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, mp, d), qr.dtype)]
        out_specs = [pl.BlockSpec((None, None, bm, d), lambda bi, h, ri, sp: (bi, h, rb(ri), 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, hkv, n_split, mp, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, n_split, mp), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, n_split, mp), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, bm, d), lambda bi, h, ri, sp: (bi, h, sp, rb(ri), 0)),
                     pl.BlockSpec((None, None, None, bm), lambda bi, h, ri, sp: (bi, h, sp, rb(ri))),
                     pl.BlockSpec((None, None, None, bm), lambda bi, h, ri, sp: (bi, h, sp, rb(ri)))]
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
                                             "num_stages", "interpret", "policy"))
def cached_attention_triton(q, k_cache, v_cache, q_positions, *, scale=None, block_rows=None, block_kv=None,
                            n_split=None, num_warps=None, num_stages=None, interpret=False,
                            policy: KernelPolicy | None = None):
    """Same contract as :func:`attention_reference`; S must be at least 16. Settings not given come from
    :func:`launch_plan` with ``policy`` (with ``block_rows`` given, ``n_split`` defaults to 1)."""
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    if s < 16:
        raise ValueError("the kernel needs a cache of at least 16 rows")
    p = launch_plan(b, t, hq, hkv, s, policy)
    bm, bs = block_rows or p.block_rows, block_kv or p.block_kv
    n_split = n_split or (p.n_split if block_rows is None else 1)
    scale = d**-0.5 if scale is None else scale
    qr, pos = pack_queries(q, q_positions, hkv, math.ceil(t * (hq // hkv) / bm) * bm)
    outs = attention_core(qr, pos, k_cache, v_cache, scale=scale, block_rows=bm, block_kv=bs, n_split=n_split,
                          num_warps=num_warps or p.num_warps, num_stages=num_stages or p.num_stages,
                          interpret=interpret)
    o = outs[0] if n_split == 1 else combine_splits(*outs)
    return unpack_rows(o, t, hq).astype(q.dtype)
