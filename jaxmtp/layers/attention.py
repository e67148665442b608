"""Gated full attention with a KV carry.

Weights (native layout, ``x @ W``): ``q_proj [H, Hq*2*D]`` (per-head interleaved [q_h | gate_h]),
``k_proj``/``v_proj [H, Hkv*D]``, ``o_proj [Hq*D, H]``, ``q_norm``/``k_norm [D]`` (zero-centred, per head). The
serving layout holds ``qkv_proj`` (q, k, v concatenated) instead (:mod:`jaxmtp.layers.projections`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxmtp.config import Qwen35Config
from jaxmtp.layers.projections import fused_product
from jaxmtp.pallas import ops
from jaxmtp.pallas.attention.rope import rope_inv_freq
from jaxmtp.pallas.backend import XLA, Backend


@struct.dataclass
class KVCache:
    """Keys and values of one attention layer: ``[B, Hkv, S, D]`` each, row s holding position s."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def zeros(cfg: Qwen35Config, batch: int, max_len: int, dtype) -> "KVCache":
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def take_rows(a: jax.Array, rows: jax.Array | None) -> jax.Array:
    """``a[b, rows[b]]`` as [B, 1, ...] for a [B, T, ...] and rows [B] int32; ``a`` itself when rows is None."""
    if rows is None:
        return a
    idx = rows.astype(jnp.int32).reshape((-1, 1) + (1,) * (a.ndim - 2))
    return jnp.take_along_axis(a, idx, axis=1)


def gated_attention(p, cfg: Qwen35Config, x, positions, cache: KVCache, *, backend: Backend = XLA, out_rows=None):
    """The layer up to its output projection: x [B, T, H] (or the lazy input norm, :func:`jaxmtp.pallas.ops.normed`);
    positions [B, T] (-1 = padding). Returns (the gated attention output [B, T, Hq*D], the new cache); with
    ``out_rows`` [B] int32 the output only at that row of each window ([B, 1, Hq*D]) while every row's keys and
    values still enter the cache. The caller applies o_proj (:func:`jaxmtp.pallas.ops.output_add_norm`)."""
    proj = fused_product(p, x, "qkv_proj", lambda a, w: ops.linear(a, w, backend), lambda a: ops.form(a, backend))
    y, k, v = ops.fused_gated_attention(proj, p["q_norm"], p["k_norm"], rope_inv_freq(cfg.rotary_dim, cfg.rope_theta),
                                        cache.k, cache.v, positions, backend, hq=cfg.num_attention_heads,
                                        hkv=cfg.num_key_value_heads, d=cfg.head_dim, eps=cfg.rms_norm_eps,
                                        out_rows=out_rows)
    return y, KVCache(k, v)
