"""Small helpers shared by the Pallas kernels: implementation names, interpret modes and in-kernel matmuls."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

# Implementation names understood by every op's dispatcher (besides "xla", the jnp reference).
TRITON = "triton"                              # GPU, Pallas Triton lowering
TRITON_INTERPRET = "triton_interpret"          # the same kernel run by the Pallas interpreter (CPU tests)
MOSAIC_TPU = "mosaic_tpu"                      # TPU, Pallas Mosaic lowering
MOSAIC_TPU_INTERPRET = "mosaic_tpu_interpret"  # the same kernel in TPU interpret mode (CPU tests)
KERNELS = (TRITON, TRITON_INTERPRET, MOSAIC_TPU, MOSAIC_TPU_INTERPRET)


@struct.dataclass
class SplitSum:
    """A product's output left as float32 partial sums over splits of K, ``parts [S, ..., N]``: its value is their
    sum rounded to ``dtype`` (:func:`dense`), what the product would return. A block's output product returns one
    where the residual add + norm that consumes it sums the parts itself
    (:func:`jaxmtp.pallas.norms.add_rms_norm`), so the split-K sum needs no launch of its own."""

    parts: jax.Array
    dtype: Any = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple:
        return self.parts.shape[1:]


@struct.dataclass
class Unreduced:
    """A block's output under tensor parallelism left unreduced for the one-shot kernel that reduces it, adds it to
    the residual stream and norms it in one launch (:func:`jaxmtp.pallas.allreduce_oneshot.add_rms_norm`):
    ``parts [P, ..., N]``, this rank's output as P split-K parts (any float dtype); its value is the sum over the
    ranks of ``tp`` (a :class:`jaxmtp.pallas.collectives.TensorParallel`) of their part sums, rounded to
    ``dtype``."""

    parts: jax.Array
    dtype: Any = struct.field(pytree_node=False)
    tp: Any = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple:
        return self.parts.shape[1:]


@struct.dataclass
class PendingProduct:
    """A block's row-parallel output product under tensor parallelism, left for the one-shot kernel that forms it,
    reduces it over the ranks, adds it to the residual stream and norms it in one launch
    (:func:`jaxmtp.pallas.oneshot_product.product_add_rms_norm`): its value is ``a [..., K] @ w_t [N, K]^T`` in
    float32, summed over the ranks of ``tp``, rounded to ``dtype``."""

    a: jax.Array
    w_t: jax.Array
    dtype: Any = struct.field(pytree_node=False)
    tp: Any = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple:
        return (*self.a.shape[:-1], self.w_t.shape[0])


def sum_parts(parts: jax.Array) -> jax.Array:
    """``parts [P, ...]`` summed in part order, ``((p0 + p1) + p2) + ...``: the order the kernels that take split-K
    parts sum them in (XLA's reduce over the axis may pick another)."""
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total


def dense(y):
    """The value of ``y``: a :class:`SplitSum`'s parts summed (float32) and rounded to its dtype; an
    :class:`Unreduced` output summed over its ranks and rounded, a :class:`PendingProduct` formed, summed and rounded;
    an array as it is."""
    if isinstance(y, SplitSum):
        return sum_parts(y.parts).astype(y.dtype)
    if isinstance(y, Unreduced):
        from jaxmtp.pallas.collectives import reduce_sum

        return reduce_sum(sum_parts(y.parts.astype(jnp.float32)), y.tp, y.dtype)
    if isinstance(y, PendingProduct):
        from jaxmtp.pallas.collectives import reduce_sum

        return reduce_sum(jnp.einsum("...k,nk->...n", y.a, y.w_t, preferred_element_type=jnp.float32), y.tp, y.dtype)
    return y


def interpret_arg(implementation: str):
    """The ``interpret=`` argument of ``pallas_call`` for an implementation name."""
    if implementation == TRITON_INTERPRET:
        return True
    if implementation == MOSAIC_TPU_INTERPRET:
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    return False


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def work_dtype(dtype) -> jnp.dtype:
    """Operand dtype of in-kernel matmuls: 16-bit inputs stay 16-bit (float32 accumulation), else float32."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize == 2 else jnp.dtype(jnp.float32)


def mm(a, b, *, ta: bool = False, tb: bool = False, dtype=jnp.float32, interpret: bool = False):
    """``a @ b`` (``a.T`` / ``b.T`` with ``ta`` / ``tb``) with operands rounded to ``dtype``, float32 result.

    float32 operands use full float32 precision (Triton "ieee"). In interpret mode on the CPU, 16-bit operands are
    upcast after rounding (XLA:CPU has no bf16 x bf16 -> f32 dot): the same products, accumulated in float32.
    """
    a, b = a.astype(dtype), b.astype(dtype)
    if interpret and a.dtype != jnp.float32:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def swiglu_tile(g, u, dtype):
    """``silu(g) * u`` of float32 tiles inside a kernel (``g / (1 + exp(-g))``: ops every lowering has), rounded to
    ``dtype`` as the materialised activation is (:func:`jaxmtp.pallas.matmul.reference.swiglu_reference`)."""
    return (g / (1.0 + jnp.exp(-g)) * u).astype(dtype)


def l2norm_rows(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x * rsqrt(sum(x^2) + eps)`` over the last axis (float32)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule_write(s, k, v, g, beta):
    """The state update of one token of the gated delta rule on a ``[dk, BV]`` float32 state slice, in the GPU
    kernels' register layout: decay, then delta write. k (normalised): [dk]; v: [BV]; g, beta: scalars."""
    s = s * jnp.exp(g)
    kv = jnp.sum(s * k[:, None], axis=0)
    u = (v - kv) * beta
    return s + k[:, None] * u[None, :]


def delta_rule_token(s, q, k, v, g, beta):
    """One token of the gated delta rule: :func:`delta_rule_write`, then the read-out. q (normalised, scaled):
    [dk]. Returns (s, o [BV])."""
    s = delta_rule_write(s, k, v, g, beta)
    return s, jnp.sum(s * q[:, None], axis=0)


def pad_to_chunks(chunk: int, q, k, v, g, beta):
    """Right-pad the time axis (1) of ``q, k, v [B, T, H, d]`` and ``g, beta [B, T, H]`` with zeros to a multiple
    of ``chunk``; zero g and beta leave the state unchanged. Returns the padded five and the padding length."""
    pad = (-q.shape[1]) % chunk
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
    return q, k, v, g, beta, pad


def recurrent_setup(q, v, scale, output_final_state: bool, output_step_states: bool):
    """Shared prologue of the recurrent kernels: ``(r = Hv // Hk, scale, mode)`` with mode ``"steps"`` (state after
    every token), ``"final"`` or ``"none"``; raises unless Hv is a multiple of Hk."""
    hk, dk = q.shape[2:]
    hv = v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    mode = "steps" if output_step_states else ("final" if output_final_state else "none")
    return hv // hk, (dk**-0.5 if scale is None else scale), mode

