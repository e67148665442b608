#!/usr/bin/env python
"""How the block-FP8 product kernels widen their e4m3 weights, and whether that sets their speed: each variant of
the one-row (multiply-add) and few-row (tensor-core) kernels of :mod:`jaxmtp.pallas.matmul.fp8_triton`, at
Qwen3.5-27B shapes, weights rotating over 256 MiB (read from HBM), against the measured copy bandwidth, and each
product's error against a float64 product of the dequantised weight.

    python scripts/sweep_fp8_widening.py --out fp8_widening.json

Widenings (``how``): ``cvt`` Triton's conversion (what the kernel does); ``f16asm`` / ``bf16asm`` / ``f32asm`` PTX
(``prmt`` / ``shr`` / ``lop3`` on four bytes at once) placing the e4m3 bits in a float16 / bfloat16 / float32 whose
value is the weight times 2^-8 / 2^-120 / 2^-120 (the factor folded into the scale), exact for every e4m3 value
including subnormals; ``f32int`` the float32 one in Triton integer ops; ``magic`` the int8 kernel's widening applied
to the bytes (wrong numbers: the cost of a widening with no float conversion at all, an upper bound). On the CPU the
kernels run interpreted and the PTX variants as their jnp twins (a smoke run of the script).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxmtp.benchmarking import chained_product_seconds, hbm_bandwidth, run_metadata  # noqa: E402
from jaxmtp.pallas.matmul.fp8_triton import fp8_matmul_triton  # noqa: E402
from jaxmtp.pallas.matmul.reference import FP8_DTYPE  # noqa: E402

INTERP = jax.default_backend() == "cpu"
B = 128
_MAGIC = 0x4B000000


def _asm(selectors, shift: int, sign: int) -> str:
    """PTX for four e4m3 bytes (input register ``$n``, n = the outputs) into ``len(selectors)`` registers: per output,
    ``prmt`` places the magnitude bytes (sign cleared) and the bytes as they are at the top of each 16- or 32-bit
    lane, ``shr`` moves the magnitudes' 4 exponent + 3 mantissa bits into the float's exponent and mantissa, and
    ``lop3`` (a | (b & c), table 0xF8) adds the signs."""
    src = f"${len(selectors)}"
    lines = [".reg .b32 m, a, b;", f"and.b32 m, {src}, 0x7F7F7F7F;"]
    for i, sel in enumerate(selectors):
        lines += [f"prmt.b32 a, m, 0, {sel:#06x};", f"prmt.b32 b, {src}, 0, {sel:#06x};", f"shr.b32 a, a, {shift};",
                  f"lop3.b32 ${i}, a, b, {sign:#010x}, 0xF8;"]
    return "{\n" + "\n".join(lines) + "\n}"


# two bytes per 32-bit output: float16 (shift 1, weight x 2^-8) or bfloat16 (shift 4, x 2^-120); one byte per
# output: float32 (shift 4, x 2^-120)
ASM_F16 = _asm((0x1404, 0x3424), 1, 0x80008000)
ASM_BF16 = _asm((0x1404, 0x3424), 4, 0x80008000)
ASM_F32 = _asm((0x0444, 0x1444, 0x2444, 0x3444), 4, 0x80000000)

# factor the widened value carries: true = widened * FACTOR
FACTOR = {"cvt": 1.0, "f16asm": 2.0**8, "f16int": 2.0**8, "bf16asm": 2.0**120, "bf16int": 2.0**120,
          "f32asm": 2.0**120, "f32int": 2.0**120, "magic": 1.0}


def widen(u, how):
    """u: uint8 tile of e4m3 bits -> float tile (f32 / bf16 / f16) equal to e4m3 / FACTOR[how]."""
    if how == "cvt":
        return lax.bitcast_convert_type(u, FP8_DTYPE).astype(jnp.float32)
    if how == "magic":  # wrong numbers: the int8 path's cost
        return lax.bitcast_convert_type(u.astype(jnp.int32) | _MAGIC, jnp.float32) - float(2**23)
    if how.endswith("asm") and not INTERP:
        if how == "f32asm":
            return pltr.elementwise_inline_asm(ASM_F32, args=[u], constraints="=r,=r,=r,=r,r", pack=4,
                                               result_shape_dtypes=[jax.ShapeDtypeStruct(u.shape, jnp.float32)])[0]
        asm, dt = (ASM_BF16, jnp.bfloat16) if how == "bf16asm" else (ASM_F16, jnp.float16)
        return pltr.elementwise_inline_asm(asm, args=[u], constraints="=r,=r,r", pack=4,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(u.shape, dt)])[0]
    i = u.astype(jnp.int32)
    if how.startswith("f32"):
        return lax.bitcast_convert_type(((i & 0x7F) << 20) | ((i & 0x80) << 24), jnp.float32)
    dt, shift = (jnp.bfloat16, 4) if how.startswith("bf16") else (jnp.float16, 7)
    return lax.bitcast_convert_type((((i & 0x7F) << shift) | ((i & 0x80) << 8)).astype(jnp.uint16), dt)


def fma_kernel(x_ref, w_ref, s_ref, o_ref, *, bn, bk, steps, how, pre):
    """One row: multiply-adds as :mod:`jaxmtp.pallas.matmul.fp8_triton`'s, the scale on the activations (times
    ``pre``, the widening's factor or part of it)."""
    f32 = jnp.float32
    n0 = pl.program_id(0) * bn
    k0 = pl.program_id(1) * steps * bk
    nb = lax.div(n0, B)
    col_block = lax.div(lax.iota(jnp.int32, bk), B)

    def body(i, acc):
        off = pl.multiple_of(k0 + i * bk, bk)
        w = widen(w_ref[pl.ds(n0, bn), pl.ds(off, bk)], how).astype(f32)
        scale = pltr.load(s_ref.at[nb, lax.div(off, B) + col_block]) * pre
        xs = x_ref[0, pl.ds(off, bk)].astype(f32) * scale
        return acc + w * xs[None, :]

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bn, bk), f32))
    post = FACTOR[how] / pre
    o_ref[0, pl.ds(n0, bn)] = (jnp.sum(acc, axis=1) * post).astype(o_ref.dtype)


def dot_kernel(x_ref, w_ref, s_ref, o_ref, *, m, bm, bn, steps, how, xscale):
    """More rows: a tensor-core dot per 128-wide block of K, the rows times ``xscale`` first (a power of two that
    keeps the products of a bf16 weight scaled by 2^-120 out of the float32 subnormals)."""
    f32 = jnp.float32
    m0, n0 = pl.program_id(0) * bm, pl.program_id(1) * bn
    k0 = pl.program_id(2) * steps * B
    nb = lax.div(n0, B)
    rows_ok = m0 + lax.broadcasted_iota(jnp.int32, (bm, B), 0) < m if m % bm else None
    dt = jnp.bfloat16 if how in ("cvt", "bf16asm", "bf16int") else jnp.float16

    def body(i, acc):
        off = pl.multiple_of(k0 + i * B, B)
        xt = x_ref[pl.ds(m0, bm), pl.ds(off, B)] if rows_ok is None else pltr.load(
            x_ref.at[pl.ds(m0, bm), pl.ds(off, B)], mask=rows_ok, other=0.0)
        if xscale != 1.0:
            xt = (xt.astype(f32) * xscale)
        wt = widen(w_ref[pl.ds(n0, bn), pl.ds(off, B)], how).astype(dt)
        if INTERP:
            d = lax.dot_general(xt.astype(dt).astype(f32), wt.astype(f32), (((1,), (1,)), ((), ())),
                                precision=lax.Precision.HIGHEST, preferred_element_type=f32)
        else:
            d = lax.dot_general(xt.astype(dt), wt, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        return acc + d * s_ref[nb, lax.div(off, B)]

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), f32))
    acc = acc * (FACTOR[how] / xscale)
    if m % bm:
        ok = m0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < m
        pltr.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask=ok)
    else:
        o_ref[pl.ds(m0, bm), pl.ds(n0, bn)] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("path", "how", "bn", "bk", "bm", "splits", "warps", "stages", "xscale"))
def product(x, w, s, *, path, how, bn, bk=1024, bm=16, splits=4, warps=4, stages=2, xscale=1.0):
    """``x @ (w * scale)^T`` by the variant ``path`` ("fma": one row, no split; "dot": K in ``splits``) with the
    widening ``how``; K a multiple of ``bk`` and of 128 x ``splits``."""
    m, k = x.shape
    n = w.shape[0]
    u = lax.bitcast_convert_type(w, jnp.uint8)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *g: (0,) * a.ndim)
    if path == "fma":
        pre = 2.0**60 if how.startswith("f32") else FACTOR[how]
        kern = functools.partial(fma_kernel, bn=bn, bk=bk, steps=k // bk, how=how, pre=pre)
        return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((m, n), x.dtype), grid=(n // bn, 1),
                              in_specs=[whole(x), whole(u), whole(s)],
                              out_specs=pl.BlockSpec((m, n), lambda *g: (0, 0)),
                              compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages),
                              interpret=INTERP)(x, u, s)
    steps = k // B // splits
    kern = functools.partial(dot_kernel, m=m, bm=bm, bn=bn, steps=steps, how=how, xscale=xscale)
    y = pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
                       grid=(pl.cdiv(m, bm), n // bn, splits), in_specs=[whole(x), whole(u), whole(s)],
                       out_specs=pl.BlockSpec((None, m, n), lambda *g: (g[-1], 0, 0)),
                       compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages),
                       interpret=INTERP)(x, u, s)
    return jnp.sum(y, axis=0).astype(x.dtype)


def reference(x, w, s):
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    sf = np.repeat(np.repeat(np.asarray(s, np.float64), B, 0), B, 1)[: wf.shape[0], : wf.shape[1]]
    return np.asarray(x.astype(jnp.float32), np.float64) @ (wf * sf).T


def time_fn(f, x, ws, calls, reps):
    return chained_product_seconds(f, x, ws, calls, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="fp8_widening.json")
    ap.add_argument("--max-seconds", type=float, default=500.0)
    args = ap.parse_args(argv)
    shapes = {"gate_up": (5120, 34816), "down": (17408, 5120), "out": (6144, 5120)}
    cases = [(1, "gate_up"), (1, "down"), (1, "out"), (4, "gate_up"), (4, "down"), (32, "gate_up"), (32, "down")]
    fma = [dict(path="fma", how=h, bn=bn, bk=bk) for h in ("cvt", "f16asm", "f32asm", "f32int", "magic")
           for bn, bk in ((4, 1024), (8, 512), (16, 256))]
    dots = [dict(path="dot", how=h, bn=bn, bm=16, splits=sp, stages=st, xscale=xs)
            for h, xs in (("cvt", 1.0), ("bf16asm", 2.0**64), ("bf16asm", 1.0), ("f16asm", 1.0))
            for bn, sp, st in ((64, 4, 3), (64, 8, 3), (128, 4, 3), (128, 8, 4))]
    if INTERP:  # CPU smoke run: a small shape, the kernels interpreted (the PTX variants as their jnp twins)
        shapes, cases = {"small": (1024, 256)}, [(1, "small"), (4, "small"), (20, "small")]
        fma, dots = fma[::3], dots[::4]
    res = {**run_metadata(), "copy_bytes_per_s": 1.0 if INTERP else hbm_bandwidth(), "cases": []}
    bw = res["copy_bytes_per_s"]
    key = jax.random.key(0)
    t_start = time.time()
    for m, name in cases:
        k, n = shapes[name]
        w = (64 * jax.random.normal(key, (n, k), jnp.float32)).clip(-448, 448)
        # 1% of the weights e4m3 subnormals (2^-8), where a widening's exponent handling shows
        w = jnp.where(jax.random.uniform(jax.random.key(5), w.shape) < 0.01, 2.0**-8, w).astype(FP8_DTYPE)
        s = jax.random.uniform(key, (n // B, k // B), jnp.float32, 1e-4, 1e-3)
        nbytes = w.size + s.size * 4
        ws = [(w, s)] + ([] if INTERP else [(jnp.copy(w), jnp.copy(s)) for _ in range(-(-(256 << 20) // nbytes) - 1)])
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
        ref = reference(x, w, s)
        entry = {"rows": m, "name": name, "K": k, "N": n, "weight_bytes": nbytes, "variants": []}
        for v in [dict(path="current")] + (fma if m == 1 else []) + dots:
            if time.time() - t_start > args.max_seconds:
                break
            f = (functools.partial(fp8_matmul_triton, interpret=INTERP) if v["path"] == "current"
                 else functools.partial(product, **v))
            try:
                y = np.asarray(f(x, w, s).astype(jnp.float32), np.float64)
                err = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
                sec = time_fn(f, x, ws, 1 if INTERP else 20, 1 if INTERP else 5)
            except Exception as e:  # noqa: BLE001 - a variant the compiler refuses is a result
                entry["variants"].append({**v, "error": (str(e).splitlines() or [repr(e)])[0][:300]})
                continue
            entry["variants"].append({**v, "s": sec, "frac": nbytes / sec / bw, "err": err})
            print(f"{m:3d} {name:8s} {v} {sec * 1e6:8.1f} us {nbytes / sec / bw:6.1%} err {err:.2e}", flush=True)
        res["cases"].append(entry)
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
        del ws
    return 0


if __name__ == "__main__":
    sys.exit(main())
