#!/usr/bin/env python
"""The one-shot all-reduce kernels alone, on every GPU of the host: microseconds per call of a block output's
reduce + residual add + norm, made several ways in one process, 500 calls chained in one jitted loop (no host in
between, each call's output the next call's input; ``--unroll`` calls per iteration):

* ``local``: no reduction, this rank's partial into the add + norm kernel (the floor: the loop's own work);
* ``psum``: ``lax.psum`` of the rank's partial, then the add + norm kernel (the psum mode);
* ``oneshot``: the one-shot all-reduce kernel, then the add + norm kernel;
* ``oneshot-parts``: the same with the partial handed over in bf16 (``parts=True``: widened in the kernel);
* ``fused-pP-wN``: the fused kernel (:func:`jaxmtp.pallas.allreduce_oneshot.add_rms_norm`) at P programs per row
  (1, or one per chunk of the row: ``c``) and N warps per program.

    python scripts/bench_oneshot.py --rows 1,4,32,128 --hidden 5120 --warps 4,8,16 --out results/oneshot.json

A chained loop measures the calls' latency back to back; inside a decode step each sits between two GEMMs.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxmtp.benchmarking import alternating_call_seconds, oneshot_mesh, run_metadata, write_json
    from jaxmtp.pallas import allreduce_oneshot
    from jaxmtp.pallas._common import SplitSum
    from jaxmtp.pallas.norms import add_rms_norm_triton

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,32,128")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--programs", default="1,c", help="programs per row of the fused kernel: 1 and/or c (a chunk each)")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--unroll", type=int, default=25,
                    help="calls per iteration of the loop (a GPU while loop's condition costs a device-to-host copy "
                         "per iteration, ~20 us, which would otherwise dominate a call)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--spin-limit", type=int, default=None,
                    help="polls before a kernel gives up on a peer and writes NaN (lower: a broken protocol shows)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n, mesh, ws, peers = oneshot_mesh(args.spin_limit)
    h, eps = args.hidden, 1e-6
    w = jnp.asarray(np.random.default_rng(0).standard_normal(h) * 0.1, jnp.float32)

    def two_steps(reduce):
        def step(x, part):
            total = reduce(part)
            return add_rms_norm_triton(x, SplitSum(total[None], x.dtype), w, eps)
        return step

    def fused(num_warps, per_row):
        return lambda x, part: allreduce_oneshot.add_rms_norm(x, part, w, eps, "tp", n, peers, num_warps=num_warps,
                                                              one_program_per_row=per_row)

    ways = {"local": two_steps(lambda p: p[0].astype(jnp.float32)),  # no reduction: the floor of the others
            "psum": two_steps(lambda p: allreduce_oneshot.reference(p[0], "tp")),
            "oneshot": two_steps(lambda p: allreduce_oneshot.allreduce(p[0], "tp", n, peers)),
            "oneshot-parts": two_steps(lambda p: allreduce_oneshot.allreduce(p, "tp", n, peers, parts=True))}
    for ppr in args.programs.split(","):
        for nw in (int(v) for v in args.warps.split(",")):
            ways[f"fused-p{ppr}-w{nw}"] = fused(nw, ppr == "1")

    def chained(step):
        def f(x, noise):
            def body(i, carry):
                s, _ = carry
                return step(s, (noise * jnp.cos(i * 0.7) - s.astype(jnp.float32)[None] * (0.5 / n)).astype(x.dtype))
            return jax.lax.fori_loop(0, args.calls, body, (x, x), unroll=args.unroll)
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("tp")), out_specs=P("tp"), check_vma=False))

    results = []
    for rows in (int(v) for v in args.rows.split(",")):
        rng = np.random.default_rng(rows)
        x = jnp.asarray(rng.standard_normal((rows, h)) * 0.1, jnp.bfloat16)
        noise = jax.device_put(rng.standard_normal((n, rows, h)).astype(np.float32) * 0.01,
                               NamedSharding(mesh, P("tp")))
        fns = {name: chained(step) for name, step in ways.items()}
        finite = {}
        for name, fn in fns.items():  # each way's calls end before the next's begin (they share the workspace)
            finite[name] = bool(all(np.isfinite(np.asarray(o, np.float32)).all() for o in fn(x, noise)))
        times = {name: [t / args.calls * 1e6 for t in ts]
                 for name, ts in alternating_call_seconds(fns, (x, noise), args.rounds).items()}
        for name, ts in times.items():
            results.append({"rows": rows, "way": name, "us_per_call": float(np.median(ts)), "rounds_us": ts,
                            "finite": finite[name]})
            print(f"rows {rows:4d} {name:22s} {np.median(ts):7.2f} us per call{'' if finite[name] else '  NaN'}",
                  flush=True)
    out = {"meta": run_metadata(), "args": vars(args), "ranks": n, "results": results}
    if args.out:
        write_json(args.out, out)
    del ws
    return out


if __name__ == "__main__":
    main()
