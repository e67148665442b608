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
from jaxmtp.layers.norms import rms_norm
from jaxmtp.layers.projections import project
from jaxmtp.layers.rope import apply_rope
from jaxmtp.pallas.attention import cached_attention
from jaxmtp.pallas.matmul import linear


@struct.dataclass
class KVCache:
    """Keys and values of one attention layer: ``[B, Hkv, S, D]`` each, row s holding position s."""

    k: jax.Array
    v: jax.Array

    @staticmethod
    def zeros(cfg: Qwen35Config, batch: int, max_len: int, dtype) -> "KVCache":
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def write_kv(cache: KVCache, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVCache:
    """Write ``k, v [B, T, Hkv, D]`` at rows ``positions [B, T]``; negative positions (padding) write nothing."""
    s = cache.k.shape[2]
    rows = jnp.where(positions >= 0, positions, s)  # out of bounds -> dropped
    b = jnp.arange(k.shape[0])[:, None]
    new_k = cache.k.at[b, :, rows].set(k.astype(cache.k.dtype), mode="drop")
    new_v = cache.v.at[b, :, rows].set(v.astype(cache.v.dtype), mode="drop")
    return KVCache(new_k, new_v)


def gated_attention(p, cfg: Qwen35Config, x, positions, cos, sin, cache: KVCache, *, implementation="xla",
                    matmul="xla"):
    """x: [B, T, H]; positions: [B, T] (-1 = padding); cos/sin: [B, T, rotary_dim]. Returns ([B, T, H], cache).
    ``implementation`` names the attention kernel, ``matmul`` the projections'."""
    mm = lambda a, w: linear(a, w, implementation=matmul)  # noqa: E731
    b, t, _ = x.shape
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg, k, v = project(p, x, "qkv_proj", mm, cfg)
    qg = qg.reshape(b, t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b, t, hq * d)
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k.reshape(b, t, hkv, d), p["k_norm"], cfg.rms_norm_eps)
    v = v.reshape(b, t, hkv, d)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache = write_kv(cache, k, v, positions)
    o = cached_attention(q, cache.k, cache.v, positions, implementation=implementation)
    o = o.reshape(b, t, hq * d) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    return mm(o, p["o_proj"]), cache
