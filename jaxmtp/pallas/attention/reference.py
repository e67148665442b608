"""Pure-jnp reference of attention over a KV carry (prefill, decode and verify are the same op).

    q:           [B, T, Hq, D]      queries of the T new tokens (RoPE applied)
    k_cache:     [B, Hkv, S, D]     the KV carry after the new keys were written at their positions
    v_cache:     [B, Hkv, S, D]
    q_positions: [B, T] int32       absolute position of each query; -1 marks a padding row

Query at position p attends to cache rows 0..p (causal by absolute position): rows past p, including stale rows of
rejected drafts, are never read. GQA: query head h uses kv head h // (Hq // Hkv). Softmax in float32.
Returns o: [B, T, Hq, D] in q.dtype (padding rows hold finite garbage).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.precision import einsum_f32


def attention_reference(q, k_cache, v_cache, q_positions, *, scale=None):
    b, t, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, t, hkv, g, d)
    scores = einsum_f32("btkgd,bksd->bkgts", qg, k_cache) * scale
    visible = jnp.arange(s)[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(scores, axis=-1)
    o = einsum_f32("bkgts,bksd->btkgd", p.astype(v_cache.dtype), v_cache)
    return o.reshape(b, t, hq, d).astype(q.dtype)
