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
from jaxmtp.layers.projections import output_product, project
from jaxmtp.pallas._common import TRITON, TRITON_INTERPRET
from jaxmtp.pallas.attention import cached_attention, fused_gated_attention, output_gate_reference, prelude_reference
from jaxmtp.layers.rope import rope_inv_freq
from jaxmtp.pallas.matmul import linear, output_linear


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


def gated_attention(p, cfg: Qwen35Config, x, positions, cos, sin, cache: KVCache, *, implementation="xla",
                    matmul="xla", prelude="xla", out_matmul="xla", out_rows=None, partials=False, residual=None):
    """x: [B, T, H]; positions: [B, T] (-1 = padding); cos/sin: [B, T, rotary_dim]. Returns ([B, T, H], cache).
    ``out_rows`` [B] int32: the output only at that row of each window ([B, 1, H]; o_proj runs on it alone) while
    every row's keys and values still enter the cache. ``partials``: the output may be a
    :class:`jaxmtp.pallas._common.SplitSum` (o_proj's split-K partials, for the residual add + norm).
    ``implementation`` names the attention kernel, ``matmul`` the projections', ``prelude`` the fused path from the
    projection to the gated output (:func:`jaxmtp.pallas.attention.fused_gated_attention`; Triton names and the
    serving layout only, else unused), ``out_matmul`` o_proj's when it is stored transposed
    (:func:`jaxmtp.layers.projections.output_product`). ``residual`` [B, T or 1, H] (a quantised o_proj only,
    :func:`jaxmtp.pallas.matmul.layer_gemv_fuses`): returns ``residual + attention`` (the block's residual add inside
    o_proj's kernel). x may be a :class:`jaxmtp.pallas._common.NormedRows` (the layer's input norm, formed by the
    qkv product)."""
    mm = lambda a, w: linear(a, w, implementation=matmul)  # noqa: E731

    def o_proj(a):
        if residual is not None:
            return output_linear(a, p["o_proj"], implementation=matmul, residual=residual)
        return output_product(p, "o_proj", a, mm, out_matmul, partials)

    b, t, _ = x.shape
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if prelude in (TRITON, TRITON_INTERPRET) and "qkv_proj" in p:
        # the kernel forms the rotary angles from the positions (cos and sin unused here: no XLA kernels for them)
        y, k, v = fused_gated_attention(mm(x, p["qkv_proj"]), p["q_norm"], p["k_norm"],
                                        rope_inv_freq(cfg.rotary_dim, cfg.rope_theta), cache.k, cache.v, positions,
                                        hq=hq, hkv=hkv, d=d, eps=cfg.rms_norm_eps, implementation=prelude,
                                        attention=implementation, out_rows=out_rows)
        return o_proj(y), KVCache(k, v)  # y: the out_rows row alone already (the epilogue picks it)
    q, gate, k, v = prelude_reference(*project(p, x, "qkv_proj", mm, cfg), p["q_norm"], p["k_norm"], cos, sin,
                                      cache.k, cache.v, positions, hq=hq, hkv=hkv, d=d, eps=cfg.rms_norm_eps)
    o = cached_attention(q, k, v, positions, implementation=implementation)
    return o_proj(take_rows(output_gate_reference(o, gate), out_rows)), KVCache(k, v)
