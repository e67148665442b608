"""Routed MoE experts for GPU (Pallas, Triton lowering): grouped matmuls over row blocks of one expert each.

The (token, expert) pairs are laid out by :mod:`jaxmtp.pallas.moe.layout` in blocks of ``bm`` rows that all use
one expert (``block_expert``, read by the kernels from an int32 array: the Triton lowering has no scalar prefetch).
Two launches, both with the column-tile axis first, i.e. fastest in the launch order: the programs of one row block
run side by side and share its rows in L2, and the blocks of one expert (consecutive) are only a few programs apart,
so an expert's weight tile is read from memory about once however many blocks it has:

* ``up``, grid ``(I / bn, row blocks, splits of H)``: ``x`` rows ``[bm, H]`` times the expert's gate and up column
  tiles ``[H, bn]`` (matching columns, one program), float32 accumulation over ``bk``-row slices of H. With one
  split the program writes ``silu(gate) * up`` ([rows, I], the operand dtype); with several (few programs: decode)
  each writes float32 partial gate and up sums and a small jnp step adds them and applies the activation.
* ``down``, grid ``(H / bn, row blocks)``: activation rows ``[bm, I]`` times the expert's down tile ``[I, bn]``,
  written in float32. A jnp step gathers the pairs' rows, scales them by their routing weights and sums over k.

Programs of invalid trailing row blocks (``b >= n_valid``) do nothing: no weight is read, no output written.
Tiles are powers of two >= 16 dividing H and I (the dispatcher requires H and I multiples of 16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jaxmtp.pallas._common import mm, swiglu_tile, work_dtype
from jaxmtp.pallas.matmul.reference import FP8_BLOCK
from jaxmtp.pallas.moe.layout import choose_layout, combine, gather_rows, make_layout
from jaxmtp.pallas.policy import device_num_sms


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n."""
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


def plan(n_blocks: int, h: int, i: int, num_sms: int | None = None):
    """Static tiles ``(bn_up, bk_up, split, bn_down, bk_down)`` for ``n_blocks`` row blocks (H, I multiples of 16).

    Kernel ``up``: 64 columns (128-byte rows of bf16 weights) while that gives a wave of programs, else 32; H is
    split in up to 4 while there are fewer programs than SMs. Kernel ``down``: 128 columns, or 64 below one wave.
    ``num_sms``: default the device's.
    """
    num_sms = num_sms or device_num_sms()
    bk_up = _pow2_divisor(h, 128)
    bn_up = _pow2_divisor(i, 64)
    if n_blocks * (i // bn_up) < num_sms:
        bn_up = _pow2_divisor(i, 32)
    split = 1
    while n_blocks * (i // bn_up) * split < num_sms and split < 4 and (h // bk_up) % (2 * split) == 0:
        split *= 2
    bn_down = _pow2_divisor(h, 128)
    if n_blocks * (h // bn_down) < num_sms:
        bn_down = _pow2_divisor(h, 64)
    return bn_up, bk_up, split, bn_down, _pow2_divisor(i, 128)


def _dense_tile(w_ref, e, col0, k0, *, bn, bk, dtype, interpret):
    """Loads rows ``[k0, k0 + bk)``, columns ``[col0, col0 + bn)`` of expert e of ``w [E, K, N]``; returns
    ``xb [bm, bk] -> xb @ tile`` (float32 [bm, bn])."""
    w = w_ref[e, pl.ds(k0, bk), pl.ds(col0, bn)]
    return lambda xb: mm(xb, w, dtype=dtype, interpret=interpret)


def _fp8_tile(w_ref, s_ref, e, col0, k0, *, bn, bk, dtype, interpret):
    """The same for block-FP8 ``w`` e4m3 [E, N, K], ``s`` [E, ceil(N/128), ceil(K/128)]: the e4m3 tile [bn, bk]
    lies in one scale block (bn, bk divide 128); it is widened exactly to the operand dtype, its product scaled."""
    w, scale = w_ref[e, pl.ds(col0, bn), pl.ds(k0, bk)], s_ref[e, col0 // FP8_BLOCK, k0 // FP8_BLOCK]
    return lambda xb: mm(xb, w, tb=True, dtype=dtype, interpret=interpret) * scale


def _up_kernel(be_ref, nv_ref, x_ref, *refs, n_w, tile, bn, bk, i_size, h_part, split):
    w_refs, out_refs = refs[:n_w], refs[n_w:]
    c, rb, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(rb < nv_ref[0])
    def _():
        e = be_ref[rb]
        bm = x_ref.shape[0]

        def body(j, carry):
            g, u = carry
            k0 = pl.multiple_of(s * h_part + j * bk, bk)
            xb = x_ref[:, pl.ds(k0, bk)]
            gate, up = tile(*w_refs, e, c * bn, k0), tile(*w_refs, e, i_size + c * bn, k0)
            return g + gate(xb), u + up(xb)

        zero = jnp.zeros((bm, bn), jnp.float32)
        g, u = lax.fori_loop(0, h_part // bk, body, (zero, zero))
        if split == 1:
            act_ref, = out_refs
            act_ref[...] = swiglu_tile(g, u, act_ref.dtype)
        else:
            g_ref, u_ref = out_refs
            g_ref[...] = g
            u_ref[...] = u


def _down_kernel(be_ref, nv_ref, a_ref, *refs, tile, bn, bk):
    *w_refs, y_ref = refs
    c, rb = pl.program_id(0), pl.program_id(1)

    @pl.when(rb < nv_ref[0])
    def _():
        e = be_ref[rb]

        def body(j, acc):
            k0 = pl.multiple_of(j * bk, bk)
            ab = a_ref[:, pl.ds(k0, bk)]
            return acc + tile(*w_refs, e, c * bn, k0)(ab)

        y_ref[...] = lax.fori_loop(0, a_ref.shape[1] // bk, body, jnp.zeros(y_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("layout", "block_rows", "block_up", "block_k", "split_h",
                                             "block_down", "block_k_down", "num_warps", "num_stages", "num_warps_down",
                                             "num_stages_down", "interpret"))
def moe_experts_triton(x, weights, experts, gate_up, down, *, layout=None, block_rows=None, block_up=None,
                       block_k=None, split_h=None, block_down=None, block_k_down=None, num_warps=None,
                       num_stages=None, num_warps_down=None, num_stages_down=None, interpret=False):
    """Same contract as :func:`moe_reference`, for bf16 / float32 experts or block-FP8 ones (dicts, see
    :func:`moe_experts_fp8_triton`); H and I must be multiples of 16. The keywords override the plan: ``layout``
    ("pairs" / "sorted"), ``block_rows`` (bm), the up kernel's column tile, H slice and H split, the down kernel's
    column tile and I slice (powers of two >= 16 dividing the dims; at most 128 for FP8), and the Triton launch
    settings (``num_warps`` / ``num_stages`` for ``up``; the ``_down`` pair for ``down``, default the same)."""
    n, h = x.shape
    k = experts.shape[1]
    fp8 = isinstance(gate_up, dict)
    if fp8:
        up_w, down_w = (gate_up["weight"], gate_up["block_scale"]), (down["weight"], down["block_scale"])
        num_experts, two_i, _ = gate_up["weight"].shape
        dtype = work_dtype(x.dtype)
    else:
        up_w, down_w = (gate_up,), (down,)
        num_experts, _, two_i = gate_up.shape
        dtype = work_dtype(jnp.promote_types(x.dtype, gate_up.dtype))
    i_size = two_i // 2
    if h % 16 or i_size % 16:
        raise ValueError(f"hidden {h} and expert width {i_size} must be multiples of 16")
    mode, bm, nb = choose_layout(n * k, num_experts, layout=layout, block_rows=block_rows)
    bn1, bk1, split, bn2, bk2 = plan(nb, h, i_size)
    bn1, bk1, split = block_up or bn1, block_k or bk1, split_h or split
    bn2, bk2 = block_down or bn2, block_k_down or bk2
    if i_size % bn1 or h % (bk1 * split) or h % bn2 or i_size % bk2 or fp8 and any(
            FP8_BLOCK % t for t in (bn1, bk1, bn2, bk2)):
        raise ValueError(f"tiles (up {bn1}, k {bk1} x {split}, down {bn2}, k {bk2}) do not divide H={h}, I={i_size}"
                         + (f" and {FP8_BLOCK}" if fp8 else ""))
    tile = functools.partial(_fp8_tile if fp8 else _dense_tile, dtype=dtype, interpret=bool(interpret))
    lay = make_layout(experts, num_experts, mode, bm, nb)
    rows = gather_rows(x, lay, dtype)  # [nb * bm, H]
    params = pltr.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages or 3)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731  (indexed in the kernel)
    r = nb * bm

    if split == 1:
        out_shape = [jax.ShapeDtypeStruct((r, i_size), dtype)]
        out_specs = [pl.BlockSpec((bm, bn1), lambda c, rb, s: (rb, c))]
    else:
        out_shape = [jax.ShapeDtypeStruct((split, r, i_size), jnp.float32)] * 2
        out_specs = [pl.BlockSpec((None, bm, bn1), lambda c, rb, s: (s, rb, c))] * 2
    outs = pl.pallas_call(
        functools.partial(_up_kernel, n_w=len(up_w), tile=functools.partial(tile, bn=bn1, bk=bk1), bn=bn1, bk=bk1,
                          i_size=i_size, h_part=h // split, split=split),
        out_shape=out_shape,
        grid=(i_size // bn1, nb, split),
        in_specs=[whole(lay.block_expert), whole(lay.n_valid), pl.BlockSpec((bm, h), lambda c, rb, s: (rb, 0)),
                  *map(whole, up_w)],
        out_specs=out_specs,
        compiler_params=params,
        interpret=interpret,
        name="moe_up",
    )(lay.block_expert, lay.n_valid, rows, *up_w)
    if split == 1:
        act = outs[0]
    else:
        g, u = jnp.sum(outs[0], axis=0), jnp.sum(outs[1], axis=0)
        act = (jax.nn.silu(g) * u).astype(dtype)

    y = pl.pallas_call(
        functools.partial(_down_kernel, tile=functools.partial(tile, bn=bn2, bk=bk2), bn=bn2, bk=bk2),
        out_shape=jax.ShapeDtypeStruct((r, h), jnp.float32),
        grid=(h // bn2, nb),
        in_specs=[whole(lay.block_expert), whole(lay.n_valid), pl.BlockSpec((bm, i_size), lambda c, rb: (rb, 0)),
                  *map(whole, down_w)],
        out_specs=pl.BlockSpec((bm, bn2), lambda c, rb: (rb, c)),
        compiler_params=pltr.CompilerParams(num_warps=num_warps_down or num_warps or 4,
                                            num_stages=num_stages_down or num_stages or 3),
        interpret=interpret,
        name="moe_down",
    )(lay.block_expert, lay.n_valid, act, *down_w)
    return combine(y, weights, lay, x.dtype)


def moe_experts_fp8_triton(x, weights, experts, gate_up, down, *, interpret=False, **tuning):
    """Routed experts with block-FP8 weights (:func:`jaxmtp.pallas.moe.reference.fp8_moe_reference`: ``gate_up``
    {"weight": e4m3 [E, 2I, H], "block_scale": [E, ceil(2I/128), ceil(H/128)]}, ``down`` {e4m3 [E, H, I], scales
    [E, ceil(H/128), ceil(I/128)]}); H and I multiples of 16. ``tuning``: the keywords of :func:`moe_experts_triton`
    (tiles at most 128)."""
    if not (isinstance(gate_up, dict) and isinstance(down, dict)):
        raise TypeError("block-FP8 experts are dicts {'weight': e4m3, 'block_scale': float32}")
    return moe_experts_triton(x, weights, experts, gate_up, down, interpret=interpret, **tuning)
