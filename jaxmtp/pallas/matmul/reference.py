"""Reference for the projections of the model: ``x @ W`` (or ``x @ W^T``) with float32 accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmtp.precision import einsum_f32


def matmul_reference(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None) -> jax.Array:
    """x: [..., K]; w: [K, N] (or [N, K] with ``transpose_w``). Returns [..., N] in ``out_dtype`` (default x.dtype).

    Another ``out_dtype`` (float32 for the LM head) keeps the float32 accumulator (:func:`jaxmtp.precision.einsum_f32`)
    and casts it.
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    eq = "...k,nk->...n" if transpose_w else "...k,kn->...n"
    if out_dtype == x.dtype:
        return jnp.einsum(eq, x, w)
    return einsum_f32(eq, x, w).astype(out_dtype)


def quantized_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """``(x @ q^T) * scale`` in float32: x [..., K]; q [N, K] int8; scale [N] float32 (per output column)."""
    return einsum_f32("...k,nk->...n", x, q.astype(x.dtype)) * scale


def norm_linear_reference(x: jax.Array, norm_w: jax.Array, w: jax.Array, *, eps: float,
                          swiglu_width: int | None = None):
    """``rms_norm(x, norm_w) @ w`` (zero-centred RMSNorm, :func:`jaxmtp.layers.norms.rms_norm`); with
    ``swiglu_width`` I, w holds gate columns [0, I) and up [I, 2I) and the result is ``silu(h @ w_gate) *
    (h @ w_up)`` [..., I]."""
    # The row scale rsqrt(mean(x^2) + eps) is applied to the product's output, so that XLA can fuse x * (1 + w)
    # into the product's operand and the scale into its output.
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = einsum_f32("...k,kn->...n", (x32 * (1.0 + norm_w.astype(jnp.float32))).astype(x.dtype), w) * inv
    if swiglu_width is None:
        return y.astype(x.dtype)
    i = swiglu_width
    return (jax.nn.silu(y[..., :i]) * y[..., i : 2 * i]).astype(x.dtype)


def linear_residual_reference(x: jax.Array, w_t: jax.Array, residual: jax.Array, aux=(), *, prologue: str = "none",
                              aux_offset: int = 0, head_dim: int = 0, eps: float = 1e-6) -> jax.Array:
    """``residual + prologue(x) @ w_t^T`` (see :func:`jaxmtp.pallas.matmul.fused_triton.linear_residual_triton`)."""
    from jaxmtp.layers.norms import gated_rms_norm

    if prologue == "gated_rms":
        z_src, norm_w = aux
        lead, k = x.shape[:-1], x.shape[-1]
        z = z_src[..., aux_offset : aux_offset + k]
        heads = lambda a: a.reshape(*lead, k // head_dim, head_dim)  # noqa: E731
        x = gated_rms_norm(heads(x), heads(z), norm_w, eps).reshape(*lead, k)
    elif prologue == "sigmoid_gate":
        (qg,) = aux
        lead, k = x.shape[:-1], x.shape[-1]
        gate = qg[..., : 2 * k].reshape(*lead, k // head_dim, 2 * head_dim)[..., head_dim:].reshape(*lead, k)
        x = x * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype)
    elif prologue != "none":
        raise ValueError(f"unknown prologue {prologue!r}")
    return residual + matmul_reference(x, w_t, transpose_w=True).astype(residual.dtype)
