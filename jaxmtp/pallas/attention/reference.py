"""Pure-jnp reference of attention over a KV carry (prefill, decode and verify are the same op).

    q:           [B, T, Hq, D]      queries of the T new tokens (RoPE applied)
    k_cache:     [B, Hkv, S, D]     the KV carry after the new keys were written at their positions
    v_cache:     [B, Hkv, S, D]
    q_positions: [B, T] int32       absolute position of each query; -1 marks a padding row

Query at position p attends to cache rows 0..p (causal by absolute position): rows past p, including stale rows of
rejected drafts, are never read. GQA: query head h uses kv head h // (Hq // Hkv). Softmax in float32.
Returns o: [B, T, Hq, D] in q.dtype (padding rows hold finite garbage).

The gated-attention layer's steps around it (:func:`prelude_reference`: q/k RMSNorm, RoPE, the cache write;
:func:`output_gate_reference`: the sigmoid output gate) are the references of :mod:`.prelude_triton`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.pallas.norms.reference import rms_norm
from jaxmtp.pallas.attention.rope import apply_rope
from jaxmtp.precision import einsum_f32


def attention_reference(q, k_cache, v_cache, q_positions, *, scale=None):
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    if t * g == 1:  # one query row per kv head makes both products matrix-vector ones, which XLA's CPU backend sums
        # in another order than the matrix products of several rows: each head twice keeps a tensor-parallel rank
        # holding one query head per kv head bit-identical to one device (the fixed reduction mode, docs/engine.md)
        return attention_reference(jnp.repeat(q, 2, axis=2), k_cache, v_cache, q_positions, scale=scale)[:, :, ::2]
    qg = q.reshape(b, t, hkv, g, d)
    scores = einsum_f32("btkgd,bksd->bkgts", qg, k_cache) * scale
    visible = jnp.arange(s)[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(scores, axis=-1)
    o = einsum_f32("bkgts,bksd->btkgd", p.astype(v_cache.dtype), v_cache)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def write_kv_reference(k_cache, v_cache, k, v, positions):
    """Write ``k, v [B, T, Hkv, D]`` into the caches ``[B, Hkv, S, D]`` at rows ``positions [B, T]`` (cast to the
    caches' dtype); negative positions (padding) write nothing. Returns the new caches."""
    s = k_cache.shape[2]
    rows = jnp.where(positions >= 0, positions, s)  # out of bounds -> dropped
    b = jnp.arange(k.shape[0])[:, None]
    new_k = k_cache.at[b, :, rows].set(k.astype(k_cache.dtype), mode="drop")
    new_v = v_cache.at[b, :, rows].set(v.astype(v_cache.dtype), mode="drop")
    return new_k, new_v


def split_qkv(proj, *, hq, hkv, d):
    """The fused projection ``proj [B, T, P]`` (columns ``[q_0 | gate_0 | ... | q_{Hq-1} | gate_{Hq-1} | k (Hkv*D) |
    v (Hkv*D) | pad]``) as its parts ``qg [B, T, Hq*2*D]``, ``k, v [B, T, Hkv*D]``."""
    return (proj[..., : hq * 2 * d], proj[..., hq * 2 * d : (2 * hq + hkv) * d],
            proj[..., (2 * hq + hkv) * d : 2 * (hq + hkv) * d])


def prelude_reference(qg, k, v, q_norm, k_norm, cos, sin, k_cache, v_cache, positions, *, hq, hkv, d, eps):
    """The gated-attention layer from its projections to the attention's inputs.

    qg [B, T, Hq*2*D] (per head ``[q_h | gate_h]``), k, v [B, T, Hkv*D] (:func:`split_qkv` of the fused
    projection); q_norm, k_norm [D]: zero-centred RMSNorm offsets; cos, sin [B, T, rotary_dim] float32; positions
    [B, T] (-1: padding); caches [B, Hkv, S, D]. Returns (q [B, T, Hq, D] normed and roped, gate [B, T, Hq*D],
    k_cache, v_cache) with k (normed, roped) and v written at their positions."""
    b, t, _ = qg.shape
    qg = qg.reshape(b, t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b, t, hq * d)
    q = apply_rope(rms_norm(q, q_norm, eps), cos, sin)
    k = apply_rope(rms_norm(k.reshape(b, t, hkv, d), k_norm, eps), cos, sin)
    k_cache, v_cache = write_kv_reference(k_cache, v_cache, k, v.reshape(b, t, hkv, d), positions)
    return q, gate, k_cache, v_cache


def output_gate_reference(o, gate):
    """The attention output ``o [B, T, Hq, D]`` times ``sigmoid(gate [B, T, Hq*D])``, in o's dtype: [B, T, Hq*D]."""
    b, t, hq, d = o.shape
    return o.reshape(b, t, hq * d) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
