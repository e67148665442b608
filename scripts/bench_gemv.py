#!/usr/bin/env python
"""One-row products on the GPU: the multiply-add kernel (jaxmtp.pallas.matmul.gemv_triton) against the tensor-core
few-row kernel (skinny_triton) and XLA, at the 4B shapes. JSON to ``--out``; a short table prints last.

    python scripts/bench_gemv.py --out gemv.json [--sweep head,blocks]

1. Correctness on the GPU: the kernel against float64 at small shapes (bf16 [K, N] and [N, K], int8, int4).
2. The draft head read (1 row, K 2560, N 248320): int8 and int4 with both kernels, default tiles, then with
   ``--sweep head`` every tiling of the multiply-add kernel (its default, magic-number unpacking).
3. The block products of a 4B layer (bf16 [K, N]: GDN in_proj, out_proj, MLP gate|up, down) with XLA and, with
   ``--sweep blocks``, the multiply-add kernel's tilings. Eight different weights per timed call (more than the
   50 MB L2 holds), so each product reads its weight from HBM, as in a decode step.
Times: fastest of 5 means of back-to-back calls (bench_norm_chain.best_time); TB/s = weight bytes / time.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_norm_chain import best_time  # noqa: E402
from jaxmtp.pallas.matmul.gemv_triton import gemv_matmul_triton  # noqa: E402
from jaxmtp.pallas.matmul.reference import (as_words, quantize_rows_int8, swiglu_reference, unpack_int4,  # noqa: E402
                                            w4a8_matmul_reference)
from jaxmtp.pallas.matmul.skinny_triton import skinny_matmul_triton  # noqa: E402
from jaxmtp.pallas.matmul.w4a8_triton import (quantize_rows_triton, w4a8_argmax_triton,  # noqa: E402
                                              w4a8_matmul_triton)
from jaxmtp.param_layout import quantize_rows, quantize_rows_int4  # noqa: E402

HEAD = (2560, 248320)
BLOCKS = {"gdn_in_proj": (2560, 12352), "gdn_out_proj": (4096, 2560), "mlp_gate_up": (2560, 18432),
          "mlp_down": (9216, 2560)}  # the 4B's [K, N]
COPIES = 8


def check(rng) -> dict:
    out = {}
    for m, k, n in [(1, 512, 256), (3, 1024, 512)]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        q8, _ = quantize_rows(w.T.astype(jnp.float32))
        q4, _ = quantize_rows_int4(w.T.astype(jnp.float32))
        cases = {"kn": (w, False, want), "nk": (w.T, True, want),
                 "int8": (q8, True, np.asarray(x, np.float64) @ np.asarray(q8, np.float64).T),
                 "int4": (q4, True, np.asarray(x, np.float64) @ np.asarray(unpack_int4(q4), np.float64).T)}
        for name, (wt, tr, ref) in cases.items():
            got = np.asarray(gemv_matmul_triton(x, wt, transpose_w=tr, out_dtype="float32"), np.float64)
            out[f"{name}_{m}x{k}x{n}"] = float(np.abs(got - ref).max() / np.abs(ref).max())
        # int8 with the column scale, the bf16 cast and the SwiGLU prologue inside (the int8 MTP layer's products)
        q8s, s8 = quantize_rows(w.T.astype(jnp.float32))
        xg = jnp.asarray(rng.standard_normal((m, 2 * k)), jnp.bfloat16)
        dense = np.asarray(q8s, np.float64) * np.asarray(s8, np.float64)[:, None]
        for name, xin, sw in (("int8_scaled", x, False), ("int8_scaled_swiglu", xg, True)):
            ref = np.asarray(swiglu_reference(xin, k) if sw else xin, np.float64) @ dense.T
            got = np.asarray(gemv_matmul_triton(xin, q8s, s8, transpose_w=True, out_dtype=jnp.bfloat16, swiglu=sw),
                             np.float64)
            out[f"{name}_{m}x{k}x{n}"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    print("check", out, flush=True)
    return out


def sweep_tilings(time_tiling, grid: dict, nbytes: int, label: dict, keep=lambda kw: True) -> list:
    """Time every combination of ``grid`` (keyword -> values) that ``keep`` accepts with ``time_tiling(kw)``
    (seconds); a tiling that does not compile is recorded with its error. Prints the fastest; returns the rows."""
    rows = []
    for values in itertools.product(*grid.values()):
        kw = dict(zip(grid, values))
        if not keep(kw):
            continue
        try:
            t = time_tiling(kw)
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is recorded
            rows.append({**label, **kw, "error": str(e)[:160]})
            continue
        rows.append({**label, **kw, "us": t * 1e6, "TBps": nbytes / t / 1e12})
    print("best", min((r for r in rows if "us" in r), key=lambda r: r["us"]), flush=True)
    return rows


def time_head(x, w, sweep: bool) -> dict:
    out = {}
    quants = {"int8": quantize_rows(w)[0], "int4": quantize_rows_int4(w)[0]}
    for name, q in quants.items():
        nbytes = q.size * q.dtype.itemsize
        gemv = lambda unpack: functools.partial(gemv_matmul_triton, unpack=unpack)  # noqa: E731
        for kern, fn in [("skinny", skinny_matmul_triton), ("gemv_convert", gemv("convert")),
                         ("gemv_magic", gemv("magic"))]:
            f = jax.jit(lambda x, q, fn=fn: fn(x, q, transpose_w=True, out_dtype="float32"))
            t = best_time(f, x, q, reps=250)
            out[f"{name}_{kern}_us"], out[f"{name}_{kern}_TBps"] = t * 1e6, nbytes / t / 1e12
            print(name, kern, round(t * 1e6, 1), "us", round(nbytes / t / 1e12, 2), "TB/s", flush=True)
    if sweep:
        rows = []
        for name, q in quants.items():
            grid = dict(block_n=(16, 32, 64, 128), block_k=(128,), splits=(1,), num_warps=(2, 4, 8),
                        num_stages=(2, 3, 4)) if name == "int4" else dict(
                block_n=(8, 16, 32), block_k=(128, 256), splits=(1,), num_warps=(4, 8), num_stages=(3, 4))
            rows += sweep_tilings(
                lambda kw, q=q: best_time(jax.jit(lambda x, q: gemv_matmul_triton(x, q, transpose_w=True, **kw)),
                                          x, q, reps=50),
                grid, q.size * q.dtype.itemsize, {"w": name})
        out["sweep"] = rows
    return out


def check_w4a8(rng, x_head, w_head) -> dict:
    """The dp4a kernel on the GPU against its reference (same int8 rows, exact integer sums): small shapes, then the
    head with 1 and 3 rows."""
    out = {}
    cases = [(m, k, n, rng.standard_normal((n, k)).astype(np.float32)) for m, k, n in [(1, 512, 256), (3, 1024, 512)]]
    for m, k, n, w in cases + [(1, *HEAD, w_head), (3, *HEAD, w_head)]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) if k != HEAD[0] else jnp.tile(x_head, (m, 1)) * (
            1 + jnp.arange(m, dtype=jnp.bfloat16)[:, None])
        q, s = quantize_rows_int4(w)
        want = np.asarray(w4a8_matmul_reference(x, q, s), np.float64)
        got = np.asarray(w4a8_matmul_triton(x, as_words(q), s), np.float64)
        out[f"{m}x{k}x{n}"] = float(np.abs(got - want).max() / np.abs(want).max())
        # the drafts' argmax without the logits: equal to the argmax of the kernel's logits (ties: first index)
        ids = np.asarray(w4a8_argmax_triton(x, as_words(q), s))
        out[f"argmax_equal_{m}x{k}x{n}"] = bool(np.array_equal(ids, got.argmax(-1)))
        # the row quantisation kernel: bit for bit XLA's quantize_rows_int8
        xlo, xhi, rs, rsum = quantize_rows_triton(x)
        xq, want_rs = quantize_rows_int8(x)
        halves = np.asarray(as_words(xq)).reshape(m, k // 128, 2, 16)
        out[f"quantize_equal_{m}x{k}"] = bool(
            np.array_equal(np.asarray(xlo), halves[:, :, 0].reshape(m, -1))
            and np.array_equal(np.asarray(xhi), halves[:, :, 1].reshape(m, -1))
            and np.array_equal(np.asarray(rs)[:m], np.asarray(want_rs))
            and np.array_equal(np.asarray(rsum)[:m], np.asarray(xq, np.int32).sum(1)))
    print("check w4a8", out, flush=True)
    return out


def time_w4a8(x, w, sweep: bool) -> dict:
    """The int4 head read with rows quantised to int8 (dp4a) against the int4 and int8 kernels, 1-8 rows; the op
    includes the rows' quantisation. ``w4a8_then_argmax`` / ``w4a8_argmax``: the drafts' argmax after the logits
    and inside the kernel. ``words_view``: the words made from the uint8 packing inside the timed call
    (whether XLA's bitcast is free)."""
    out = {}
    q4, s4 = quantize_rows_int4(w)
    q8, _ = quantize_rows(w)
    words = as_words(q4)
    nbytes = q4.size
    for m in (1, 2, 4, 8):
        xm = jnp.tile(x, (m, 1))
        fns = {"w4a8": (lambda x, q, s: w4a8_matmul_triton(x, q, s), words),
               "w4a8_then_argmax": (lambda x, q, s: jnp.argmax(w4a8_matmul_triton(x, q, s), -1), words),
               "w4a8_argmax": (lambda x, q, s: w4a8_argmax_triton(x, q, s), words),
               "w4a8_words_view": (lambda x, q, s: w4a8_matmul_triton(x, as_words(q), s), q4),
               "int4_gemv": (lambda x, q, s: gemv_matmul_triton(x, q, transpose_w=True) * s, q4),
               "int4_skinny": (lambda x, q, s: skinny_matmul_triton(x, q, transpose_w=True, out_dtype="float32") * s,
                               q4),
               "int8_gemv": (lambda x, q, s: gemv_matmul_triton(x, q, transpose_w=True) * s, q8),
               "int8_skinny": (lambda x, q, s: skinny_matmul_triton(x, q, transpose_w=True, out_dtype="float32") * s,
                               q8)}
        for name, (fn, q) in fns.items():
            if m > 4 and ("gemv" in name or "argmax" in name):
                continue
            t = best_time(jax.jit(fn), xm, q, s4, reps=250)
            out[f"{name}_rows{m}_us"] = t * 1e6
            print("rows", m, name, round(t * 1e6, 1), "us", round(q.size * q.dtype.itemsize / t / 1e12, 2), "TB/s",
                  flush=True)
    if sweep:  # one row
        out["sweep"] = sweep_tilings(
            lambda kw: best_time(jax.jit(lambda x, q, s: w4a8_matmul_triton(x, q, s, **kw)), x, words, s4, reps=250),
            dict(block_n=(16, 32, 64), words_per_step=(16, 32), num_warps=(4, 8), num_stages=(2, 4)), nbytes,
            {"rows": 1})
    return out


def time_blocks(sweep: bool) -> dict:
    out = {}
    key = jax.random.key(2)
    for name, (k, n) in BLOCKS.items():
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) for i in range(COPIES)]
        x = jax.random.normal(key, (1, k), jnp.bfloat16)
        nbytes = k * n * 2
        res = {}

        def timed(fn):
            f = jax.jit(lambda x, ws: [fn(x + i, w) for i, w in enumerate(ws)])
            return best_time(f, x, ws, reps=100) / COPIES

        t = timed(lambda x, w: x @ w)
        res["xla_us"], res["xla_TBps"] = t * 1e6, nbytes / t / 1e12
        t = timed(lambda x, w: gemv_matmul_triton(x, w))
        res["gemv_us"], res["gemv_TBps"] = t * 1e6, nbytes / t / 1e12
        print(name, {a: round(b, 2) for a, b in res.items()}, flush=True)
        if sweep:
            res["sweep"] = sweep_tilings(
                lambda kw: timed(lambda x, w: gemv_matmul_triton(x, w, **kw)),  # called here, in this iteration
                dict(block_n=(32, 64, 128), block_k=(32, 64), splits=(1, 2, 4), num_warps=(4,), num_stages=(4,)),
                nbytes, {"block": name},
                keep=lambda kw, n=n, k=k: not (n % kw["block_n"] or k % (kw["block_k"] * kw["splits"]) or k % 128))
        out[name] = res
    return out


def time_rows(sweep: bool) -> dict:
    """The 4B's block products with the weight stored ``[N, K]`` (K contiguous), so one program reads whole rows of
    W and needs no split along K (no partial sums to reduce): the multiply-add kernel with ``transpose_w`` against
    XLA on ``[K, N]`` (its split-K product plus the reduction, as in the engine) and on ``[N, K]``. Device time
    (devtime.device_seconds: kernel intervals of 20 chained calls, weights rotating over copies), 1 and 4 rows."""
    from devtime import device_seconds
    out = {}
    key = jax.random.key(3)
    grid = dict(block_n=(2, 4, 8), block_k=(512, 1024, 2048), num_warps=(4, 8), num_stages=(2,))
    for name, (k, n) in BLOCKS.items():
        w = jax.random.normal(key, (k, n), jnp.bfloat16)
        wt = jnp.asarray(w.T)
        nbytes = k * n * 2
        res = {}
        for m in (1, 4):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            chain = lambda a, y: (a[0] + y[:, :1].astype(a[0].dtype), a[1])  # noqa: E731

            def dev(fn, weight, x=x, chain=chain):
                return device_seconds(fn, x, weight, chain=chain)

            row = {"xla_kn_us": dev(lambda x, w: x @ w, w) * 1e6,
                   "xla_nk_us": dev(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))), wt) * 1e6,
                   "gemv_default_us": dev(lambda x, w: gemv_matmul_triton(x, w, transpose_w=True), wt) * 1e6}
            if name == "mlp_down":  # SwiGLU folded in: x is the gate|up output [m, 2K]
                xg = jax.random.normal(jax.random.fold_in(key, 10 + m), (m, 2 * k), jnp.bfloat16)
                row["xla_swiglu_kn_us"] = device_seconds(lambda x, w: swiglu_reference(x, k) @ w, xg, w,
                                                         chain=chain) * 1e6
                row["gemv_swiglu_us"] = device_seconds(
                    lambda x, w: gemv_matmul_triton(x, w, transpose_w=True, swiglu=True), xg, wt, chain=chain) * 1e6
                if sweep and m == 1:
                    row["sweep_swiglu"] = sweep_tilings(
                        lambda kw: device_seconds(lambda x, w: gemv_matmul_triton(x, w, transpose_w=True, swiglu=True,
                                                                                  **kw), xg, wt, chain=chain),
                        {**grid, "block_k": (1024, 2048)}, nbytes, {"block": name, "rows": m, "swiglu": True},
                        keep=lambda kw, k=k: k % kw["block_k"] == 0)
            if sweep and m == 1 and name in ("gdn_out_proj", "mlp_down"):  # the products XLA splits along K
                row["sweep"] = sweep_tilings(
                    lambda kw: dev(lambda x, w: gemv_matmul_triton(x, w, transpose_w=True, **kw), wt),
                    grid, nbytes, {"block": name, "rows": m}, keep=lambda kw, k=k: k % kw["block_k"] == 0)
            row.update({f"{a[:-3]}_TBps": nbytes / (b * 1e-6) / 1e12 for a, b in list(row.items()) if a.endswith("_us")})
            print(name, m, {a: round(b, 2) for a, b in row.items() if not a.startswith("sweep")}, flush=True)
            res[f"rows{m}"] = row
        out[name] = res
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv.json")
    ap.add_argument("--sweep", default="", help="comma list: head, w4a8, blocks, rows")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: head, w4a8, blocks, rows")
    args = ap.parse_args()
    sweep, skip = set(filter(None, args.sweep.split(","))), set(filter(None, args.skip.split(",")))
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
    out["check"] = check(np.random.default_rng(0))
    k, n = HEAD
    w = jax.random.normal(jax.random.key(0), (n, k), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1, k), jnp.bfloat16)
    if "head" not in skip:
        out["head"] = time_head(x, w, "head" in sweep)
    if "w4a8" not in skip:
        out["check_w4a8"] = check_w4a8(np.random.default_rng(1), x, w)
        out["w4a8"] = time_w4a8(x, w, "w4a8" in sweep)
    del w
    if "blocks" not in skip:
        out["blocks"] = time_blocks("blocks" in sweep)
    if "rows" not in skip:
        out["rows"] = time_rows("rows" in sweep)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
