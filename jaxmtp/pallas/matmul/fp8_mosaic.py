"""Few-row products with block-FP8 weights on Hopper GPUs: Pallas with the Mosaic GPU lowering (TMA copies into
shared memory, warpgroup matrix products with the widened weight as the register operand).

The product of :mod:`.fp8_triton` (same weight format, same reference
:func:`jaxmtp.pallas.matmul.reference.fp8_matmul_reference`), computed transposed: ``y^T [N, M] = W [N, K] x^T``, so
that the weight is the products' 64-row left operand and the few rows of x (padded to 8 or 16) their right operand.
Program (j, s) owns W's rows ``[j BN, (j + 1) BN)`` and the s-th share of K; per 128-wide block of K, a pipeline of
``stages`` TMA copies brings the ``[BN, 128]`` e4m3 tile and the rows' ``[MP, 128]`` tile into shared memory, one
warpgroup loads the weight tile into registers, widens it (exactly) to 16 bits, runs ``[BN, 128] x [128, MP]`` into
a fresh float32 accumulator and adds it, times the block's scale, to its running sum. The partial sums ``[splits,
N, MP]`` are added in split order and transposed outside.

The 16-bit type: bfloat16 where the toolchain converts e4m3 to it (PTX ISA 9.2), else float16, with each row of x
scaled by a power of two so that its largest magnitude lies in [2^13, 2^14) (exact; values below 2^-29 of the row's
largest lose bits) and the product scaled back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxmtp.pallas.matmul.reference import FP8_BLOCK, FP8_DTYPE


def supports(m: int, k: int, n: int, block_n: int = 64) -> bool:
    """Shapes the kernel takes: up to 16 rows, K and N whole 128-wide blocks (N whole ``block_n`` tiles)."""
    return 1 <= m <= 16 and k % FP8_BLOCK == 0 and n % FP8_BLOCK == 0 and n % block_n == 0


def tile_weight(w, block_n: int = 64):
    """e4m3 W [N, K] as ``[N / BN, K / 128, BN, 128]``: each program's 128-wide block of K one contiguous tile."""
    n, k = w.shape
    return w.reshape(n // block_n, block_n, k // FP8_BLOCK, FP8_BLOCK).transpose(0, 2, 1, 3)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_n", "block_k", "splits", "stages", "work"))
def fp8_rows_mosaic(x, w, block_scale, *, out_dtype=None, block_n=64, block_k=128, splits=1, stages=4,
                    work="float16"):
    """``x @ (w * scale)^T``: x [..., K] floating with at most 16 rows; w e4m3 [N, K] (or :func:`tile_weight`'s
    ``[N / BN, K / 128, BN, 128]``); block_scale float32 [N / 128, K / 128]. Returns [..., N] in ``out_dtype``
    (default x's), float32 accumulation. ``block_k``: K per pipeline step (a multiple of 128)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    lead, k = x.shape[:-1], x.shape[-1]
    tiled = w.ndim == 4
    n = w.shape[0] * w.shape[2] if tiled else w.shape[0]
    if tiled and (w.shape[2] != block_n or w.shape[1] * FP8_BLOCK != k):
        raise ValueError(f"a tiled weight {w.shape} for BN {block_n}, K {k}")
    m = 1
    for d in lead:
        m *= d
    kb = k // FP8_BLOCK
    if (not supports(m, k, n, block_n) or w.dtype != FP8_DTYPE or block_scale.shape != (n // FP8_BLOCK, kb)
            or kb % splits or block_n not in (64, 128) or block_k % FP8_BLOCK or (kb // splits) % (block_k // 128)):
        raise ValueError(f"unsupported FP8 product: x {x.shape}, W {w.shape} {w.dtype}, scale {block_scale.shape}, "
                         f"BN {block_n}, splits {splits}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    mp = 8 if m <= 8 else 16
    f32 = jnp.float32
    wdt = jnp.dtype(work)
    x2 = x.reshape(m, k).astype(f32)
    if wdt == jnp.float16:  # rows into [2^13, 2^14): exact in float16 for every value above 2^-29 of the row's largest
        _, e = jnp.frexp(jnp.max(jnp.abs(x2), axis=1))
        shift = 14 - e
        x2 = jnp.ldexp(x2, shift[:, None])
    xp = jnp.pad(x2.astype(wdt), ((0, mp - m), (0, 0)))
    sub = block_k // FP8_BLOCK  # 128-wide blocks per pipeline step
    steps = kb // splits // sub
    scale = block_scale.astype(f32)

    def kernel(x_ref, w_ref, s_ref, o_ref, o_smem):
        j = lax.axis_index("n")
        sp = lax.axis_index("split")
        nb = lax.div(j * block_n, jnp.int32(FP8_BLOCK))
        k0 = sp * steps * sub  # the split's first 128-wide block

        def body(idx, w_smem, x_smem, acc):
            (i,) = idx
            for u in range(sub):
                tile = w_smem.at[u] if tiled else w_smem.at[:, pl.ds(u * FP8_BLOCK, FP8_BLOCK)]
                a = plgpu.load(tile, (), layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(wdt)
                a = plgpu.layout_cast(a, plgpu.Layout.WGMMA)
                xt = x_smem.at[:, pl.ds(u * FP8_BLOCK, FP8_BLOCK)]

                def mm(ref, a=a, xt=xt):
                    plgpu.wgmma(ref, a, plgpu.transpose_ref(xt, (1, 0)))
                    return ref[...]

                part = pl.run_scoped(mm, plgpu.ACC((block_n, mp), f32))
                acc = acc + part * s_ref[nb, k0 + i * sub + u]
            return acc

        acc0 = plgpu.layout_cast(jnp.zeros((block_n, mp), f32), plgpu.Layout.WGMMA)
        w_tiles = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
        x_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        if tiled:
            w_spec = plgpu.BlockSpec((sub, block_n, FP8_BLOCK), lambda i: (i, 0, 0), transforms=w_tiles)
            w_src = w_ref.at[j, pl.ds(k0, steps * sub)]
        else:
            w_spec = plgpu.BlockSpec((block_n, block_k), lambda i: (0, i), transforms=w_tiles)
            w_src = w_ref.at[pl.ds(j * block_n, block_n), pl.ds(k0 * FP8_BLOCK, steps * block_k)]
        acc = plgpu.emit_pipeline(
            body,
            grid=(steps,),
            in_specs=[w_spec, plgpu.BlockSpec((mp, block_k), lambda i: (0, i), transforms=x_tiles)],
            max_concurrent_steps=stages,
            init_carry=acc0,
        )(w_src, x_ref.at[:, pl.ds(k0 * FP8_BLOCK, steps * block_k)])
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[sp, j])
        plgpu.wait_smem_to_gmem(0)

    parts = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n // block_n, block_n, mp), f32),
        grid=(n // block_n, splits),
        grid_names=("n", "split"),
        scratch_types=dict(o_smem=plgpu.SMEM((block_n, mp), f32)),
    )(xp, w, scale)
    y = parts[0]
    for s in range(1, splits):  # split order, as the Triton kernel's partial sums
        y = y + parts[s]
    y = y.reshape(n, mp)[:, :m].T
    if wdt == jnp.float16:
        y = jnp.ldexp(y, -shift[:, None])
    return y.astype(out_dtype).reshape(*lead, n)
