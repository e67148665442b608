"""Routed MoE experts for TPU (Pallas, Mosaic lowering): grouped matmuls over row blocks of one expert each.

Same layout and two launches as :mod:`grouped_triton`. The expert of each row block and the number of valid blocks
are scalar-prefetched, and the weight index maps read the block's expert from them. Grids are ``(column tiles, row
blocks)``: the row-block axis is innermost, so consecutive blocks of one expert see an unchanged weight block index
and the pipeline does not fetch the tile again; invalid trailing blocks repeat the last valid block's expert (and
clamp their row block index), so they fetch nothing, and their compute is skipped.

* ``up``: x rows ``[bm, H]`` times the gate and up column tiles ``[H, bn]`` of the expert (two block specs on the
  same array when bn divides I and is a multiple of 128; otherwise the whole ``[H, 2I]`` expert, sliced in the
  kernel), writing ``silu(gate) * up`` ``[bm, bn]``.
* ``down``: activation rows ``[bm, I]`` times the down tile ``[I, bn]`` (bn a multiple of 128 dividing H, else H),
  written in float32; the same jnp step as the GPU version weights and sums the pairs.

Every block's last two dims are whole array dims or multiples of (8, 128). Proven in TPU interpret mode only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxmtp.pallas._common import swiglu_tile, work_dtype
from jaxmtp.pallas.moe.layout import choose_layout, combine, gather_rows, make_layout

_VMEM_TILE_BYTES = 4 << 20  # per weight tile (double-buffered by the pipeline)


def _lane_tile(n: int, rows: int, itemsize: int, cap: int = 512) -> int | None:
    """Largest multiple of 128 (<= cap) dividing n whose [rows, tile] block fits the tile budget; None if none."""
    for t in (512, 256, 128):
        if t <= cap and n % t == 0 and rows * t * itemsize <= _VMEM_TILE_BYTES:
            return t
    return None


def _dot(a, b, dtype):
    return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _up_kernel(be_ref, nv_ref, x_ref, *refs, i_size, split_cols, dtype):
    @pl.when(pl.program_id(1) < nv_ref[0])
    def _():
        x = x_ref[...]
        if split_cols:
            g_ref, u_ref, act_ref = refs
            g, u = _dot(x, g_ref[...], dtype), _dot(x, u_ref[...], dtype)
        else:
            gu_ref, act_ref = refs
            hh = _dot(x, gu_ref[...], dtype)
            g, u = hh[:, :i_size], hh[:, i_size:]
        act_ref[...] = swiglu_tile(g, u, act_ref.dtype)


def _down_kernel(be_ref, nv_ref, a_ref, d_ref, y_ref, *, dtype):
    @pl.when(pl.program_id(1) < nv_ref[0])
    def _():
        y_ref[...] = _dot(a_ref[...], d_ref[...], dtype)


@functools.partial(jax.jit, static_argnames=("layout", "block_rows", "block_up", "block_down", "interpret"))
def moe_experts_tpu(x, weights, experts, gate_up, down, *, layout=None, block_rows=None, block_up=None,
                    block_down=None, interpret=False):
    """Same contract as :func:`moe_reference`. ``layout``, ``block_rows`` (bm, a multiple of 8), ``block_up`` and
    ``block_down`` (multiples of 128 dividing I and H) override the plan."""
    n, h = x.shape
    k = experts.shape[1]
    num_experts, _, two_i = gate_up.shape
    i_size = two_i // 2
    mode, bm, nb = choose_layout(n * k, num_experts, max_block_rows=128, layout=layout, block_rows=block_rows)
    dtype = work_dtype(jnp.promote_types(x.dtype, gate_up.dtype))
    item = jnp.dtype(gate_up.dtype).itemsize
    bn1 = block_up or _lane_tile(i_size, h, item, cap=256)
    bn2 = block_down or _lane_tile(h, i_size, item) or h
    split_cols = bn1 is not None
    if (split_cols and i_size % bn1) or h % bn2 or bm % 8:
        raise ValueError(f"tiles (bm {bm}, up {bn1}, down {bn2}) do not fit H={h}, I={i_size}")
    lay = make_layout(experts, num_experts, mode, bm, nb)
    rows = gather_rows(x, lay, dtype)
    r = nb * bm

    def row_map(c, rb, be, nv):  # invalid trailing blocks re-use the last valid block (nothing fetched)
        return jnp.minimum(rb, nv[0] - 1), 0

    if split_cols:
        n_c = i_size // bn1
        w_specs = [pl.BlockSpec((None, h, bn1), lambda c, rb, be, nv: (be[rb], 0, c)),
                   pl.BlockSpec((None, h, bn1), lambda c, rb, be, nv: (be[rb], 0, c + n_c))]
        w_args = (gate_up, gate_up)
    else:
        n_c, bn1 = 1, i_size
        w_specs = [pl.BlockSpec((None, h, two_i), lambda c, rb, be, nv: (be[rb], 0, 0))]
        w_args = (gate_up,)
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
    act = pl.pallas_call(
        functools.partial(_up_kernel, i_size=i_size, split_cols=split_cols, dtype=dtype),
        out_shape=jax.ShapeDtypeStruct((r, i_size), dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n_c, nb),
            in_specs=[pl.BlockSpec((bm, h), row_map), *w_specs],
            out_specs=pl.BlockSpec((bm, bn1), lambda c, rb, be, nv: (rb, c)),
        ),
        compiler_params=params,
        interpret=interpret,
        name="moe_up_tpu",
    )(lay.block_expert, lay.n_valid, rows, *w_args)
    y = pl.pallas_call(
        functools.partial(_down_kernel, dtype=dtype),
        out_shape=jax.ShapeDtypeStruct((r, h), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(h // bn2, nb),
            in_specs=[pl.BlockSpec((bm, i_size), row_map),
                      pl.BlockSpec((None, i_size, bn2), lambda c, rb, be, nv: (be[rb], 0, c))],
            out_specs=pl.BlockSpec((bm, bn2), lambda c, rb, be, nv: (rb, c)),
        ),
        compiler_params=params,
        interpret=interpret,
        name="moe_down_tpu",
    )(lay.block_expert, lay.n_valid, act, down)
    return combine(y, weights, lay, x.dtype)
