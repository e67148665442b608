#!/usr/bin/env python
"""A block's row-parallel output product and its one-shot reduce + residual add + norm, on every GPU of the host:
microseconds per call, several ways in one process, calls chained in one jitted loop (each call's s the next call's
residual), the weight rotating over enough copies that it streams from HBM as in a decode step:

* ``local``: XLA's product, then the add + norm kernel on this rank's partial, no reduction (the floor);
* ``xla+fused``: XLA's product ([K, N] weight), then the fused reduce + add + norm kernel (the one-shot mode's
  default, :func:`jaxmtp.pallas.allreduce_oneshot.add_rms_norm`);
* ``product-BN-BK-W-S``: the product fused with the exchange, the add and the norm
  (:func:`jaxmtp.pallas.oneshot_product.product_add_rms_norm`, [N, K] weight) at BN columns per program, BK of K per
  step, W warps, S pipeline stages; with ``--gemv`` also ``gemv-...``, that kernel's product alone (no exchange).

    python scripts/bench_oneshot_product.py --kdims 8704,3072 --rows 1,4 --tiles "4,512,4,3;8,512,4,3" \\
        --out results/oneshot_product.json

K is a rank's slice (27B at TP 2: the MLP's down 8704, o_proj / out_proj 3072).
"""

from __future__ import annotations

import argparse
import math


def main(argv=None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxmtp.benchmarking import alternating_call_seconds, oneshot_mesh, run_metadata, write_json
    from jaxmtp.pallas import allreduce_oneshot, oneshot_product
    from jaxmtp.pallas._common import SplitSum
    from jaxmtp.pallas.norms import add_rms_norm_triton

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kdims", default="8704,3072", help="K of a rank's weight slice")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--tiles", default="4,512,4,3;8,512,4,3;4,256,4,3;8,1024,8,3;16,512,8,3",
                    help="';'-separated BN,BK,warps,stages of the fused product kernel")
    ap.add_argument("--gemv", action="store_true",
                    help="also each tiling's product alone (exchange=False: no reduction, add or norm), as gemv-...")
    ap.add_argument("--stream-bytes", type=float, default=256e6, help="weight copies rotated per loop: this many bytes")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--spin-limit", type=int, default=None,
                    help="polls before a kernel gives up on a peer and writes NaN (lower: a broken protocol shows)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n, mesh, ws, peers = oneshot_mesh(args.spin_limit)
    h, eps = args.hidden, 1e-6
    w = jnp.asarray(np.random.default_rng(0).standard_normal(h) * 0.1, jnp.float32)
    put = lambda v: jax.device_put(v, NamedSharding(mesh, P("tp")))  # noqa: E731

    ways = {"local": lambda x, a, wk, wt: add_rms_norm_triton(x, SplitSum((a @ wk).astype(jnp.float32)[None], x.dtype),
                                                              w, eps),
            "xla+fused": lambda x, a, wk, wt: allreduce_oneshot.add_rms_norm(x, (a @ wk)[None], w, eps, "tp", n,
                                                                            peers)}
    for spec in args.tiles.split(";"):
        bn, bk, nw, ns = (int(v) for v in spec.split(","))
        for exchange in (True, False) if args.gemv else (True,):
            ways[f"{'product' if exchange else 'gemv'}-{bn}-{bk}-{nw}-{ns}"] = (
                lambda x, a, wk, wt, bn=bn, bk=bk, nw=nw, ns=ns, exchange=exchange:
                oneshot_product.product_add_rms_norm(x, a, wt, w, eps, "tp", n, peers, block_n=bn, block_k=bk,
                                                     num_warps=nw, num_stages=ns, exchange=exchange))

    def chained(step, copies):
        def f(x, acts, wks, wts):
            def body(i, carry):
                s, _ = carry
                for c in range(copies):  # each copy once per iteration: the weight streams from HBM
                    a = (acts[0] * jnp.cos(i * 0.7 + c)).astype(x.dtype)
                    s, hh = step(s, a, wks[c][0], wts[c][0])
                    s = (s.astype(jnp.float32) * 0.5).astype(x.dtype)
                return s, hh
            return jax.lax.fori_loop(0, args.calls // copies, body, (x, x))
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("tp"), P("tp"), P("tp")), out_specs=P("tp"),
                                     check_vma=False))

    results = []
    for kdim in (int(v) for v in args.kdims.split(",")):
        copies = max(1, math.ceil(args.stream_bytes / (h * kdim * 2)))
        rng = np.random.default_rng(kdim)
        wk = rng.standard_normal((n, kdim, h)).astype(np.float32) / np.sqrt(n * kdim)
        wks = [put(jnp.asarray(wk * (1 + 0.01 * c), jnp.bfloat16)) for c in range(copies)]
        wts = [put(jnp.swapaxes(v, 1, 2)) for v in wks]
        for rows in (int(v) for v in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, h)) * 0.1, jnp.bfloat16)
            acts = put(rng.standard_normal((n, rows, kdim)).astype(np.float32))
            fns = {name: chained(step, copies) for name, step in ways.items()}
            finite, outs = {}, {}
            for name, fn in fns.items():  # each way's calls end before the next's begin (they share the workspace)
                outs[name] = [np.asarray(o, np.float32) for o in fn(x, acts, wks, wts)]
                finite[name] = bool(all(np.isfinite(o).all() for o in outs[name]))
            calls = args.calls // copies * copies
            times = {name: [t / calls * 1e6 for t in ts]
                     for name, ts in alternating_call_seconds(fns, (x, acts, wks, wts), args.rounds).items()}
            ref = outs["xla+fused"][0]
            for name, ts in times.items():
                diff = float(np.max(np.abs(outs[name][0] - ref)))
                row = {"kdim": kdim, "rows": rows, "way": name, "us_per_call": float(np.median(ts)),
                       "rounds_us": ts, "finite": finite[name], "copies": copies, "max_abs_diff_s": diff,
                       "weight_GBps": h * kdim * 2 / (float(np.median(ts)) * 1e-6) / 1e9}
                results.append(row)
                print(f"K {kdim:6d} rows {rows} {name:22s} {row['us_per_call']:7.2f} us  {row['weight_GBps']:6.0f} GB/s"
                      f"  |s - xla+fused| {diff:.3g}{'' if finite[name] else '  NaN'}", flush=True)
    out = {"meta": run_metadata(), "args": vars(args), "ranks": n, "results": results}
    if args.out:
        write_json(args.out, out)
    del ws
    return out


if __name__ == "__main__":
    main()
