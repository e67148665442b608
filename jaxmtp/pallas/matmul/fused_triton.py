"""Few-row projections with their neighbours fused in (GPU, Pallas Triton): the decode step's blocks in fewer kernels.

At batch 1 a decoder block of the 4B shape ran 13 kernels for 4 products: each residual add, RMSNorm (a reduction
and a scaling) and SwiGLU was a kernel of its own, ~1.2 us each plus the gap before the next. Here they ride along
with the products that read or write them:

* :func:`norm_linear_triton` ``y = rms_norm(x) @ W`` (or ``silu(h @ W_gate) * (h @ W_up)``), W ``[K, N]``: each
  program streams a ``BN``-wide column slab of W over all of K, and accumulates the rows' sum of squares as it goes;
  ``x * (1 + w_norm)`` enters the product and the per-row ``rsqrt(mean(x^2) + eps)`` scales the accumulator at the
  end (the norm is linear in x once that scalar is known), so no pass over x precedes the product.
* :func:`linear_residual_triton` ``out = residual + prologue(x) @ W^T``, W stored ``[N, K]`` (contiguous along K, so
  a program can own as few as 16 output columns without split-K partials): the residual add is the epilogue, and the
  prologue is the block's elementwise step before its output projection: none, the GDN gated RMSNorm (per head,
  ``x / rms(x) * w * silu(z)``, z read from the input projection's output), or attention's sigmoid output gate
  (read from the q|gate projection).

Rows: the ``M <= MAX_ROWS`` rows are loaded one by one and placed in a 16-row tile for ``tl.dot`` (the smallest
Triton dot), so no padded copy of x is made. Rounding follows the references (:mod:`.reference`) to within one
bfloat16 rounding: the normalised input is rounded before the product there, ``x * (1 + w)`` here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import mm, work_dtype

MAX_ROWS = 16  # rows share one 16-row dot tile
TILE_ROWS = 16
NONE, GATED_RMS, SIGMOID_GATE = "none", "gated_rms", "sigmoid_gate"  # linear_residual prologues


def _pad_rows(rows, width):
    """``rows`` (list of [width] float32) as a [16, width] tile, zero below."""
    rid = jnp.arange(TILE_ROWS)[:, None]
    tile = jnp.zeros((TILE_ROWS, width), jnp.float32)
    for r, row in enumerate(rows):
        tile = jnp.where(rid == r, row[None, :], tile)
    return tile


def _row(tile, r):
    """Row r of a [16, BN] tile, as [BN]."""
    return jnp.sum(jnp.where(jnp.arange(TILE_ROWS)[:, None] == r, tile, 0.0), axis=0)


def _silu(x):
    return x * jax.nn.sigmoid(x)


# ---------------------------------------------------------------------------------------------------------------
# norm -> product (-> SwiGLU)
# ---------------------------------------------------------------------------------------------------------------
def _norm_linear_kernel(x_ref, nw_ref, w_ref, o_ref, *, m, k, bk, bn, up_offset, eps, dtype, interpret):
    col = pl.multiple_of(pl.program_id(0) * bn, bn)
    f32 = jnp.float32

    def body(i, carry):
        acc, acc_up, ss = carry
        off = pl.multiple_of(i * bk, bk)
        xt = _pad_rows([x_ref[r, pl.ds(off, bk)].astype(f32) for r in range(m)], bk)
        ss = ss + jnp.sum(xt * xt, axis=1)
        xs = xt * (1.0 + nw_ref[pl.ds(off, bk)].astype(f32))[None, :]
        acc = acc + mm(xs, w_ref[pl.ds(off, bk), pl.ds(col, bn)], dtype=dtype, interpret=interpret)
        if up_offset is not None:
            up = w_ref[pl.ds(off, bk), pl.ds(up_offset + col, bn)]
            acc_up = acc_up + mm(xs, up, dtype=dtype, interpret=interpret)
        return acc, acc_up, ss

    zeros = jnp.zeros((TILE_ROWS, bn), f32)
    acc, acc_up, ss = lax.fori_loop(0, k // bk, body, (zeros, zeros, jnp.zeros((TILE_ROWS,), f32)))
    inv = lax.rsqrt(ss / k + eps)[:, None]
    y = acc * inv
    if up_offset is not None:
        y = _silu(y) * (acc_up * inv)
    for r in range(m):
        o_ref[r, :] = _row(y, r).astype(o_ref.dtype)


def norm_linear_supported(m: int, k: int, n: int, block_n: int, block_k: int) -> bool:
    return 0 < m <= MAX_ROWS and k % block_k == 0 and n % block_n == 0


@functools.partial(jax.jit, static_argnames=("eps", "swiglu_width", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def norm_linear_triton(x, norm_w, w, *, eps: float, swiglu_width: int | None = None, block_n: int = 64,
                       block_k: int = 128, num_warps: int = 4, num_stages: int = 4, interpret: bool = False):
    """x [..., K] (the residual stream), norm_w [K] (zero-centred offset), w [K, N] -> [..., N] (x.dtype); with
    ``swiglu_width`` I, w holds gate columns [0, I) and up columns [I, 2I) (then padding), and the result is
    [..., I]."""
    lead, k = x.shape[:-1], x.shape[-1]
    m = 1
    for s in lead:
        m *= s
    swiglu = swiglu_width is not None
    n = swiglu_width if swiglu else w.shape[1]
    if not norm_linear_supported(m, k, n, block_n, block_k):
        raise ValueError(f"norm_linear: unsupported shape [{m}, {k}] x [{k}, {w.shape[1]}] for BN={block_n}, "
                         f"BK={block_k}")
    y = pl.pallas_call(
        functools.partial(_norm_linear_kernel, m=m, k=k, bk=block_k, bn=block_n, up_offset=n if swiglu else None,
                          eps=float(eps), dtype=work_dtype(w.dtype), interpret=bool(interpret)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(n // block_n,),
        in_specs=[pl.BlockSpec((m, k), lambda j: (0, 0)), pl.BlockSpec((k,), lambda j: (0,)),
                  pl.BlockSpec(w.shape, lambda j: (0, 0))],
        out_specs=pl.BlockSpec((m, block_n), lambda j: (0, j)),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="norm_linear",
    )(x.reshape(m, k), norm_w, w)
    return y.reshape(*lead, n)


# ---------------------------------------------------------------------------------------------------------------
# prologue -> product -> + residual
# ---------------------------------------------------------------------------------------------------------------
def _linear_residual_kernel(x_ref, w_ref, res_ref, *refs, m, k, bk, sub, bn, prologue, aux_offset, head_dim, eps,
                            dtype, interpret):
    *aux, o_ref = refs
    col = pl.multiple_of(pl.program_id(0) * bn, bn)
    f32 = jnp.float32
    rnd = lambda a: a.astype(x_ref.dtype).astype(f32)  # noqa: E731 - the reference stores the prologue's output

    def chunk(off, r):
        """Row r of the product's input over columns [off, off + sub)."""
        xr = x_ref[r, pl.ds(off, sub)].astype(f32)
        if prologue == GATED_RMS:  # sub == head_dim: one head
            z_ref, nw_ref = aux
            z = z_ref[r, pl.ds(aux_offset + off, sub)].astype(f32)
            xr = xr * lax.rsqrt(jnp.mean(xr * xr) + eps) * nw_ref[...].astype(f32) * _silu(z)
        elif prologue == SIGMOID_GATE:  # q|gate interleaved per head: gate of column c at (c // D) 2D + D + c % D
            (g_ref,) = aux
            goff = lax.div(off, head_dim) * 2 * head_dim + head_dim + lax.rem(off, head_dim)  # off >= 0
            xr = xr * rnd(jax.nn.sigmoid(g_ref[r, pl.ds(goff, sub)].astype(f32)))
        return rnd(xr) if prologue != NONE else xr

    def body(i, acc):
        for s in range(bk // sub):  # sub-chunks of one step: their loads are in flight together
            off = pl.multiple_of(i * bk + s * sub, sub)
            xt = _pad_rows([chunk(off, r) for r in range(m)], sub)
            acc = acc + mm(xt, w_ref[pl.ds(col, bn), pl.ds(off, sub)], tb=True, dtype=dtype, interpret=interpret)
        return acc

    acc = lax.fori_loop(0, k // bk, body, jnp.zeros((TILE_ROWS, bn), f32))
    for r in range(m):
        o_ref[r, :] = (_row(acc, r) + res_ref[r, pl.ds(col, bn)].astype(f32)).astype(o_ref.dtype)


def linear_residual_supported(m: int, k: int, n: int, block_n: int, block_k: int, sub: int) -> bool:
    return 0 < m <= MAX_ROWS and block_k % sub == 0 and k % block_k == 0 and n % block_n == 0


@functools.partial(jax.jit, static_argnames=("prologue", "aux_offset", "head_dim", "eps", "block_n", "block_k",
                                             "sub_k", "num_warps", "num_stages", "interpret"))
def linear_residual_triton(x, w_t, residual, aux=(), *, prologue: str = NONE, aux_offset: int = 0,
                           head_dim: int = 0, eps: float = 1e-6, block_n: int = 16, block_k: int = 512,
                           sub_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
                           interpret: bool = False):
    """``residual + prologue(x) @ w_t^T``: x [..., K], w_t [N, K], residual [..., N] -> [..., N] (residual.dtype).

    ``prologue``: ``"none"``; ``"gated_rms"`` with ``aux = (z_src [..., P], norm_w [head_dim])``, z of column c at
    ``z_src[..., aux_offset + c]``; ``"sigmoid_gate"`` with ``aux = (qg [..., P],)``, the per-head interleaved
    q|gate projection (head_dim D: the gate of column c at ``(c // D) 2D + D + c % D``).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    n = w_t.shape[0]
    m = 1
    for s in lead:
        m *= s
    sub = sub_k or (head_dim if prologue == GATED_RMS else min(block_k, 128))
    if prologue == GATED_RMS and sub != head_dim:
        raise ValueError("gated_rms needs sub_k == head_dim")
    if prologue == SIGMOID_GATE and head_dim % sub:
        raise ValueError("sigmoid_gate needs sub_k to divide head_dim")
    if not linear_residual_supported(m, k, n, block_n, block_k, sub):
        raise ValueError(f"linear_residual: unsupported shape [{m}, {k}] x [{n}, {k}]^T for BN={block_n}, "
                         f"BK={block_k}, sub={sub}")
    aux2 = tuple(a.reshape(m, a.shape[-1]) if a.ndim > 1 else a for a in aux)
    aux_specs = [pl.BlockSpec(a.shape, (lambda j: (0, 0)) if a.ndim == 2 else (lambda j: (0,))) for a in aux2]
    y = pl.pallas_call(
        functools.partial(_linear_residual_kernel, m=m, k=k, bk=block_k, sub=sub, bn=block_n, prologue=prologue,
                          aux_offset=aux_offset, head_dim=head_dim, eps=float(eps), dtype=work_dtype(w_t.dtype),
                          interpret=bool(interpret)),
        out_shape=jax.ShapeDtypeStruct((m, n), residual.dtype),
        grid=(n // block_n,),
        in_specs=[pl.BlockSpec((m, k), lambda j: (0, 0)), pl.BlockSpec(w_t.shape, lambda j: (0, 0)),
                  pl.BlockSpec((m, n), lambda j: (0, 0)), *aux_specs],
        out_specs=pl.BlockSpec((m, block_n), lambda j: (0, j)),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="linear_residual",
    )(x.reshape(m, k), w_t, residual.reshape(m, n), *aux2)
    return y.reshape(*lead, n)
