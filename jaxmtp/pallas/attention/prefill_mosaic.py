"""Causal prefill attention over the KV cache on Hopper GPUs: Pallas with the Mosaic GPU lowering (TMA copies into
shared memory, warpgroup matrix products), for prefill chunks; decode and verify windows stay with
:mod:`.decode_triton`. Reference: :func:`jaxmtp.pallas.attention.reference.attention_reference`.

Program (query head h, tile of 2 x BQ query rows, batch row b), three warpgroups: two compute warpgroups own BQ rows
each, the third streams K and V blocks of BKV cache rows into a ring of ``stages`` shared-memory slots (a "full"
barrier per slot that the copy completes, a "free" barrier that both compute warpgroups arrive on once they have
read it). Query row i of batch row b sits at position ``start[b] + i`` (the rows of a prefill chunk are consecutive;
padding rows past a row's tokens compute values nobody reads) and sees cache rows ``j <= start[b] + i``. Both compute
warpgroups walk the same kv blocks, those up to the program's last row, masking only the blocks that reach past a
row's position, so their barrier phases stay in step. Online softmax in base 2 (scores scaled by ``scale * log2 e``),
a float32 ``[BQ, D]`` accumulator in registers, p rounded to the cache dtype for the second product (as the Triton
kernel does). The grid reads K and V once per query head: the Hq / Hkv heads of a group read the same blocks.

Measured on an H100 against the Triton kernel's prefill tiles: 1.2-1.3x faster at 4k-16k prompts, 1.4-1.6x at late
1-2k chunks of 8k-32k caches (docs/performance.md, "Attention over the KV cache").
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK_Q = 64  # rows per compute warpgroup (one wgmma M tile)
BLOCK_KV = 64  # cache rows per block
STAGES = 2  # K / V slots: 2 x 64 x 256 x 2 bytes each, with the query tiles 192 KiB of shared memory at D = 256


def supports(t: int, hq: int, hkv: int, d: int, s: int, dtype) -> bool:
    """Shapes the kernel takes: a 16-bit float cache, head_dim a multiple of 64 up to 256, Hq a multiple of Hkv, a
    cache of whole kv blocks (T is padded to whole tiles by :func:`prefill_attention_mosaic`)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and d % 64 == 0 and d <= 256
            and hq % hkv == 0 and s % BLOCK_KV == 0 and t >= 1)


@functools.partial(jax.jit, static_argnames=("scale",))
def prefill_attention_mosaic(q, k_cache, v_cache, q_positions, *, scale=None):
    """Attention of consecutive query rows over the cache: q [B, T, Hq, D] (the cache's dtype), caches
    [B, Hkv, S, D], q_positions [B, T] (row i at ``q_positions[b, 0] + i``; -1 = padding, at the end of a row).
    Returns [B, T, Hq, D] in q's dtype; padding rows hold finite values that nothing reads (the Triton kernel writes
    zeros there; masking them here would cost a pass over the output)."""
    b, t, hq, d = q.shape
    _, hkv, s, _ = k_cache.shape
    if not supports(t, hq, hkv, d, s, k_cache.dtype) or q.dtype != k_cache.dtype:
        raise ValueError(f"unsupported prefill attention: q {q.shape} {q.dtype}, cache {k_cache.shape} "
                         f"{k_cache.dtype}")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    block_q, block_kv, stages = BLOCK_Q, BLOCK_KV, STAGES
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    dtype = q.dtype
    pad = -t % (2 * block_q)
    start = jnp.maximum(q_positions[:, 0], 0).astype(jnp.int32)
    q_in = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else q
    c = float(scale * math.log2(math.e))
    n_kv = s // block_kv

    def kernel(q_ref, k_ref, v_ref, start_ref, o_ref, q_smem, k_smem, v_smem, q_bar, k_full, v_full, k_free, v_free):
        h = lax.axis_index("heads")
        tile = lax.axis_index("q_seq")
        bi = lax.axis_index("batch")
        wg = lax.axis_index("wg")
        p0 = start_ref[bi]
        last = p0 + (tile + 1) * (2 * block_q) - 1  # the program's last row's position
        steps = jnp.minimum(lax.div(last, jnp.int32(block_kv)) + 1, jnp.int32(n_kv))

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_base = tile * (2 * block_q) + wg * block_q
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_base, block_q), h], q_smem.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((block_q, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            first_pos = p0 + q_base

            def step(i, carry, masked):
                acc, m, l = carry
                slot = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(k_full.at[slot])

                def qk(ref):  # JAX 0.11 deprecates transpose_ref for ref.transpose; checked on the GPU as written
                    plgpu.wgmma(ref, q_smem.at[wg], plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    return ref[...]

                sc = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                sc = sc * c
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                    sc = jnp.where(first_pos + rows >= i * block_kv + cols, sc, -jnp.inf)
                m_new = jnp.maximum(m, sc.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                plgpu.barrier_wait(v_full.at[slot])

                def pv(ref):
                    plgpu.wgmma(ref, p.astype(dtype), v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            full = jnp.minimum(lax.div(first_pos + 1, jnp.int32(block_kv)), steps)
            carry = lax.fori_loop(0, full, functools.partial(step, masked=False), (acc, m, l))
            acc, m, l = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
            acc = acc / lax.broadcast_in_dim(l, acc.shape, [0])
            q_smem.at[wg][...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[bi, pl.ds(q_base, block_q), h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _copy():
            plgpu.set_max_registers(40, action="decrease")
            kvh = lax.div(h, jnp.int32(g))
            for j in range(stages):
                @pl.when(j < steps)
                def _():
                    rows = (bi, kvh, pl.ds(j * block_kv, block_kv))
                    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[j], k_full.at[j])
                    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[j], v_full.at[j])

            @pl.loop(stages, steps)
            def _(i):
                slot = lax.rem(i, jnp.int32(stages))
                rows = (bi, kvh, pl.ds(i * block_kv, block_kv))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_full.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_full.at[slot])

    def entry(q_ref, k_ref, v_ref, start_ref, o_ref):
        tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *refs: kernel(q_ref, k_ref, v_ref, start_ref, o_ref, *refs),
            plgpu.SMEM((2, block_q, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, block_kv, d), dtype, transforms=tiles),
            plgpu.SMEM((stages, block_kv, d), dtype, transforms=tiles),
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            collective_axes="wg",
        )

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q_in.shape, dtype),
        grid=(hq, (t + pad) // (2 * block_q), b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q_in, k_cache, v_cache, start)
    return out[:, :t] if pad else out
