"""Matmul for few rows (decode and verify) on GPU: Pallas with the Triton lowering, streaming the weight once.

With M <= 64 rows a projection is a matrix-vector product bounded by reading W. Grid ``(N / BN, splits)``: each
program owns a ``BN``-wide column slab of W and a share of the K axis, loops over it in ``BK`` steps (Triton
pipelines the loads, ``num_stages`` deep) and multiplies the ``[Mp, BK]`` row tile by the ``[BK, BN]`` weight tile
(rows padded to Mp >= 16, the smallest dot). With fewer column slabs than about two waves of programs the K axis is
split and a jnp sum combines the float32 partials. ``transpose_w`` reads W stored ``[N, K]`` (a tied LM head, the
embedding) as ``[BN, BK]`` tiles. An int8 W (the draft head, :func:`jaxmtp.pallas.matmul.quantized_linear`) is read
as int8 and widened in registers, so the kernel streams half the bytes of a bfloat16 W; an int4 W (uint8 ``[N, K/2]``
as :func:`jaxmtp.pallas.matmul.reference.unpack_int4` lays it out, ``transpose_w`` only, BK = 128) a quarter: each
step reads a block's 64 bytes per row and multiplies its low and high nibbles with the block's two 64-wide halves of
the rows. XLA's own choices at these shapes read well below the HBM bandwidth (docs/kernels.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import SplitSum, mm, next_pow2, swiglu_tile, work_dtype
from jaxmtp.pallas.matmul.reference import INT4_BLOCK
from jaxmtp.pallas.policy import device_num_sms

MAX_ROWS = 64


def supports(m: int, k: int, n: int, int4: bool = False) -> bool:
    """Shapes the kernel takes: at most 64 rows, K a multiple of 64 (of 128 for int4 weights), N a multiple of 16."""
    return 0 < m <= MAX_ROWS and k % (INT4_BLOCK if int4 else 64) == 0 and n % 16 == 0


def plan(m: int, k: int, n: int, num_sms: int | None = None):
    """Static tiling ``(Mp, BN, BK, splits)`` for an [m, k] x [k, n] product (``num_sms``: default the device's)."""
    num_sms = num_sms or device_num_sms()
    mp = max(16, next_pow2(m))
    bn = next(b for b in (128, 64, 32, 16) if n % b == 0)
    if n // bn < num_sms and bn > 64:  # narrow slabs before splitting K
        bn = 64
    bk = 128 if k % 128 == 0 else 64
    steps, tiles = k // bk, n // bn
    want = math.ceil(2 * num_sms / tiles)  # about two waves of programs
    splits = next((s for s in range(want, steps + 1) if steps % s == 0), steps) if want > 1 else 1
    return mp, bn, bk, splits


def partials_plan(m: int, k: int, n: int, max_splits: int, num_sms: int | None = None):
    """Static tiling ``(BN, BK, splits)`` of a product whose float32 partials are added by their consumer (the add +
    norm kernel, which loads every split's row): at most ``max_splits`` splits along K, then column slabs as wide as
    still give a wave of programs (``splits * N / BN >= num_sms``; 16 at the narrowest)."""
    num_sms = num_sms or device_num_sms()
    _, _, bk, _ = plan(m, k, n, num_sms)
    steps = k // bk
    splits = max(s for s in range(1, max_splits + 1) if steps % s == 0)
    widths = [b for b in (128, 64, 32, 16) if n % b == 0]
    bn = next((b for b in widths if splits * (n // b) >= num_sms), widths[-1])
    return bn, bk, splits


def output_plan(k: int, n: int):
    """``(BN, BK, num_warps, num_stages)`` for a block's output product with few rows, W ``[N, K]`` bfloat16, one split
    along K, rows masked (:func:`jaxmtp.pallas.matmul.output_linear`)."""
    bn = 16 if n % 16 == 0 else 8
    bk = next(b for b in (256, 128, 64) if k % b == 0)
    return bn, bk, 4, 4


def _operand_dtype(x_dtype, w_dtype):
    """In-kernel operand dtype: int8 / packed int4 weights are widened to the activations' dtype (exact for bfloat16:
    |q| <= 127 fits its 8-bit significand), other weights keep theirs (:func:`work_dtype`)."""
    if jnp.dtype(w_dtype) in (jnp.int8, jnp.uint8):
        return work_dtype(x_dtype)
    return work_dtype(w_dtype)


def _rows(x_ref, off, bk, m, swiglu):
    """x's columns ``[off, off + bk)`` as the ``[Mp, bk]`` dot operand. With ``m`` < Mp rows (x not padded) the rows
    from m on are masked to 0. ``swiglu`` (x = gate | up, each ``swiglu`` wide): ``silu(gate) * up`` rounded to x's
    dtype, as :func:`jaxmtp.pallas.matmul.reference.swiglu_reference` materialises it."""
    mp = x_ref.shape[0]
    if m == mp:
        load = lambda o: x_ref[:, pl.ds(o, bk)]  # noqa: E731
    else:
        live = lax.broadcasted_iota(jnp.int32, (mp, bk), 0) < m
        load = lambda o: pltr.load(x_ref.at[:, pl.ds(o, bk)], mask=live, other=0)  # noqa: E731
    if not swiglu:
        return load(off)
    g, u = load(off).astype(jnp.float32), load(swiglu + off).astype(jnp.float32)
    return swiglu_tile(g, u, x_ref.dtype)


def _kernel(x_ref, w_ref, *refs, m, bk, k_per_split, transpose_w, int4, swiglu, dtype, interpret):
    """refs: ``[column scale], out``."""
    scale_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    k0 = pl.program_id(1) * k_per_split
    mp, bn = x_ref.shape[0], o_ref.shape[-1]

    def body(i, acc):
        off = pl.multiple_of(k0 + i * bk, bk)
        if int4:  # bk = 128: 64 bytes per row hold the block's two halves (low nibble: first half)
            half = bk // 2
            b = w_ref[:, pl.ds(pl.multiple_of(off // 2, half), half)].astype(jnp.int32)
            lo, hi = (b & 15) - 8, (b >> 4) - 8
            acc = acc + mm(x_ref[:, pl.ds(off, half)], lo, tb=True, dtype=dtype, interpret=interpret)
            return acc + mm(x_ref[:, pl.ds(off + half, half)], hi, tb=True, dtype=dtype, interpret=interpret)
        xb = _rows(x_ref, off, bk, m, swiglu)
        if transpose_w:
            return acc + mm(xb, w_ref[:, pl.ds(off, bk)], tb=True, dtype=dtype, interpret=interpret)
        return acc + mm(xb, w_ref[pl.ds(off, bk), :], dtype=dtype, interpret=interpret)

    acc = lax.fori_loop(0, k_per_split // bk, body, jnp.zeros((mp, bn), jnp.float32))
    if scale_ref is not None:  # a quantised weight's column scale, on the float32 sums (one split)
        acc = acc * scale_ref[...][None, :]
    acc = acc.astype(o_ref.dtype)
    if m == mp:
        o_ref[...] = acc
    else:  # the output is not padded either: rows from m on are not stored
        pltr.store(o_ref, acc, mask=lax.broadcasted_iota(jnp.int32, (mp, bn), 0) < m)


@functools.partial(jax.jit, static_argnames=("transpose_w", "out_dtype", "block_n", "block_k", "splits",
                                             "num_warps", "num_stages", "swiglu", "mask_rows", "partials",
                                             "num_sms", "interpret"))
def skinny_matmul_triton(x, w, scale=None, *, transpose_w=False, out_dtype=None, block_n=None, block_k=None,
                         splits=None, num_warps=None, num_stages=None, swiglu=False, mask_rows=False, partials=False,
                         num_sms=None, interpret=False):
    """Same contract as :func:`matmul_reference` for shapes :func:`supports` accepts. ``swiglu`` (floating weights):
    x is the gate|up projection's output [..., >= 2K] and the product's input ``silu(gate) * up``. ``mask_rows``
    (not with int4 weights): x and the output are not padded to Mp rows; the kernel masks the missing rows instead
    (no pad kernel before it, no slice after). ``partials`` (with ``mask_rows``): with several splits along K, a
    :class:`jaxmtp.pallas._common.SplitSum` of the float32 partials ``[S, ..., N]`` instead of their sum. ``scale``
    (float32 [N]; an int8 W): each column's float32 sum times its scale, then the cast, as
    :func:`jaxmtp.pallas.matmul.reference.quantized_matmul_reference` (one split along K, no scale kernel after)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    lead = x.shape[:-1]
    kdim = (w.shape[1] if transpose_w else w.shape[0]) if swiglu else x.shape[-1]
    n = w.shape[0] if transpose_w else w.shape[1]
    m = math.prod(lead)
    int4 = w.dtype == jnp.uint8
    bad_swiglu = swiglu and (x.shape[-1] < 2 * kdim or jnp.dtype(w.dtype) in (jnp.int8, jnp.uint8))
    if not supports(m, kdim, n, int4=int4) or (int4 and (not transpose_w or w.shape[1] * 2 != kdim)) or bad_swiglu:
        raise ValueError(f"unsupported skinny matmul: [{m}, {x.shape[-1]}] x W {w.shape} {w.dtype}, "
                         f"transpose_w={transpose_w}, swiglu={swiglu}")
    bad_scale = scale is not None and (scale.shape != (n,) or scale.dtype != jnp.float32 or w.dtype != jnp.int8)
    if bad_scale or (scale is not None and (splits or 1) != 1):
        raise ValueError(f"unsupported column scale {scale.shape} {scale.dtype} for W {w.shape} {w.dtype} "
                         f"(int8 weights, one split)")
    num_sms = num_sms or device_num_sms()
    mp, bn0, bk0, s0 = plan(m, kdim, n, num_sms)
    if scale is not None:  # one split: slabs narrow enough for a wave of programs
        bn0, s0 = next((b for b in (64, 32) if n % b == 0 and n // b >= num_sms), 16), 1
    bn, bk = block_n or bn0, block_k or bk0
    if int4 and bk != INT4_BLOCK:
        raise ValueError(f"int4 weights are read in blocks of {INT4_BLOCK} along K, not {bk}")
    ns = splits or (s0 if block_n is None and block_k is None else 1)
    if mask_rows and int4:
        raise ValueError("masked rows are not supported with int4 weights")
    if n % bn or kdim % (bk * ns):
        raise ValueError(f"tiles BN={bn}, BK={bk}, splits={ns} do not divide [{kdim}, {n}]")
    kernel = functools.partial(_kernel, m=m if mask_rows else mp, bk=bk, k_per_split=kdim // ns,
                               transpose_w=transpose_w, int4=int4, swiglu=kdim if swiglu else 0,
                               dtype=_operand_dtype(x.dtype, w.dtype), interpret=bool(interpret))
    if partials and not mask_rows:
        raise ValueError("partials need mask_rows (unpadded rows)")
    return launch_row_kernel(kernel, x, w, rows=mp, block_n=bn, splits=ns, transpose_w=transpose_w,
                             out_dtype=out_dtype, num_warps=num_warps or 4, num_stages=num_stages or 4,
                             interpret=interpret, name="skinny_matmul", pad=not mask_rows, partials=partials,
                             column_scale=scale)


def launch_row_kernel(kernel, x, w, *, rows, block_n, splits, transpose_w, out_dtype, num_warps, num_stages,
                      interpret, name, pad=True, column_scale=None, partials=False, row_weight=None, residual=None,
                      glu_width=None):
    """The launch both few-row kernels share: x [..., K] (or wider: the kernel picks its columns) padded to ``rows``
    rows (``pad=False``: not padded, the kernel masks the missing rows), grid ``(N / block_n, splits)``, program j
    reading W's column (or, ``transpose_w``, row) slab j whole, writing ``[rows, block_n]`` of the output (float32
    partials per split, summed here, or with ``partials`` returned as a :class:`SplitSum`). Optional inputs follow W
    in this order (one split only): ``column_scale`` [N], its ``block_n`` slice per program; ``row_weight`` [K],
    whole in every program; ``residual`` [..., N] (x's rows, padded like x), its ``[rows, block_n]`` slice.
    ``glu_width`` I (``transpose_w``, one split): the output is I wide, program j's slab of W is followed by the
    matching slab of W's rows ``[I, 2I)`` (and ``column_scale``'s slice by its matching slice). Returns [..., N] (I)
    in ``out_dtype``."""
    lead, kdim = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    n = glu_width or (w.shape[0] if transpose_w else w.shape[1])
    x2 = x.reshape(m, kdim)
    if rows != m and pad:
        x2 = jnp.pad(x2, ((0, rows - m), (0, 0)))
    if splits != 1 and (column_scale is not None or row_weight is not None or residual is not None or glu_width):
        raise ValueError("column scales, row weights, residuals and paired slabs need one split along K")
    if glu_width and (not transpose_w or glu_width % block_n):
        raise ValueError(f"paired slabs need W stored [N, K] and I = {glu_width} a multiple of {block_n}")
    views = (0, glu_width // block_n) if glu_width else (0,)  # slab offsets of W's views (the up rows second)
    w_spec = (pl.BlockSpec((block_n, w.shape[1]), lambda j, s: (j, 0)) if transpose_w
              else pl.BlockSpec((w.shape[0], block_n), lambda j, s: (0, j)))
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((rows if pad else m, n), out_dtype)
        out_spec = pl.BlockSpec((rows, block_n), lambda j, s: (0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((splits, rows if pad else m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, rows, block_n), lambda j, s: (s, 0, j))
    in_specs, args = [pl.BlockSpec((rows, kdim), lambda j, s: (0, 0)), w_spec], [x2, w]
    for v in views[1:]:
        in_specs.append(pl.BlockSpec((block_n, w.shape[1]), lambda j, s, v=v: (j + v, 0)))
        args.append(w)
    if column_scale is not None:
        for v in views:
            in_specs.append(pl.BlockSpec((block_n,), lambda j, s, v=v: (j + v,)))
            args.append(column_scale)
    if row_weight is not None:
        in_specs.append(pl.BlockSpec(row_weight.shape, lambda j, s: (0,)))
        args.append(row_weight)
    if residual is not None:
        r2 = residual.reshape(m, n)
        if rows != m and pad:
            r2 = jnp.pad(r2, ((0, rows - m), (0, 0)))
        in_specs.append(pl.BlockSpec((rows, block_n), lambda j, s: (0, j)))
        args.append(r2)
    y = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n // block_n, splits),
        in_specs=in_specs,
        out_specs=out_spec,
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    if splits > 1 and partials:
        return SplitSum(y.reshape(splits, *lead, n), out_dtype)
    if splits > 1:
        y = jnp.sum(y, axis=0)
    return y[:m].astype(out_dtype).reshape(*lead, n)
