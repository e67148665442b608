"""A recursive draft pass's input in one kernel (Pallas, Triton lowering): the previous draft's id from the head's
argmax partials, its embedding row, both pre-fc norms and their concatenation.

The MTP pass's input is ``concat[rms_norm(E[d], w_e), rms_norm(h, w_h)]`` for the draft d that the previous pass's
head chose and that pass's hidden h. With the int4 head's argmax kernel
(:func:`jaxmtp.pallas.matmul.w4a8_triton.w4a8_argmax_partials_triton`) d is still spread over the head programs'
``(vals, idx)`` ``[Mp, G]``; XLA finished it with four kernels (the argmax over the programs, the gather and norm of
E[d], the norm of h, the concatenation). Here one program per row does it all: the argmax over G in power-of-two
windows (the last one ending at G, overlapping the one before: ties still go to the first column, as
``jnp.argmax``), the row of E at d, the two norms in float32 (:func:`jaxmtp.pallas.norms.reference.rms_norm`), and writes d and
the ``[2H]`` row. :func:`fc_input_triton` is the same input for ids already known (the window's draft pass, whose
next tokens are the verify's choices): the embedding rows, the norms and the concatenation in one kernel where XLA
ran two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas.norms.add_rms_norm_triton import chunk_size, supports

NUM_WARPS = 8
WINDOW = 8192  # partials read per step of the argmax (few, wide steps: narrow windows measured slower)


def window(g: int) -> int:
    """The argmax's window: ``WINDOW``, or the largest power of two <= g when that is smaller."""
    return min(WINDOW, 1 << (g.bit_length() - 1))


def windows(g: int) -> list[int]:
    """Starts of the :func:`window`-wide windows that cover ``[0, g)`` (the last one ending at g)."""
    w = window(g)
    starts = list(range(0, g - w + 1, w))
    if starts[-1] + w < g:
        starts.append(g - w)
    return starts


def _norm_row(load, w_ref, hdim, chunk, eps):
    """``rms_norm`` of one row given as ``load(slice)`` in float32: the normalised chunks, unrounded."""
    sls = [pl.ds(j * chunk, chunk) for j in range(hdim // chunk)]
    xs = [load(sl).astype(jnp.float32) for sl in sls]
    inv = lax.rsqrt(functools.reduce(lambda a, b: a + b, [jnp.sum(x * x) for x in xs]) / hdim + eps)
    return [x * inv * (1.0 + w_ref[sl].astype(jnp.float32)) for x, sl in zip(xs, sls)]


def _write_input(tok, b, emb_ref, h_ref, we_ref, wh_ref, out_ref, hdim, eps):
    """Row b of the fc input: ``concat[rms_norm(E[tok]), rms_norm(h[b])]``, each rounded to the output dtype."""
    chunk = chunk_size(hdim)
    e = _norm_row(lambda sl: emb_ref[tok, sl], we_ref, hdim, chunk, eps)
    h = _norm_row(lambda sl: h_ref[b, sl].astype(out_ref.dtype), wh_ref, hdim, chunk, eps)
    for j, part in enumerate(e + h):
        out_ref[b, pl.ds(j * chunk, chunk)] = part.astype(out_ref.dtype)


def _kernel(vals_ref, idx_ref, emb_ref, h_ref, we_ref, wh_ref, *refs, g, hdim, eps, offset):
    b = pl.program_id(0)
    if offset is not None:  # the pass's position too: length + offset for an active row, else -1
        len_ref, act_ref, ids_ref, out_ref, pos_ref = refs
        row_pos = jnp.where(act_ref[pl.ds(b, 1)] != 0, len_ref[pl.ds(b, 1)] + offset, -1)
    else:
        ids_ref, out_ref = refs
    best, pos, w = None, None, window(g)
    for start in windows(g):
        v = vals_ref[b, pl.ds(start, w)]
        col = start + lax.broadcasted_iota(jnp.int32, (w,), 0)
        mx = jnp.max(v)
        first = jnp.min(jnp.where(v == mx, col, g))
        if best is None:
            best, pos = mx, first
        else:  # a larger value wins; an equal one keeps the lower column
            pos = jnp.where(mx > best, first, jnp.where(mx == best, jnp.minimum(pos, first), pos))
            best = jnp.maximum(best, mx)
    tok = idx_ref[b, pl.ds(pos, 1)][0]
    _write_input(tok, b, emb_ref, h_ref, we_ref, wh_ref, out_ref, hdim, eps)
    # the small outputs last: a store before the row loads above would order them behind it (docs/kernels.md)
    ids_ref[pl.ds(b, 1)] = jnp.full((1,), tok, jnp.int32)
    if offset is not None:
        pos_ref[pl.ds(b, 1)] = row_pos.astype(jnp.int32)


def _ids_kernel(ids_ref, emb_ref, h_ref, we_ref, wh_ref, out_ref, *, hdim, eps):
    b, v = pl.program_id(0), emb_ref.shape[0]
    tok = ids_ref[pl.ds(b, 1)][0]
    tok = jnp.clip(jnp.where(tok < 0, tok + v, tok), 0, v - 1)  # as XLA's gather indexes (padding rows' ids)
    _write_input(tok, b, emb_ref, h_ref, we_ref, wh_ref, out_ref, hdim, eps)


@functools.partial(jax.jit, static_argnames=("eps", "offset", "interpret"))
def draft_input_triton(vals, idx, embed, hidden, w_e, w_h, eps, length=None, active=None, *, offset=None,
                       interpret=False):
    """vals / idx ``[Mp, G]`` (the argmax kernel's partials, rows >= B unused); embed ``[V, H]``; hidden ``[B, H]``;
    w_e / w_h ``[H]`` float32 offsets. Returns ``(ids [B] int32, x [B, 2H])`` in embed's dtype, as
    :func:`jaxmtp.pallas.draft_input.reference.draft_input_reference`. With ``length``, ``active [B]`` and a static
    ``offset``, also the pass's positions ``where(active, length + offset, -1)`` [B] int32 (no XLA kernel for
    them)."""
    b, hdim = hidden.shape
    g = vals.shape[1]
    if not supports(hdim) or embed.shape[1] != hdim or idx.shape != vals.shape or vals.shape[0] < b:
        raise ValueError(f"unsupported draft input: partials {vals.shape}, embed {embed.shape}, hidden {hidden.shape}")
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731  (rows indexed in the kernel)
    out_shape = (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, 2 * hdim), embed.dtype))
    args = [vals, idx, embed, hidden, w_e, w_h]
    if offset is not None:
        args += [length.astype(jnp.int32), active.astype(jnp.int32)]
        out_shape += (jax.ShapeDtypeStruct((b,), jnp.int32),)
    return pl.pallas_call(
        functools.partial(_kernel, g=g, hdim=hdim, eps=float(eps), offset=offset),
        out_shape=out_shape,
        grid=(b,),
        in_specs=[full(a.shape) for a in args],
        out_specs=tuple(full(o.shape) for o in out_shape),
        compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="draft_input",
    )(*args)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def fc_input_triton(ids, embed, hidden, w_e, w_h, eps, *, interpret=False):
    """ids ``[R]`` int32 (negative ids wrap and others clamp, as ``embed[ids]`` indexes); embed ``[V, H]``; hidden
    ``[R, H]``; w_e / w_h ``[H]`` float32 offsets.
    Returns ``concat[rms_norm(embed[ids], w_e), rms_norm(hidden, w_h)]`` ``[R, 2H]`` in embed's dtype, as
    :func:`jaxmtp.pallas.draft_input.reference.fc_input_reference`: one program per row."""
    r, hdim = hidden.shape
    if not supports(hdim) or embed.shape[1] != hdim or ids.shape != (r,):
        raise ValueError(f"unsupported fc input: ids {ids.shape}, embed {embed.shape}, hidden {hidden.shape}")
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731  (rows indexed in the kernel)
    return pl.pallas_call(
        functools.partial(_ids_kernel, hdim=hdim, eps=float(eps)),
        out_shape=jax.ShapeDtypeStruct((r, 2 * hdim), embed.dtype),
        grid=(r,),
        in_specs=[full(a.shape) for a in (ids, embed, hidden, w_e, w_h)],
        out_specs=full((r, 2 * hdim)),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="fc_input",
    )(ids.astype(jnp.int32), embed, hidden, w_e, w_h)
