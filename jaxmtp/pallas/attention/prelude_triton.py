"""The gated-attention layer of a decode or verify step around the attention kernel, as two GPU kernels (Pallas,
Triton lowering) instead of about ten small XLA ones.

``prelude``, grid ``(B, Hkv, G + 1, T)`` (G = Hq / Hkv): from the fused projection ``proj [B, T, P]`` (columns as in
:func:`.reference.split_qkv`), program ``(b, kv, j, i)`` takes token i's query head ``kv * G + j`` (j < G), RMS-norms
and ropes it (the angles formed from the position and the rotary frequencies, where XLA ran two or three kernels per
step for the cos and sin tables) and stores it straight into the attention kernel's packed layout ``qr [B, Hkv, MP, D]``
(row ``i * G + j``, :mod:`.decode_triton`), or (j = G) the kv head's k, normed and roped, and v into the caches at row
``positions[b, i]`` in place (input-output aliases; nothing for padding tokens). One program per head row keeps each
program's chain short: a version with one program per kv head looping over its heads and tokens was
slower for verify windows. Programs ``(b, 0, j, i)`` also write the packed row positions
``pos [B, MP]``, programs ``(b, kv, 0, 0)`` the padding rows (zeros at position -1). Rounding follows the reference:
the norm's output is rounded to the model dtype before RoPE, RoPE's output rounded again, then cast to the cache
dtype. Tensors must have power-of-two sizes in Triton, so a head row is handled as power-of-two column spans: the two
rotary halves, then ``[rd, 2 rd), [2 rd, 4 rd), ..., [D/2, D)`` (D and rd powers of two).

``epilogue``, grid ``(B, Hq, T)``: the query head's packed row of the attention output (one split: the normalised
``o``; several: the float32 partials of the NS splits, read as ``[NG, D]`` tiles of NG = min(32, the largest power of
two <= NS) splits and combined with a running (max, sum, acc) as :func:`.decode_triton.combine_splits` does; the last
group is shifted back to end at NS, its already-combined splits masked, so NS is any count), rounded to the model
dtype and multiplied by ``sigmoid(gate)`` (rounded likewise), written as ``y [B, T, Hq*D]``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import next_pow2
from jaxmtp.pallas.attention.decode_triton import _NEG, attention_core, launch_plan
from jaxmtp.pallas.policy import DEFAULT_POLICY, KernelPolicy

MAX_TOKENS = 16  # T per call (bounded as the GDN mixer's: decode and verify windows)
SPLIT_GROUP = 32  # the epilogue reads a row's splits as [NG, D] float32 tiles of at most this many


def _pow2_spans(start: int, end: int):
    """``[start, end)`` as aligned power-of-two spans ``(offset, size)``."""
    spans = []
    while start < end:
        size = start & -start if start else 1 << (end.bit_length() - 1)
        while start + size > end:
            size //= 2
        spans.append((start, size))
        start += size
    return spans


def _norm_rope(load, w_ref, cos, sin, *, d, rd, eps, dtype):
    """One head row: RMSNorm (``load(off, n)``: columns ``[off, off + n)`` of the row) then RoPE on the first rd
    columns. Returns ``[(offset, values in dtype)]`` covering ``[0, d)``."""
    f32, half = jnp.float32, rd // 2
    spans = [(0, half), (half, half)] + _pow2_spans(rd, d)
    xs = [load(o, n).astype(f32) for o, n in spans]
    inv = lax.rsqrt(sum(jnp.sum(x * x) for x in xs) / d + eps)
    ys = [(x * inv * (1.0 + w_ref[pl.ds(o, n)].astype(f32))).astype(dtype) for x, (o, n) in zip(xs, spans)]
    x1, x2 = ys[0].astype(f32), ys[1].astype(f32)
    (c1, c2), (s1, s2) = cos, sin
    ys[:2] = (x1 * c1 + (-x2) * s1).astype(dtype), (x2 * c2 + x1 * s2).astype(dtype)
    return list(zip((o for o, _ in spans), ys))


def _prelude_kernel(q_ref, k_ref, v_ref, qw_ref, kw_ref, inv_ref, pos_ref, _kc_in, _vc_in,
                    qr_ref, posr_ref, kc_ref, vc_ref, *, t, grp, d, rd, eps, mp):
    h, j, i = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    dtype = qr_ref.dtype
    position = pos_ref[0]
    # the token's angles, as jaxmtp.pallas.attention.rope.rope_cos_sin forms them (padding tokens at position 0); both rotary
    # halves share them
    angle = jnp.maximum(position, 0).astype(jnp.float32) * inv_ref[...]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    cs = [(cos, cos), (sin, sin)]
    norm_rope = functools.partial(_norm_rope, d=d, rd=rd, eps=eps, dtype=dtype)

    @pl.when(j < grp)
    def _():  # query head h * G + j of token i
        for o, y in norm_rope(lambda o, n: q_ref[pl.ds(o, n)], qw_ref, *cs):
            qr_ref[i * grp + j, pl.ds(o, y.shape[0])] = y

    @pl.when((j == grp) & (position >= 0))
    def _():  # the kv head's k and v of token i, into the caches
        for o, y in norm_rope(lambda o, n: k_ref[pl.ds(o, n)], kw_ref, *cs):
            kc_ref[position, pl.ds(o, y.shape[0])] = y.astype(kc_ref.dtype)
        vc_ref[position, :] = v_ref[...].astype(vc_ref.dtype)

    @pl.when((h == 0) & (j < grp))
    def _():
        posr_ref[pl.ds(i * grp + j, 1)] = jnp.full((1,), position, jnp.int32)

    @pl.when((j == 0) & (i == 0))
    def _():  # padding rows: zeros at position -1
        for o, n in _pow2_spans(t * grp, mp):
            qr_ref[pl.ds(o, n), :] = jnp.zeros((n, d), dtype)

            @pl.when(h == 0)
            def _():
                posr_ref[pl.ds(o, n)] = jnp.full((n,), -1, jnp.int32)


@functools.partial(jax.jit, static_argnames=("hq", "hkv", "d", "eps", "mp", "interpret"))
def prelude_triton(proj, q_norm, k_norm, inv_freq, k_cache, v_cache, positions, *, hq, hkv, d, eps, mp,
                   interpret=False):
    """proj [B, T, P]; q_norm, k_norm [D]; inv_freq [rd / 2] float32 (:func:`jaxmtp.pallas.attention.rope.rope_inv_freq`:
    each program forms its token's cos and sin); caches [B, Hkv, S, D]; positions [B, T].
    Returns (qr [B, Hkv, MP, D] in proj.dtype, pos [B, MP] int32, k_cache, v_cache): the inputs of
    :func:`.decode_triton.attention_core` (as :func:`.decode_triton.pack_queries` packs them) and the caches with
    the new rows (in place)."""
    b, t, _ = proj.shape
    s, rd, grp = k_cache.shape[2], 2 * inv_freq.shape[-1], hq // hkv
    cache_spec = pl.BlockSpec((None, None, s, d), lambda bi, h, j, i: (bi, h, 0, 0))
    row = lambda w, blk: pl.BlockSpec((None, None, w), lambda bi, h, j, i: (bi, i, blk(h, j)))  # noqa: E731
    in_specs = [
        # q of head h*G + j (for j = G a block no program reads, still inside proj), k and v of kv head h
        row(d, lambda h, j: 2 * (h * grp + j)), row(d, lambda h, j: 2 * hq + h), row(d, lambda h, j: 2 * hq + hkv + h),
        pl.BlockSpec((d,), lambda bi, h, j, i: (0,)), pl.BlockSpec((d,), lambda bi, h, j, i: (0,)),
        pl.BlockSpec((rd // 2,), lambda bi, h, j, i: (0,)),
        pl.BlockSpec((None, None, 1), lambda bi, h, j, i: (bi, i, 0)),
        cache_spec, cache_spec,
    ]
    out_shape = [jax.ShapeDtypeStruct((b, hkv, mp, d), proj.dtype), jax.ShapeDtypeStruct((b, mp), jnp.int32),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    out_specs = [pl.BlockSpec((None, None, mp, d), lambda bi, h, j, i: (bi, h, 0, 0)),
                 pl.BlockSpec((None, mp), lambda bi, h, j, i: (bi, 0)),  # written by the programs h = 0
                 cache_spec, cache_spec]
    return pl.pallas_call(
        functools.partial(_prelude_kernel, t=t, grp=grp, d=d, rd=rd, eps=float(eps), mp=mp),
        out_shape=out_shape,
        grid=(b, hkv, grp + 1, t),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        input_output_aliases={7: 2, 8: 3},
        interpret=interpret,
        name="attention_prelude",
    )(proj, proj, proj, q_norm, k_norm, jnp.asarray(inv_freq, jnp.float32), positions.astype(jnp.int32)[..., None],
      k_cache, v_cache)


def _epilogue_kernel(gate_ref, *refs, grp, one_row):
    *in_refs, y_ref = refs
    f32, dtype = jnp.float32, y_ref.dtype
    if one_row:  # the row's token index comes first; gate_ref holds the gate columns of every token
        i_ref, *in_refs = in_refs
        i = i_ref[0]
        gate_in = gate_ref[i, :]
    else:
        i, gate_in = pl.program_id(2), gate_ref[...]
    row = i * grp + pl.program_id(1) % grp  # token i, query head q: packed row i * G + q % G
    if len(in_refs) == 1:
        o = in_refs[0][row, :]
    else:  # combine the splits, as combine_splits, a group of NG at a time
        acc_ref, m_ref, l_ref = in_refs
        ns = m_ref.shape[0]
        ng = min(SPLIT_GROUP, 1 << (ns.bit_length() - 1))
        m_run = l_run = acc_run = None
        for g in range(-(-ns // ng)):
            off = min(g * ng, ns - ng)  # the last group ends at NS; its first g * NG - off splits were combined
            m, l, a = m_ref[pl.ds(off, ng), row], l_ref[pl.ds(off, ng), row], acc_ref[pl.ds(off, ng), row, :]
            fresh = lax.broadcasted_iota(jnp.int32, (ng,), 0) >= g * ng - off if g * ng > off else None
            if fresh is not None:
                m = jnp.where(fresh, m, _NEG)
            mx = jnp.max(m) if m_run is None else jnp.maximum(m_run, jnp.max(m))
            w = jnp.exp2(m - mx)
            if fresh is not None:
                w = jnp.where(fresh, w, 0.0)
            l_g, acc_g = jnp.sum(w * l), jnp.sum(w[:, None] * a, axis=0)
            if m_run is None:
                l_run, acc_run = l_g, acc_g
            else:
                alpha = jnp.exp2(m_run - mx)
                l_run, acc_run = l_run * alpha + l_g, acc_run * alpha + acc_g
            m_run = mx
        o = acc_run / jnp.where(l_run > 0, l_run, 1.0)
    gate = jax.nn.sigmoid(gate_in.astype(f32)).astype(dtype)
    y_ref[...] = (o.astype(dtype).astype(f32) * gate.astype(f32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("hq", "d", "interpret"))
def epilogue_triton(outs, proj, out_rows=None, *, hq, d, interpret=False):
    """outs: :func:`.decode_triton.attention_core`'s outputs (one split: ``(o,)``; else ``(acc, m, l)``, any number
    of splits NS); proj [B, T, P] (its gate columns). Returns y [B, T, Hq*D] in proj.dtype: the combined output
    rounded to proj.dtype times ``sigmoid(gate)``, as :func:`.reference.output_gate_reference`. ``out_rows`` [B]
    int32: only that token's row of each window, y [B, 1, Hq*D] (no row selection after it)."""
    b, t, _ = proj.shape
    hkv, mp = outs[0].shape[1], outs[0].shape[-2]
    grp = hq // hkv
    lead = lambda bi, q: (bi, q // grp)  # noqa: E731 - the query head's kv head
    if len(outs) == 1:
        in_specs = [pl.BlockSpec((None, None, mp, d), lambda bi, q, i: (*lead(bi, q), 0, 0))]
    else:
        ns = outs[0].shape[2]
        in_specs = [pl.BlockSpec((None, None, ns, mp, d), lambda bi, q, i: (*lead(bi, q), 0, 0, 0)),
                    pl.BlockSpec((None, None, ns, mp), lambda bi, q, i: (*lead(bi, q), 0, 0)),
                    pl.BlockSpec((None, None, ns, mp), lambda bi, q, i: (*lead(bi, q), 0, 0))]
    one_row = out_rows is not None
    if one_row:  # every token's gate columns of the head; the kernel loads its row's
        gate_spec = pl.BlockSpec((None, t, d), lambda bi, q, i: (bi, 0, 2 * q + 1))
        in_specs = [pl.BlockSpec((None, 1), lambda bi, q, i: (bi, 0))] + in_specs
        outs = (out_rows.astype(jnp.int32).reshape(b, 1), *outs)
    else:
        gate_spec = pl.BlockSpec((None, None, d), lambda bi, q, i: (bi, i, 2 * q + 1))
    t_out = 1 if one_row else t
    return pl.pallas_call(
        functools.partial(_epilogue_kernel, grp=grp, one_row=one_row),
        out_shape=jax.ShapeDtypeStruct((b, t_out, hq * d), proj.dtype),
        grid=(b, hq, t_out),
        in_specs=[gate_spec] + in_specs,
        out_specs=pl.BlockSpec((None, None, d), lambda bi, q, i: (bi, i, q)),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="attention_epilogue",
    )(proj, *outs)


def supported(*, t, hq, hkv, d, rd, s, p) -> bool:
    """Shapes the fused path takes: the attention kernel's (D a power of two >= 16, S >= 16), rd a power of two
    in [2, D], Hq a multiple of Hkv, 1 <= T <= :data:`MAX_TOKENS`, and P covering q, gate, k and v."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return (pow2(d) and d >= 16 and s >= 16 and pow2(rd) and 2 <= rd <= d and hq % hkv == 0
            and 1 <= t <= MAX_TOKENS and p >= 2 * (hq + hkv) * d)


def fused_splits(n_split: int, policy: KernelPolicy | None = None) -> int:
    """The fused layer's split count for a planned ``n_split``: rounded up to a power of two (a split past the last
    kv block finds nothing to read: one idle program), at most ``policy.attention_max_splits``."""
    return max(1, min(next_pow2(n_split), (policy or DEFAULT_POLICY).attention_max_splits))


@functools.partial(jax.jit, static_argnames=("hq", "hkv", "d", "eps", "interpret", "policy", "block_rows", "block_kv",
                                             "n_split", "num_warps", "num_stages"))
def gated_attention_triton(proj, q_norm, k_norm, inv_freq, k_cache, v_cache, positions, out_rows=None, *, hq, hkv,
                           d, eps, interpret=False, policy: KernelPolicy | None = None, block_rows=None,
                           block_kv=None, n_split=None, num_warps=None, num_stages=None):
    """Prelude, attention launch and epilogue: (y [B, T, Hq*D], k_cache, v_cache), the contract of
    :func:`jaxmtp.pallas.attention.fused_gated_attention` (shapes: :func:`supported`; ``out_rows``: y [B, 1, Hq*D],
    that row of each window, from the epilogue). The launch settings not given come from
    :func:`.decode_triton.launch_plan` with ``policy``, the split count through :func:`fused_splits`."""
    b, t, _ = proj.shape
    p = launch_plan(b, t, hq, hkv, k_cache.shape[2], policy)
    bm, bs = block_rows or p.block_rows, block_kv or p.block_kv
    n_split = n_split or fused_splits(p.n_split, policy)
    mp = math.ceil(t * (hq // hkv) / bm) * bm
    qr, pos, k_cache, v_cache = prelude_triton(proj, q_norm, k_norm, inv_freq, k_cache, v_cache, positions,
                                               hq=hq, hkv=hkv, d=d, eps=eps, mp=mp, interpret=interpret)
    outs = attention_core(qr, pos, k_cache, v_cache, scale=d**-0.5, block_rows=bm, block_kv=bs, n_split=n_split,
                          num_warps=num_warps or p.num_warps, num_stages=num_stages or p.num_stages,
                          interpret=interpret)
    return epilogue_triton(outs, proj, out_rows, hq=hq, d=d, interpret=interpret), k_cache, v_cache
