"""Check and time the Pallas kernels against the XLA references and flash-linear-attention (FLA) on a GPU.

    python scripts/bench_kernels.py --out bench.json [--sections a,b,...] [--max-seconds 540] [--no-fla]
    python scripts/bench_kernels.py --smoke    # tiny shapes, interpret mode, no torch: checks the script on a CPU

Sections: ``ceilings`` (device copy, bf16 matmul), ``check`` (every kernel vs its reference at Qwen3.5 shapes, bf16),
``fla_check`` (FLA computes the same function), ``recurrent``, ``commit`` (every layer's verify commit in one launch
vs one per layer), ``chunk``, ``attention``, ``moe``, ``matmul`` (few-row projections and the quantised draft head;
timings), ``fp8`` (block-FP8 weights at 27B shapes vs bf16; not in the default list: ``--sections ceilings,fp8``),
``sweep`` / ``sweep_final`` / ``moe_sweep`` (tiles). The kernels inside a model (prefill, decode, verify
against the XLA path) are checked by ``pytest -m gpu tests/test_gpu_checks.py``.
Everything does not fit in one 10-minute device call: see docs/performance.md ("Kernels") for the calls used.

Timing (:func:`time_jax`): one jit runs 1 + n calls, each fed the previous call's output (a true dependency: no
merging, dropping or overlapping), the other inputs rotating over copies so small problems cannot live in L2; the
difference to a 1-call jit, over n, is the device time per call, launch gaps included. FLA runs ``REPS`` calls (each
on its own inputs) in a captured CUDA graph, timed with CUDA events.
Bandwidth counts the fewest bytes an op must move (inputs read once, outputs written once); ceilings are measured
in the same run (a device-to-device copy, a bf16 8192^3 matmul). Results go to JSON; a short table prints last.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxmtp.benchmarking import device_kernels, device_seconds  # noqa: E402
from jaxmtp.pallas.attention import attention_reference  # noqa: E402
from jaxmtp.pallas.attention.decode_triton import cached_attention_triton  # noqa: E402
from jaxmtp.pallas.gated_delta_rule import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule  # noqa: E402
from jaxmtp.pallas.gated_delta_rule.chunk_triton import chunk_gated_delta_rule_triton  # noqa: E402
from jaxmtp.pallas.gated_delta_rule.recurrent_triton import (  # noqa: E402
    commit_gated_delta_rule_triton,
    commit_windows_triton,
    fused_recurrent_gated_delta_rule_triton,
)
from jaxmtp.pallas.moe import gathered_experts, moe_reference, ragged_experts  # noqa: E402
from jaxmtp.pallas.moe.grouped_triton import moe_experts_triton  # noqa: E402
from jaxmtp.pallas.policy import DEFAULT_POLICY  # noqa: E402

REPS, ITERS = 10, 5
XLA_RECURRENT = {(1, 1), (64, 1), (8, 5), (64, 5)}  # (B, T) where the XLA reference is timed too
XLA_ATTENTION = {(1, 1), (8, 5)}
MOE_TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 512)
MOE_GATHER_MAX = 32  # gathered_experts copies each routed row's expert matrices (6 MB each at 35B-A3B shapes)
RESULTS: dict = {"rows": [], "checks": [], "errors": []}
T_START = time.time()
ARGS = None


# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------
def _fresh(a):
    """A copy of ``a`` (an array or a pytree of them) in new device buffers (None stays None)."""
    return None if a is None else jax.tree.map(jnp.copy, a)


def _nbytes(args):
    return sum(x.size * x.dtype.itemsize for a in args if a is not None for x in jax.tree.leaves(a))


def time_jax(fn, *args, chain, reps=None, iters=ITERS):
    """Seconds per call of ``fn(*args)`` on the device.

    Two executables run 1 and 1 + ``reps`` calls, each call's input rebuilt from the previous call's output by
    ``chain(args, out)`` (a true data dependency: XLA can neither merge, drop nor overlap the calls), the other
    inputs rotating over copies so that small problems do not run out of L2. The difference of the two median
    wall times over ``reps`` cancels dispatch and synchronisation overhead.
    """
    set_bytes = _nbytes(args)
    reps = reps or (30 if set_bytes < (16 << 20) else 16 if set_bytes < (128 << 20) else 8)
    n_sets = max(1, min(reps + 1, -(-(256 << 20) // max(set_bytes, 1))))
    sets = [tuple(args)] + [tuple(_fresh(a) for a in args) for _ in range(n_sets - 1)]

    def chained(n):
        def f(all_sets):
            out = fn(*all_sets[0])
            for i in range(1, n):
                out = fn(*chain(all_sets[i % len(all_sets)], out))
            return out

        return jax.jit(f)

    def median_wall(n):
        f = chained(n)
        jax.block_until_ready(f(sets))
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(sets))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    if ARGS is not None and getattr(ARGS, "timer", "wall") == "trace":
        return device_seconds(fn, *args, chain=chain, calls=reps)
    t1, tn = median_wall(1), median_wall(1 + reps)
    return (tn - t1) / reps if tn > t1 else tn / (1 + reps)


def chain_v(a, out):
    """GDN ops: the output o [B, T, Hv, dv] becomes the next call's v."""
    return (a[0], a[1], out[0], *a[3:])


def chain_first(a, out):
    """Ops whose output has the shape and dtype of their first input (attention q, a copy, x @ W, MoE x)."""
    return (out, *a[1:])


def time_torch(fns, iters=ITERS):
    """Seconds per call of torch callables ``fns`` (one per input set) replayed in a CUDA graph (eager fallback)."""
    import torch

    reps = len(fns)
    for f in fns:
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        run, how = graph.replay, "graph"
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()

        def run():
            for f in fns:
                f()

        how = "eager"
    run()
    ts = []
    for _ in range(iters):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    return statistics.median(ts) / reps, how


def torch_kernel_breakdown(fns, calls=10):
    """Device microseconds per call of each CUDA kernel of torch callables ``fns`` (called in turn ``calls`` times
    in all), from the torch profiler: FLA's launches, beside :func:`kernel_breakdown` of ours."""
    import torch

    for f in fns:
        f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    per = {e.key: e.self_device_time_total / calls for e in prof.key_averages() if e.self_device_time_total > 0}
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def out_of_time(section):
    if time.time() - T_START > ARGS.max_seconds:
        RESULTS["errors"].append(f"{section}: skipped, out of time")
        return True
    return False


def record(op, shape, impl, seconds, nbytes=None, flops=None, **extra):
    row = {"op": op, "shape": shape, "impl": impl, "us": seconds * 1e6, **extra}
    if nbytes:
        row["GB/s"] = nbytes / seconds / 1e9
        if RESULTS.get("copy_GBps"):
            row["%bw"] = 100 * row["GB/s"] / RESULTS["copy_GBps"]
    if flops:
        row["TFLOP/s"] = flops / seconds / 1e12
        if RESULTS.get("matmul_TFLOPs"):
            row["%mm"] = 100 * row["TFLOP/s"] / RESULTS["matmul_TFLOPs"]
    RESULTS["rows"].append(row)
    print(json.dumps(row), flush=True)
    return row


def guarded(section, fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as e:  # noqa: BLE001
        msg = f"{section}: {type(e).__name__}: {str(e)[:2000]}"
        RESULTS["errors"].append(msg)
        print("ERROR", msg, traceback.format_exc()[-3000:], flush=True)
        return None


# ---------------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------------
def gdn_inputs(key, b, t, hk, hv, d, dtype=jnp.bfloat16, lengths=None):
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (b, t, hk, d), dtype)
    k = jax.random.normal(ks[1], (b, t, hk, d), dtype)
    v = jax.random.normal(ks[2], (b, t, hv, d), dtype)
    g = -jnp.exp(jax.random.normal(ks[3], (b, t, hv), jnp.float32) - 2.0)  # decays around e^-0.14
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, hv), jnp.float32))
    if lengths is not None:
        valid = jnp.arange(t)[None, :, None] < jnp.asarray(lengths)[:, None, None]
        g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
    s0 = 0.1 * jax.random.normal(ks[5], (b, hv, d, d), jnp.float32)
    return q, k, v, g, beta, s0


def attn_inputs(key, b, t, hq, hkv, d, s, positions, dtype=jnp.bfloat16):
    ks = jax.random.split(key, 3)
    q = jax.random.normal(ks[0], (b, t, hq, d), dtype)
    kc = jax.random.normal(ks[1], (b, hkv, s, d), dtype)
    vc = jax.random.normal(ks[2], (b, hkv, s, d), dtype)
    return q, kc, vc, jnp.asarray(positions, jnp.int32)


def moe_shapes():
    """(E, K, H, I): Qwen3.5-35B-A3B's routed experts, or tiny ones for --smoke."""
    return (16, 2, 64, 32) if ARGS.smoke else (256, 8, 2048, 512)


def moe_weights(e, h, i, dtype=jnp.bfloat16):
    gate_up = (0.02 * jax.random.normal(jax.random.key(1), (e, h, 2 * i), jnp.float32)).astype(dtype)
    down = (0.02 * jax.random.normal(jax.random.key(2), (e, i, h), jnp.float32)).astype(dtype)
    return gate_up, down


def moe_inputs(n, e, k, h, dtype=jnp.bfloat16):
    """x [n, H], softmax top-k routing weights (not renormalised) and experts, as the model routes."""
    x = jax.random.normal(jax.random.key(n), (n, h), dtype)
    logits = jax.random.normal(jax.random.key(n + 1), (n, e), jnp.float32)
    w, experts = jax.lax.top_k(jax.nn.softmax(logits), k)
    return x, w.astype(dtype), experts


def chain_moe(a, out):
    """MoE: the output becomes the next x, and the routing shifts to other experts (37 is prime to E), so that the
    experts one call touched are not in L2 for the next."""
    return (out, a[1], (a[2] + 37) % a[3].shape[0], *a[3:])


def rel_err(got, want, mask=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if mask is not None:
        got, want = np.where(mask, got, 0), np.where(mask, want, 0)
    finite = bool(np.isfinite(got).all())
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)), finite


def add_check(name, err, finite, tol, **extra):
    ok = finite and err < tol
    row = {"check": name, "rel_err": err, "finite": finite, "tol": tol, "pass": ok, **extra}
    RESULTS["checks"].append(row)
    print(json.dumps(row), flush=True)


def impl_kw():
    return {"interpret": True} if ARGS.smoke else {}


# ---------------------------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------------------------
def section_ceilings():
    n = (1 << 28) if not ARGS.smoke else (1 << 20)  # 1 GiB of float32
    x = jnp.ones((n,), jnp.float32) * 1.5
    t = time_jax(lambda a: jax.lax.optimization_barrier(a * 1.0001), x, chain=chain_first, reps=8)  # no fusion
    RESULTS["jax_copy_GBps"] = 2 * 4 * n / t / 1e9
    m = 8192 if not ARGS.smoke else 256
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    bm = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    t = time_jax(lambda p, q: p @ q, a, bm, chain=chain_first, reps=5)
    RESULTS["jax_matmul_TFLOPs"] = 2 * m**3 / t / 1e12
    RESULTS["copy_GBps"], RESULTS["matmul_TFLOPs"] = RESULTS["jax_copy_GBps"], RESULTS["jax_matmul_TFLOPs"]
    if not ARGS.smoke and not ARGS.no_fla:
        import torch

        src = torch.ones(1 << 30, dtype=torch.float32, device="cuda")
        dst = torch.empty_like(src)
        t, _ = time_torch([lambda: dst.copy_(src)] * 10)
        RESULTS["torch_copy_GBps"] = 2 * 4 * (1 << 30) / t / 1e9
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        t, _ = time_torch([lambda: a @ b] * 5)
        RESULTS["torch_matmul_TFLOPs"] = 2 * 8192**3 / t / 1e12
        del src, dst, a, b
        torch.cuda.empty_cache()
        RESULTS["copy_GBps"] = max(RESULTS["jax_copy_GBps"], RESULTS["torch_copy_GBps"])
        RESULTS["matmul_TFLOPs"] = max(RESULTS["jax_matmul_TFLOPs"], RESULTS["torch_matmul_TFLOPs"])
    print({k: v for k, v in RESULTS.items() if k.endswith(("GBps", "TFLOPs"))}, flush=True)


def section_check():
    """Every kernel against its reference at Qwen3.5 shapes, bf16 inputs (reference on the same inputs)."""
    sm = ARGS.smoke
    d, hk = (16, 2) if sm else (128, 16)
    for hv, b, t, steps in [(3 * hk, 8, 5, True), (2 * hk, 4, 1, False), (3 * hk, 2, 3, True)]:
        lengths = [t] * (b - 1) + [max(1, t - 2)]
        q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(b * t), b, t, hk, hv, d, lengths=lengths)
        kw = dict(initial_state=s0, use_qk_l2norm_in_kernel=True, output_step_states=steps)
        o, s = fused_recurrent_gated_delta_rule_triton(q, k, v, g, beta, **kw, **impl_kw())
        o_r, s_r = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
        add_check(f"recurrent o b{b} t{t} hv{hv} steps{steps}", *rel_err(o, o_r), 1e-2)
        add_check(f"recurrent state b{b} t{t} hv{hv} steps{steps}", *rel_err(s, s_r), 1e-5)
    t = 100 if sm else 1000
    for hv in ((2 * hk, 3 * hk) if not sm else (2 * hk,)):
        q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(hv), 2, t, hk, hv, d, lengths=[t, t - 333 if not sm else 61])
        kw = dict(initial_state=s0, use_qk_l2norm_in_kernel=True)
        o, s = chunk_gated_delta_rule_triton(q, k, v, g, beta, **kw, **impl_kw())
        o_r, s_r = naive_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
        add_check(f"chunk o t{t} hv{hv}", *rel_err(o, o_r), 2e-2)
        add_check(f"chunk state t{t} hv{hv}", *rel_err(s, s_r), 2e-2)
    d = 32 if sm else 256
    s_len = 300 if sm else 32768 + 40
    for (hq, hkv), b, t in [((16, 2), 4, 1), ((24, 2), 3, 5), ((24, 2), 2, 300 if not sm else 40)]:
        starts = np.array([s_len - t - 7, 123, 5000 if not sm else 50, 17][:b])
        pos = starts[:, None] + np.arange(t)[None]
        pos[-1, -1] = -1
        q, kc, vc, pos = attn_inputs(jax.random.key(t), b, t, hq if not sm else hq // 4, hkv, d, s_len, pos)
        o = cached_attention_triton(q, kc, vc, pos, **impl_kw())
        o_r = attention_reference(q, kc, vc, pos)
        add_check(f"attention b{b} t{t} {hq}/{hkv} S{s_len}", *rel_err(o, o_r, np.asarray(pos)[:, :, None, None] >= 0),
                  1e-2)
    e, kk, h, i = moe_shapes()  # MoE routed experts (35B-A3B), bf16; truth: the same values in float32
    gate_up, down = moe_weights(e, h, i)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    gate_up32, down32 = f32(gate_up), f32(down)
    for n in ((1, 3, 13) if sm else MOE_TOKENS):
        x, w, experts = moe_inputs(n, e, kk, h)
        o = moe_experts_triton(x, w, experts, gate_up, down, **impl_kw())
        o_r = moe_reference(x, w, experts, gate_up, down)
        with jax.default_matmul_precision("highest"):
            truth = ragged_experts(f32(x), f32(w), experts, gate_up32, down32)
        add_check(f"moe n{n} E{e} K{kk} H{h} I{i}", *rel_err(o, o_r), 1e-2, kernel_vs_f32=rel_err(o, truth)[0],
                  xla_bf16_vs_f32=rel_err(o_r, truth)[0])
    del gate_up32, down32


def fla_inputs(b, t, hk, hv, d):
    import torch

    dev = "cuda"
    q = torch.randn(b, t, hk, d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(b, t, hk, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn(b, t, hv, d, dtype=torch.bfloat16, device=dev)
    g = -torch.exp(torch.randn(b, t, hv, dtype=torch.float32, device=dev) - 2.0)
    beta = torch.sigmoid(torch.randn(b, t, hv, dtype=torch.float32, device=dev))
    s0 = 0.1 * torch.randn(b, hv, d, d, dtype=torch.float32, device=dev)
    return q, k, v, g, beta, s0


def section_fla_check():
    """FLA computes the same function as our references (so the timings compare like with like)."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(7), 2, 300, 16, 32, 128)
    tq = [torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda() for a in (q, k, v, g, beta, s0)]
    tq[:3] = [a.to(torch.bfloat16) for a in tq[:3]]
    o_r, s_r = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, use_qk_l2norm_in_kernel=True)
    if not ARGS.chunk_pallas_only:
        o, s = chunk_gated_delta_rule(*tq[:5], initial_state=tq[5], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
        add_check("FLA chunk vs reference: o", *rel_err(o.float().cpu().numpy(), o_r), 2e-2)
        add_check("FLA chunk vs reference: state", *rel_err(s.float().cpu().numpy(), s_r), 2e-2)
    o, s = fused_recurrent_gated_delta_rule(*(a[:, :5].contiguous() for a in tq[:5]), initial_state=tq[5],
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_r, s_r = naive_recurrent_gated_delta_rule(*(a[:, :5] for a in (q, k, v, g, beta)), initial_state=s0,
                                                use_qk_l2norm_in_kernel=True)
    add_check("FLA fused_recurrent vs reference: o", *rel_err(o.float().cpu().numpy(), o_r), 1e-2)
    add_check("FLA fused_recurrent vs reference: state", *rel_err(s.float().cpu().numpy(), s_r), 1e-5)


def gdn_bytes(b, t, hk, hv, d, steps, in_bytes=2):
    io = b * t * (2 * hk * d + 2 * hv * d) * in_bytes + 2 * b * t * hv * 4  # q, k, v, o, g, beta
    state = b * hv * d * d * 4
    return io + state + (t if steps else 1) * state


def section_recurrent():
    sm = ARGS.smoke
    hk, d = (2, 16) if sm else (16, 128)
    fla, fla_decode = None, {}
    if not sm and not ARGS.no_fla:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla
    for hv in ((2 * hk, 3 * hk) if not sm else (2 * hk,)):
        for b in ((1, 8, 64) if not sm else (1, 2)):
            for t in ((1, 5) if not sm else (1, 3)):
                if out_of_time("recurrent"):
                    return
                steps = t > 1
                shape = dict(b=b, t=t, hv=hv, steps=steps)
                nbytes = gdn_bytes(b, t, hk, hv, d, steps)
                q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(b + t), b, t, hk, hv, d)
                kw = dict(use_qk_l2norm_in_kernel=True, output_step_states=steps)
                ours = functools.partial(fused_recurrent_gated_delta_rule_triton, **kw, **impl_kw())
                ref = functools.partial(naive_recurrent_gated_delta_rule, **kw)
                impls = [("pallas", ours)]
                if sm or (hv == 2 * hk and (b, t) in XLA_RECURRENT):
                    impls.append(("xla", ref))
                for name, fn in impls:
                    sec = guarded(f"recurrent {name} {shape}", time_jax,
                                  lambda q, k, v, g, beta, s0, fn=fn: fn(q, k, v, g, beta, initial_state=s0),
                                  q, k, v, g, beta, s0, chain=chain_v, reps=5 if name == "xla" else None)
                    if sec:
                        record("gdn_recurrent", shape, name, sec, nbytes)
                if fla is None:
                    continue
                sets = [fla_inputs(b, t, hk, hv, d) for _ in range(REPS)]

                def fla_once(tq, tk, tv, tg, tb, ts0):
                    return fla(tq, tk, tv, tg, tb, initial_state=ts0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)

                res = guarded(f"recurrent fla {shape}", time_torch,
                              [functools.partial(fla_once, *x) for x in sets])
                if res:
                    record("gdn_recurrent", shape, "fla", res[0], gdn_bytes(b, t, hk, hv, d, False), timer=res[1])
                    if t == 1:
                        fla_decode[hv, b] = res[0]
                if steps and (hv, b) in fla_decode:
                    # FLA has no per-step state output; getting one means one call per token (each reading and
                    # writing the whole state): t x the measured T = 1 call. (Capturing that loop crashed FLA.)
                    record("gdn_recurrent", shape, "fla_per_token_est", t * fla_decode[hv, b], nbytes)
                del sets


def section_commit():
    """A verify window's commit (T = 4) of every GDN layer of the 4B (24 layers, 32 value heads, d = 128) in one
    launch against one launch per layer: the states bit for bit, against the reference, and the time."""
    sm = ARGS.smoke
    n_layers, hk, hv, d, t = (3, 2, 4, 16, 4) if sm else (24, 16, 32, 128, 4)
    for b in ((1, 2, 4, 8) if not sm else (2,)):
        if out_of_time("commit"):
            return
        layers = [gdn_inputs(jax.random.key(100 + i), b, t, hk, hv, d, lengths=[3] * b) for i in range(n_layers)]
        # per-layer arrays, as the verify leaves them: args = k, v, g, beta of every layer, then the L states
        args = [x[i] for i in (1, 2, 3, 4) for x in layers] + [x[5] for x in layers]
        every = jnp.full((b,), t, jnp.int32)  # g and beta are 0 on the padding already
        nl = n_layers
        split = lambda a: [list(a[i * nl:(i + 1) * nl]) for i in range(5)]  # noqa: E731

        def per_layer(*a):
            return [commit_gated_delta_rule_triton(*layer, **impl_kw()) for layer in zip(*split(a))]

        def one_launch(*a):
            return commit_windows_triton(*split(a), every, **impl_kw())

        got, each = one_launch(*args), per_layer(*args)
        diff = max(float(jnp.max(jnp.abs(a - e))) for a, e in zip(got, each))
        # bit for bit on the GPU (the same instructions); the CPU interpreter's rounding differs between the two
        add_check(f"commit {n_layers} layers b{b}: one launch vs per layer (bit for bit)", diff, True,
                  1e-6 if sm else 1e-30)
        ref = [naive_recurrent_gated_delta_rule(x[1], x[1], x[2], x[3], x[4], initial_state=x[5],
                                                use_qk_l2norm_in_kernel=True)[1] for x in layers]
        add_check(f"commit {n_layers} layers b{b} vs reference", max(rel_err(a, r)[0] for a, r in zip(got, ref)),
                  all(bool(jnp.isfinite(a).all()) for a in got), 1e-5)
        chain = lambda a, out: (*a[:4 * nl], *out)  # noqa: E731
        nbytes = n_layers * gdn_bytes(b, t, hk, hv, d, False)
        for name, fn in (("per_layer", per_layer), ("one_launch", one_launch)):
            sec = guarded(f"commit {name} b{b}", time_jax, fn, *args, chain=chain)
            if sec:
                record("gdn_commit", dict(b=b, t=t, hv=hv, layers=n_layers), name, sec, nbytes)


def section_mixer():
    """The one-kernel GDN mixer of a decode (T = 1, "final"), a verify window (T = 2, 4, "replay") and a 4-token
    "final" window at the 0.8B and 4B shapes (Hk 16, Hv 16 / 32, d 128), batch 1 and 8, under launch variants
    (``--mixer-variants``, a JSON list of keyword sets of :func:`gdn_mixer_triton`; the defaults are always timed
    first). Device time (use ``--timer trace``): the kernels of a chain of calls, the small chain op included, so
    compare variants, not absolutes."""
    from jaxmtp.pallas.gated_delta_rule.mixer_triton import gdn_mixer_triton

    sm = ARGS.smoke
    variants = [{}] + (json.loads(ARGS.mixer_variants) if ARGS.mixer_variants else [
        {"num_warps": 2}, {"num_warps": 8}, {"block_v": 16}, {"block_v": 16, "num_warps": 2},
        {"block_v": 64, "num_warps": 8}])
    shapes = [("tiny", 2, 4, 16)] if sm else [("0.8b", 16, 16, 128), ("4b", 16, 32, 128)]
    for name, hk, hv, d in shapes:
        c = 2 * hk * d + hv * d
        p_cols = c + hv * d + 2 * hv
        configs = ((1, 1, False), (1, 2, True), (1, 4, True), (1, 4, False), (8, 4, True)) if not sm else (
            (1, 1, False), (2, 4, True))
        for b, t, replay in configs:  # replay False with T > 1: a short prefill window (the state after it)
            if out_of_time("mixer"):
                return
            key = jax.random.split(jax.random.key(b * 10 + t), 6)
            proj = jax.random.normal(key[0], (b, t, p_cols), jnp.bfloat16)
            ring = jax.random.normal(key[1], (b, 4, c), jnp.bfloat16)
            conv_w = 0.3 * jax.random.normal(key[2], (4, c), jnp.bfloat16)
            a_log, dt_bias = jax.random.normal(key[3], (hv,)), jax.random.normal(key[4], (hv,))
            state = 0.1 * jax.random.normal(key[5], (b, hv, d, d), jnp.float32)
            valid, start = jnp.ones((b, t), bool), jnp.full((b,), 7, jnp.int32)
            # the next call's state depends on this call's output (a true dependency; one small fused op)
            chain = lambda a, out: (*a[:5], a[5] + out[0][0, 0, 0, 0].astype(jnp.float32), *a[6:])  # noqa: E731
            ref = None
            for kw in variants:
                if kw.get("block_v", 0) > d:
                    continue
                fn = functools.partial(gdn_mixer_triton, hk=hk, hv=hv, dk=d, dv=d, replay=replay, **kw,
                                       **impl_kw())
                out = guarded(f"mixer {name} {kw}", fn, proj, ring, conv_w, a_log, dt_bias, state, valid, start)
                if out is None:
                    continue
                if ref is None:
                    ref = out[0]
                else:
                    add_check(f"mixer {name} b{b} t{t} {kw} vs defaults", rel_err(out[0], ref)[0],
                              bool(jnp.isfinite(out[0].astype(jnp.float32)).all()), 1e-2)
                sec = guarded(f"mixer {name} {kw}", time_jax, fn, proj, ring, conv_w, a_log, dt_bias, state, valid,
                              start, chain=chain)
                if sec:
                    record("gdn_mixer", dict(model=name, b=b, t=t, replay=replay), json.dumps(kw), sec)


def chunk_flops(b, t, hk, hv, d, c=64):
    n = math.ceil(t / c)
    per_chunk = 2 * (4 * c * c * d + 4 * c * d * d)  # kk^T, qk^T, T.v, T.k; W.S, Q.S, K^T.V_new, Aqk.V_new (~c*c*d)
    return b * hv * n * per_chunk


def chunk_tiles(spec):
    """A ``--chunk-variants`` entry: ``auto`` (the kernel policy's choice), ``f,bv,warps,stages`` (read-out fused
    into the sequential pass) or ``s,bv,warps,stages,out_bv,out_warps`` (separate read-out launch), then any
    ``field=value`` of :class:`ChunkTiles` (e.g. ``prep_num_warps=2,prep_sub_chunk=32``); fields not given keep the
    policy's."""
    tiles = DEFAULT_POLICY.gdn_chunk_tiles()
    if spec == "auto":
        return tiles
    form, *vals = spec.split(",")
    named = dict(v.split("=") for v in vals if "=" in v)
    vals = [v for v in vals if "=" not in v]
    keys = ("block_v", "num_warps", "num_stages") + (("out_block_v", "out_num_warps") if form == "s" else ())
    fields = dict(zip(keys, map(int, vals)))
    if "num_stages" in fields:  # stages given: at every grid size
        fields["multiwave_num_stages"] = fields["num_stages"]
    return dataclasses.replace(tiles, fused_readout=form == "f", **fields, **{k: int(v) for k, v in named.items()})


def kernel_breakdown(fn, *args, chain, calls=8):
    """Device microseconds per call of each kernel name in a profiler trace of ``calls`` chained calls."""
    per = collections.defaultdict(float)
    for e in device_kernels(fn, *args, chain=chain, calls=calls)[0]:
        per[e.get("name", "?")] += e["dur"] / calls
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def section_chunk(configs=None):
    """Chunked GDN prefill: ours (each ``--chunk-variants`` entry), the XLA reference and FLA at ``--chunk-shapes``
    (B:T:Hv; Hk = 16, dk = dv = 128); a per-kernel trace of each of our variants."""
    sm = ARGS.smoke
    hk, d = (2, 16) if sm else (16, 128)
    fla = None
    if not sm and not ARGS.no_fla:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
    shapes = [(1, 128, 4), (2, 80, 4)] if sm else ARGS.chunk_shapes
    fla_rows = []
    for b, t, hv in shapes:
        if out_of_time("chunk"):
            break
        shape = dict(b=b, t=t, hv=hv)
        nbytes = gdn_bytes(b, t, hk, hv, d, False)
        flops = chunk_flops(b, t, hk, hv, d)
        q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(t + hv + b), b, t, hk, hv, d)
        kw = dict(use_qk_l2norm_in_kernel=True)
        impls = []
        for spec in ARGS.chunk_variants.split(";"):
            tiles = chunk_tiles(spec)
            impls.append((f"pallas[{spec}]" if spec != "auto" else "pallas",
                          functools.partial(chunk_gated_delta_rule_triton, **kw, tiles=tiles, **impl_kw())))
        if not ARGS.chunk_pallas_only:
            impls.append(("xla", functools.partial(naive_chunk_gated_delta_rule, **kw)))
        for i, (name, fn) in enumerate(impls):
            call = lambda q, k, v, g, beta, s0, fn=fn: fn(q, k, v, g, beta, initial_state=s0)  # noqa: E731
            sec = guarded(f"chunk {name} {shape}", time_jax, call, q, k, v, g, beta, s0, chain=chain_v,
                          reps=3 if name == "xla" else None)
            if sec:
                extra = {}
                if name != "xla" and not sm:
                    extra["kernels_us"] = guarded(f"chunk trace {shape}", kernel_breakdown, call, q, k, v, g, beta,
                                                  s0, chain=chain_v)
                record("gdn_chunk", shape, name, sec, nbytes, flops, **extra)
        if fla is not None:
            sets = [fla_inputs(b, t, hk, hv, d) for _ in range(4)]
            fns = [functools.partial(lambda tq, tk, tv, tg, tb, ts0: fla(
                tq, tk, tv, tg, tb, initial_state=ts0, output_final_state=True, use_qk_l2norm_in_kernel=True), *x)
                for x in sets]
            res = guarded(f"chunk fla {shape}", time_torch, fns)
            if res:
                fla_rows.append((record("gdn_chunk", shape, "fla", res[0], nbytes, flops, timer=res[1]), fns))
    # FLA's launches last: once the torch profiler has run, JAX's profiler can no longer subscribe to CUPTI
    for row, fns in fla_rows:
        row["kernels_us"] = guarded(f"chunk fla trace {row['shape']}", torch_kernel_breakdown, fns)
        print(json.dumps({"fla_kernels_us": row["kernels_us"], "shape": row["shape"]}), flush=True)


def attn_bytes(b, t, hq, hkv, d, n_valid):
    return b * hkv * n_valid * d * 2 * 2 + 2 * b * t * hq * d * 2


ATTN_TILE_KEYS = ("block_rows", "block_kv", "num_warps", "num_stages", "n_split")  # --attention-variants
ATTN_SPLIT_KEYS = ("n_split", "block_kv", "num_warps", "num_stages")  # --attention-splits


def attention_variant(spec, keys):
    """One ';'-separated entry of ``--attention-variants`` / ``--attention-splits``: ``plan`` (the launch plan: no
    keywords) or comma-separated integers for the first of ``keys``, in order."""
    spec = spec.strip()
    if spec == "plan":
        return {}
    vals = [int(x) for x in spec.split(",")]
    if len(vals) > len(keys):
        raise ValueError(f"attention variant {spec!r}: at most {len(keys)} values ({','.join(keys)})")
    return dict(zip(keys, vals))


def attention_specs(flag, smoke_default):
    """The entries of a ';'-separated variants flag, ``plan`` first (``smoke_default`` under --smoke)."""
    extra = [v.strip() for v in (flag or (smoke_default if ARGS.smoke else "")).split(";") if v.strip()]
    return ["plan"] + [v for v in extra if v != "plan"]


def causal_flops(hq, d, positions):
    """Matmul FLOPs causal attention needs: ``4 * d * Hq`` per visible (query, kv row) pair, summed over the query
    rows (``pos + 1`` pairs each; padding rows none)."""
    pos = np.asarray(positions, np.int64)
    return 4 * d * hq * float(np.where(pos >= 0, pos + 1, 0).sum())


def kv_read_bytes(b, hkv, d, n_rows, itemsize=2):
    """K and V rows 0..n_rows-1 of every (batch row, kv head): what a decode step must read."""
    return 2 * b * hkv * n_rows * d * itemsize


def chain_fused(a, out):
    """The fused layer: the next call reads the caches this one wrote, and its projection moves by one element of
    this call's output (so no launch is dead code)."""
    return (a[0] + out[0][0, 0, 0].astype(a[0].dtype), *a[1:4], out[1], out[2], a[6])


def _attention_decode():
    sm = ARGS.smoke
    d = 32 if sm else 256
    heads = [(16, 2), (24, 2)] if not sm else [(4, 2)]
    for hq, hkv in heads:
        for s in ((4096, 32768) if not sm and hq == 24 else (32768,) if not sm else (128,)):
            for b in ((1, 8, 32) if not sm else (1, 2)):
                for t in (1, 5):
                    if not sm and ((hq == 16 and (t == 5 or b == 32)) or (s == 4096 and b != 8)):
                        continue
                    if out_of_time("attention"):
                        return
                    shape = dict(b=b, t=t, hq=hq, hkv=hkv, ctx=s)
                    pos = np.broadcast_to(s - t + np.arange(t), (b, t))
                    args = attn_inputs(jax.random.key(b * s + t), b, t, hq, hkv, d, s, pos)
                    nbytes = attn_bytes(b, t, hq, hkv, d, s)
                    impls = [("pallas", functools.partial(cached_attention_triton, **impl_kw()))]
                    if sm or (hq == 24 and (b, t) in XLA_ATTENTION):
                        impls.append(("xla", attention_reference))
                    for name, fn in impls:
                        sec = guarded(f"attention {name} {shape}", time_jax, fn, *args, chain=chain_first,
                                      reps=5 if name == "xla" else None)
                        if sec:
                            record("attention_decode", shape, name, sec, nbytes)


def _attention_prefill():
    from jaxmtp.pallas.attention.decode_triton import launch_plan

    sm = ARGS.smoke
    d = 32 if sm else 256
    # (b, t, hq, hkv, cache rows, first position): causal prompts, then late chunks at the end of 8k / 32k caches
    shapes = [(1, 64, 4, 2, 64, 0), (2, 24, 6, 2, 80, 56)] if sm else [
        (1, 4096, 24, 4, 4096, 0), (1, 4096, 24, 2, 4096, 0), (1, 1024, 24, 4, 8192, 7168),
        (1, 1024, 24, 4, 32768, 31744)]
    specs = attention_specs(ARGS.attention_variants, "16,16,4,3;32,64,4,2,2")
    for b, t, hq, hkv, s, p0 in shapes:
        shape = dict(b=b, t=t, hq=hq, hkv=hkv, ctx=s, pos0=p0)
        pos = np.broadcast_to(p0 + np.arange(t), (b, t))
        args = attn_inputs(jax.random.key(t + s + hkv), b, t, hq, hkv, d, s, pos)
        flops = causal_flops(hq, d, pos)
        ref = ref_spec = None
        for spec in specs:
            if out_of_time("attention prefill"):
                return
            kw = attention_variant(spec, ATTN_TILE_KEYS)
            if kw.get("block_kv", 0) > s or kw.get("block_rows", 0) > max(16, t * hq // hkv):
                continue
            fn = functools.partial(cached_attention_triton, **kw, **impl_kw())
            out = guarded(f"attention prefill {spec} {shape}", fn, *args)
            if out is None:
                continue
            if ref is None:
                ref, ref_spec = out, spec
            else:
                add_check(f"attention prefill {shape} {spec} vs {ref_spec}", *rel_err(out, ref), 1e-2)
            sec = guarded(f"attention prefill {spec} {shape}", time_jax, fn, *args, chain=chain_first,
                          reps=2 if sm else None)
            if sec:
                extra = {"plan": launch_plan(b, t, hq, hkv, s)._asdict()} if spec == "plan" else {}
                record("attention_prefill", shape, spec, sec, None, flops, **extra)
        if ref is not None and (sm or (p0 == 0 and hkv == 2)):  # the XLA reference at the 24/2 prompt
            if out_of_time("attention prefill xla"):
                return
            add_check(f"attention prefill {shape} {ref_spec} vs xla", *rel_err(ref, attention_reference(*args)), 1e-2)
            sec = guarded(f"attention prefill xla {shape}", time_jax, attention_reference, *args, chain=chain_first,
                          reps=3)
            if sec:
                record("attention_prefill", shape, "xla", sec, None, flops)
        del ref, args


def _attention_mosaic():
    """Prefill attention on Hopper: our Mosaic GPU kernel (:mod:`jaxmtp.pallas.attention.prefill_mosaic`, what the
    policy runs for prefill chunks there) beside the Triton kernel's plan, at causal 4k / 8k / 16k prompts from
    position 0 and late 1k / 2k chunks of 8k / 32k caches (24/4 heads, head_dim 256); on the prompts also JAX's own
    Mosaic GPU flash attention (``jax.experimental.pallas.ops.gpu.attention_mgpu``: float16 only, causal only from
    position 0, no cache offset; inputs ours cast to float16 (exact here), q pre-scaled by 1/16 (exact), the cache
    read as ``[B, S, Hkv, D]``). Each checked against the plan."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    from jaxmtp.pallas.attention.prefill_mosaic import prefill_attention_mosaic

    d = 256
    cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
    for t, s, p0 in ((4096, 4096, 0), (8192, 8192, 0), (16384, 16384, 0), (1024, 8192, 7168), (1024, 32768, 31744),
                     (2048, 32768, 30720)):
        if out_of_time("attention mosaic"):
            return
        b, hq, hkv = 1, 24, 4
        shape = dict(b=b, t=t, hq=hq, hkv=hkv, ctx=s, pos0=p0)
        pos = np.broadcast_to(p0 + np.arange(t), (b, t))
        q, kc, vc, pos = attn_inputs(jax.random.key(t + s), b, t, hq, hkv, d, s, pos)
        flops = causal_flops(hq, d, pos)
        ours = functools.partial(cached_attention_triton, **impl_kw())
        ref = guarded(f"attention mosaic plan {shape}", ours, q, kc, vc, pos)
        sec = guarded(f"attention mosaic plan {shape}", time_jax, ours, q, kc, vc, pos, chain=chain_first)
        if sec:
            record("attention_prefill", shape, "plan", sec, None, flops)
        runs = [("mosaic", prefill_attention_mosaic, (q, kc, vc, pos), lambda o: o)]
        if p0 == 0:
            f16 = [(q * d**-0.5).astype(jnp.float16)] + [c.transpose(0, 2, 1, 3).astype(jnp.float16) for c in (kc, vc)]
            runs.append(("jax_mosaic_gpu", functools.partial(attention_mgpu.attention, config=cfg), tuple(f16),
                         lambda o: o.astype(jnp.bfloat16)))
        for name, fn, args, cast in runs:
            out = guarded(f"attention {name} {shape}", fn, *args)
            if out is None:
                continue
            if ref is not None:
                add_check(f"attention {name} {shape} vs plan", *rel_err(cast(out), ref), 1e-2)
            sec = guarded(f"attention {name} {shape}", time_jax, fn, *args, chain=chain_first)
            if sec:
                record("attention_prefill", shape, name, sec, None, flops)
        del q, kc, vc, ref, runs


def _attention_splits():
    from jaxmtp.pallas.attention.decode_triton import launch_plan
    from jaxmtp.pallas.attention.prelude_triton import fused_splits, gated_attention_triton
    from jaxmtp.pallas.attention.rope import rope_inv_freq

    sm = ARGS.smoke
    d, rd, s = (32, 8, 128) if sm else (256, 64, 32768)
    specs = attention_specs(ARGS.attention_splits, "3,16;40,16,4,2")
    for hq, hkv in ([(4, 2)] if sm else [(24, 4), (24, 2)]):
        for b in ((2,) if sm else (1, 8)):
            shape = dict(b=b, t=1, hq=hq, hkv=hkv, ctx=s)
            nbytes = kv_read_bytes(b, hkv, d, s)
            q, kc, vc, pos = attn_inputs(jax.random.key(b * 7 + hkv), b, 1, hq, hkv, d, s, np.full((b, 1), s - 1))
            proj = jax.random.normal(jax.random.key(b), (b, 1, 2 * (hq + hkv) * d), jnp.bfloat16)
            norm = 0.1 * jax.random.normal(jax.random.key(5), (d,), jnp.float32)
            inv_freq = jnp.asarray(rope_inv_freq(rd, 1e7), jnp.float32)
            plan_splits = launch_plan(b, 1, hq, hkv, s).n_split
            paths = {"fused": (functools.partial(gated_attention_triton, hq=hq, hkv=hkv, d=d, eps=1e-6),
                               (proj, norm, norm, inv_freq, kc, vc, pos), chain_fused, fused_splits(plan_splits)),
                     "core": (cached_attention_triton, (q, kc, vc, pos), chain_first, plan_splits)}
            for path, (base, args, chain, ns_plan) in paths.items():
                ref = ref_spec = None
                for spec in specs:
                    if out_of_time("attention splits"):
                        return
                    kw = attention_variant(spec, ATTN_SPLIT_KEYS)
                    fn = functools.partial(base, **kw, **impl_kw())
                    out = guarded(f"attention {path} {spec} {shape}", fn, *args)
                    if out is None:
                        continue
                    y = out[0] if path == "fused" else out
                    if ref is None:
                        ref, ref_spec = y, spec
                    else:
                        add_check(f"attention {path} {shape} {spec} vs {ref_spec}", *rel_err(y, ref), 1e-2)
                    del out
                    sec = guarded(f"attention {path} {spec} {shape}", time_jax, fn, *args, chain=chain,
                                  reps=2 if sm else None)
                    if sec:
                        record(f"attention_decode_{path}", shape, spec, sec, nbytes, n_split=kw.get("n_split", ns_plan))
                del ref


def section_attention():
    """Attention over the KV carry, the parts named by ``--attention-parts``:

    - ``decode``: the launch plan at decode and verify windows (B 1-32, 16/2 and 24/2 heads, 4k and 32k contexts), XLA
      at a few;
    - ``prefill``: ``plan`` and each ``--attention-variants`` entry (``bm,bs,warps,stages[,splits]``) at causal
      4096-token prompts (24/4 and 24/2 heads) and 1024-token chunks at positions 7168.. and 31744.. of 8k and 32k
      caches (24/4); TFLOP/s of the FLOPs causal attention needs (:func:`causal_flops`), each variant checked against
      the plan; XLA at the 24/2 prompt;
    - ``splits``: decode (T = 1, B 1 and 8, 24/4 and 24/2 heads, a 32k cache wholly valid) through the fused layer
      (``prelude_triton.gated_attention_triton``: prelude, attention, epilogue) and through
      ``cached_attention_triton`` (jnp combine), for ``plan`` and each ``--attention-splits`` entry
      (``splits[,bs,warps,stages]``); GB/s of the K and V rows read (:func:`kv_read_bytes`);
    - ``mosaic`` (not in the default list; Hopper): our Mosaic GPU prefill kernel and JAX's own Mosaic GPU flash
      attention beside the Triton plan (:func:`_attention_mosaic`)."""
    parts = {p.strip() for p in ARGS.attention_parts.split(",")}
    for name, fn in (("decode", _attention_decode), ("prefill", _attention_prefill), ("splits", _attention_splits),
                     ("mosaic", _attention_mosaic)):
        if name in parts and not out_of_time(f"attention {name}"):
            guarded(f"attention {name}", fn)


def section_moe():
    """Routed MoE experts at decode / verify token counts, 35B-A3B shapes (E 256, top-8, H 2048, I 512, bf16): the
    Triton grouped kernel vs the XLA paths (per-row gather of expert matrices, ragged_dot). Bandwidth counts the
    bytes of the experts touched (and x / output once); the routing moves to other experts every call."""
    sm = ARGS.smoke
    e, kk, h, i = moe_shapes()
    gate_up, down = moe_weights(e, h, i)
    per_expert = (h * 2 * i + i * h) * gate_up.dtype.itemsize
    for n in ((1, 3, 13) if sm else MOE_TOKENS):
        if out_of_time("moe"):
            return
        x, w, experts = moe_inputs(n, e, kk, h)
        touched = len(np.unique(np.asarray(experts)))
        nbytes = touched * per_expert + 2 * n * h * x.dtype.itemsize
        flops = 2 * n * kk * 3 * h * i
        shape = dict(tokens=n, experts_touched=touched)
        impls = [("pallas", functools.partial(moe_experts_triton, **impl_kw()),
                  dict(plan=moe_plan_kw(n * kk, e, h, i)))]
        impls.append(("xla_ragged_dot", ragged_experts, {}))
        if n <= MOE_GATHER_MAX:
            impls.append(("xla_gather", gathered_experts, {}))
        for name, fn, extra in impls:
            sec = guarded(f"moe {name} n{n}", time_jax, fn, x, w, experts, gate_up, down, chain=chain_moe)
            if sec:
                record("moe_experts", shape, name, sec, nbytes, flops, **extra)


# (model, weight, K, N) of floating projections, stored [K, N] (x @ W); the 4B's tied head [V, H] for the draft head
MATMUL_SHAPES = [
    ("0.8b", "mlp gate|up", 1024, 7168), ("0.8b", "mlp down", 3584, 1024), ("0.8b", "gdn in_proj", 1024, 6144),
    ("4b", "mlp gate|up", 2560, 18432), ("4b", "mlp down", 9216, 2560), ("4b", "gdn in_proj", 2560, 8192),
    ("4b", "gdn out_proj", 4096, 2560),
]
MATMUL_ROWS = (1, 4)
HEAD_SHAPE = (248320, 2560)  # (V, H) of the 4B


def chain_rows(a, out):
    """Projections: the output feeds the next call's x (a true dependency; x keeps its shape)."""
    return (a[0] + (out[..., :1] * 1e-3).astype(a[0].dtype), *a[1:])


def section_matmul():
    """Few-row projections (decode: 1 row, a k = 3 verify: 4 rows) at the 0.8B and 4B shapes: XLA's ``x @ W``
    against the tensor-core few-row kernel (``skinny_matmul_triton``, default tiles) and, where it applies, the
    multiply-add kernel (``gemv_matmul_triton``) on the weight stored ``[N, K]``; then the draft head (the 4B's [V, H], int8 and int4 rows) through
    ``quantized_linear`` as the engine dispatches it, against XLA's product and the bf16 head. Each kernel is checked
    against a float64 product (``check`` rows). Bandwidth: weight bytes over time."""
    from jaxmtp.pallas.matmul import matmul_reference, quantized_linear
    from jaxmtp.pallas.matmul.gemv_triton import gemv_matmul_triton
    from jaxmtp.pallas.matmul.gemv_triton import supports as gemv_supports
    from jaxmtp.pallas.matmul.skinny_triton import skinny_matmul_triton
    from jaxmtp.param_layout import quantize_rows, quantize_rows_int4

    sm = ARGS.smoke
    shapes = [("tiny", "w", 256, 384)] if sm else MATMUL_SHAPES
    for (model, name, k, n), m in ((s, m) for s in shapes for m in MATMUL_ROWS):
        if out_of_time("matmul"):
            return
        key = jax.random.key(k * 7 + n + m)
        x = jax.random.normal(key, (m, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.fold_in(key, 1), (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        shape, nbytes = dict(model=model, w=name, m=m, k=k, n=n), w.size * 2
        w_t = w.T.copy()  # the [N, K] layout the multiply-add kernel reads (block-output weights, int8 heads)
        impls = {"xla": (lambda a, b: matmul_reference(a, b), w),
                 "skinny": (lambda a, b: skinny_matmul_triton(a, b, **impl_kw()), w)}
        if gemv_supports(m, k, n, True, w.dtype):
            impls["gemv_nk"] = (lambda a, b: gemv_matmul_triton(a, b, transpose_w=True, **impl_kw()), w_t)
        for impl, (fn, weight) in impls.items():
            if impl != "xla":
                add_check(f"matmul {impl} {model} {name} m{m}", *rel_err(fn(x, weight), want), 1e-2)
            record("matmul", shape, impl, time_jax(fn, x, weight, chain=chain_rows), nbytes)
    v, h = (512, 256) if sm else HEAD_SHAPE
    head = (jax.random.normal(jax.random.key(5), (v, h), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
    kernel = "triton_interpret" if sm else "triton"
    for m in MATMUL_ROWS:
        if out_of_time("matmul"):
            return
        x = jax.random.normal(jax.random.key(m), (m, h), jnp.bfloat16)
        shape = dict(model="tiny" if sm else "4b", w="draft head", m=m, k=h, n=v)
        record("draft_head", shape, "bf16_xla", time_jax(lambda a, b: matmul_reference(
            a, b, transpose_w=True, out_dtype=jnp.float32), x, head, chain=chain_rows), head.size * 2)
        for bits, quantize in ((8, quantize_rows), (4, quantize_rows_int4)):
            q, scale = quantize(head)
            nbytes = q.size * q.dtype.itemsize + scale.size * scale.dtype.itemsize
            want = quantized_linear(x, q, scale, implementation="xla")
            got = quantized_linear(x, q, scale, implementation=kernel)
            add_check(f"draft head int{bits} m{m}", *rel_err(got, want), 1e-2)
            for impl in ("xla", kernel):
                record("draft_head", shape, f"int{bits}_{impl}", time_jax(
                    lambda a, b, c, impl=impl: quantized_linear(a, b, c, implementation=impl), x, q, scale,
                    chain=chain_rows), nbytes)


# (weight, K, N) of Qwen3.5-27B projections that the official FP8 checkpoint holds as e4m3 [N, K] with 128 x 128
# block scales
FP8_SHAPES = [("mlp gate, up", 5120, 17408), ("mlp down", 17408, 5120), ("attn q|k|v", 5120, 12288),
              ("gdn in_proj qkv|z", 5120, 16384)]
FP8_ROWS = (1, 4, 32)  # decode, a k = 3 verify window, batch decode


def section_fp8():
    """Block-FP8 weights at Qwen3.5-27B shapes, 1 / 4 / 32 rows: the FP8 kernel (``fp8_matmul_triton``, its plan)
    against the bf16 product the weight would otherwise be (XLA's ``x @ W`` on W [K, N], and the skinny kernel) and
    against the FP8 reference (dequantise, then XLA's product: the dispatcher's fallback). Bandwidth: the weight
    bytes each reads (e4m3 + float32 block scales; bf16) over time; ``x_bf16``: the best bf16 time over this one.
    Up to 4 rows the kernel's tensor-core path is timed too (``fp8_triton_dots``: where the two paths meet). The
    kernel is checked against a float64 product of the dequantised weight (``check`` rows)."""
    from jaxmtp.pallas.matmul import matmul_reference
    from jaxmtp.pallas.matmul.fp8_triton import FMA_MAX_ROWS, fp8_matmul_triton
    from jaxmtp.pallas.matmul.fp8_triton import plan as fp8_plan
    from jaxmtp.pallas.matmul.reference import dequantize_fp8, fp8_matmul_reference
    from jaxmtp.pallas.matmul.skinny_triton import skinny_matmul_triton
    from jaxmtp.pallas.matmul.skinny_triton import supports as skinny_supports
    from jaxmtp.quantize import quantize_fp8_blocks

    sm = ARGS.smoke
    for name, k, n in ([("w", 256, 384)] if sm else FP8_SHAPES):
        key = jax.random.key(k + 3 * n)
        w = jax.random.normal(key, (n, k), jnp.float32) * k**-0.5
        q, scale = quantize_fp8_blocks(w)
        w_kn = w.T.astype(jnp.bfloat16)  # the bf16 weight as the engine stores it, [K, N]
        del w
        w64 = np.asarray(dequantize_fp8(q, scale), np.float64)
        fp8_bytes, bf16_bytes = q.size + scale.size * scale.dtype.itemsize, w_kn.size * 2
        for m in FP8_ROWS:
            if out_of_time("fp8"):
                return
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
            shape = dict(model="tiny" if sm else "27b", w=name, m=m, k=k, n=n)
            fp8 = functools.partial(fp8_matmul_triton, **impl_kw())
            add_check(f"fp8 {name} m{m}", *rel_err(fp8(x, q, scale), np.asarray(x, np.float64) @ w64.T), 1e-2)
            bf16 = {"bf16_xla": matmul_reference}
            if skinny_supports(m, k, n):
                bf16["bf16_skinny"] = lambda a, b: skinny_matmul_triton(a, b, **impl_kw())
            times = {impl: time_jax(fn, x, w_kn, chain=chain_rows) for impl, fn in bf16.items()}
            for impl, sec in times.items():
                record("fp8", shape, impl, sec, bf16_bytes)
            best = min(times.values())
            impls = [("fp8_xla_reference", fp8_matmul_reference, {}), ("fp8_triton", fp8, {})]
            if m <= FMA_MAX_ROWS:  # the tensor-core path at these rows too (the threshold between the paths)
                impls.append(("fp8_triton_dots", fp8, dict(fma_max_rows=0)))
            for impl, fn, kw in impls:
                sec = time_jax(functools.partial(fn, **kw), x, q, scale, chain=chain_rows)
                extra = dict(plan=fp8_plan(m, k, n, **kw)._asdict()) if impl.startswith("fp8_triton") else {}
                record("fp8", shape, impl, sec, fp8_bytes, x_bf16=best / sec, **extra)


def section_sweep():
    """Tile sizes of each kernel at a few shapes (the defaults come from here)."""
    sm = ARGS.smoke
    hk, d = (2, 16) if sm else (16, 128)
    for b, t, hv in ([(64, 5, 48), (8, 5, 32), (1, 1, 32), (64, 1, 32)] if not sm else [(2, 3, 4)]):
        q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(11), b, t, hk, hv, d)
        steps = t > 1
        for bv, nw in ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4)):
            if out_of_time("sweep"):
                return
            if bv > d:
                continue
            fn = functools.partial(fused_recurrent_gated_delta_rule_triton, use_qk_l2norm_in_kernel=True,
                                   output_step_states=steps, block_v=bv, num_warps=nw, **impl_kw())
            sec = guarded("sweep recurrent", time_jax, lambda *a, fn=fn: fn(*a[:5], initial_state=a[5]),
                          q, k, v, g, beta, s0, chain=chain_v)
            if sec:
                record("sweep_gdn_recurrent", dict(b=b, t=t, hv=hv), f"bv{bv}_w{nw}", sec,
                       gdn_bytes(b, t, hk, hv, d, steps))
    t = 16384 if not sm else 128
    q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(12), 1, t, hk, 2 * hk, d)
    for spec in ("f,32,4,3", "f,16,4,3", "f,64,4,2", "f,32,8,3", "s,32,4,3,64,4", "s,16,4,3,64,4", "s,32,4,3,128,8"):
        if out_of_time("sweep"):
            return
        tiles = chunk_tiles(spec)
        if tiles.block_v > d:
            continue
        fn = functools.partial(chunk_gated_delta_rule_triton, use_qk_l2norm_in_kernel=True, tiles=tiles, **impl_kw())
        sec = guarded("sweep chunk", time_jax, lambda *a, fn=fn: fn(*a[:5], initial_state=a[5]), q, k, v, g, beta, s0,
                      chain=chain_v)
        if sec:
            record("sweep_gdn_chunk", dict(t=t, hv=2 * hk), spec, sec,
                   gdn_bytes(1, t, hk, 2 * hk, d, False), chunk_flops(1, t, hk, 2 * hk, d))
    dd = 32 if sm else 256
    s = 32768 if not sm else 128
    for b, t, hq in ([(1, 1, 16), (1, 5, 24), (8, 1, 16), (32, 5, 24)] if not sm else [(1, 1, 4)]):
        hq = hq if not sm else 4
        pos = np.broadcast_to(s - t + np.arange(t), (b, t))
        args = attn_inputs(jax.random.key(13), b, t, hq, 2, dd, s, pos)
        for bs, nw, ns, split_mul in ((64, 4, 3, 1), (32, 4, 3, 1), (64, 4, 2, 1), (128, 4, 2, 1), (64, 8, 3, 1),
                                      (32, 2, 4, 1), (64, 4, 3, 2), (64, 4, 3, 0.5)):
            if out_of_time("sweep"):
                return
            from jaxmtp.pallas.attention.decode_triton import plan

            _, _, ns0 = plan(b, t, hq, 2, s)
            n_split = max(1, min(int(ns0 * split_mul), s // bs))
            fn = functools.partial(cached_attention_triton, block_kv=bs, num_warps=nw, num_stages=ns, n_split=n_split,
                                   **impl_kw())
            sec = guarded("sweep attention", time_jax, fn, *args, chain=chain_first)
            if sec:
                record("sweep_attention", dict(b=b, t=t, hq=hq, ctx=s), f"bs{bs}_w{nw}_s{ns}_split{n_split}", sec,
                       attn_bytes(b, t, hq, 2, dd, s))


def moe_plan_kw(n_pairs, e, h, i):
    """The plan of :func:`moe_experts_triton` as its keyword arguments."""
    from jaxmtp.pallas.moe.grouped_triton import plan
    from jaxmtp.pallas.moe.layout import choose_layout

    layout, bm, nb = choose_layout(n_pairs, e)
    bn1, bk1, split, bn2, bk2 = plan(nb, h, i)
    return dict(layout=layout, block_rows=bm, n_blocks=nb, block_up=bn1, block_k=bk1, split_h=split,
                block_down=bn2, block_k_down=bk2, num_warps=4, num_stages=3)


def section_moe_sweep():
    """The MoE kernel's plan against single changes of it (layout, H split, tiles, launch settings), 35B-A3B."""
    sm = ARGS.smoke
    e, kk, h, i = moe_shapes()
    gate_up, down = moe_weights(e, h, i)
    per_expert = (h * 2 * i + i * h) * gate_up.dtype.itemsize
    variants = [dict(), dict(layout="pairs"), dict(layout="sorted"), dict(split_h=1), dict(split_h=2),
                dict(split_h=4), dict(block_up=16), dict(block_up=32), dict(block_up=64), dict(block_up=128),
                dict(block_k=64), dict(block_k=256), dict(num_warps=2), dict(num_warps=8), dict(num_stages=2),
                dict(num_stages=4), dict(num_stages=5), dict(block_down=32), dict(block_down=64),
                dict(block_down=128), dict(block_down=256), dict(block_k_down=64), dict(block_k_down=256),
                dict(block_k_down=512), dict(num_warps_down=2), dict(num_warps_down=8), dict(num_stages_down=2),
                dict(num_stages_down=4), dict(num_stages_down=5)]
    if ARGS.moe_variants:
        variants = [dict()] + json.loads(ARGS.moe_variants)
    for n in (ARGS.moe_tokens or ((1, 4, 8, 32, 128, 512) if not sm else (1, 13))):
        x, w, experts = moe_inputs(n, e, kk, h)
        nbytes = len(np.unique(np.asarray(experts))) * per_expert + 2 * n * h * x.dtype.itemsize
        base = moe_plan_kw(n * kk, e, h, i)
        for kw in variants:
            if out_of_time("moe_sweep"):
                return
            if kw and all(base.get(k) == v for k, v in kw.items()):  # the plan itself
                continue
            if (kw.get("layout") == "pairs" and n > 32) or (sm and kw and "layout" not in kw):
                continue
            fn = functools.partial(moe_experts_triton, **kw, **impl_kw())
            sec = guarded(f"moe_sweep {kw}", time_jax, fn, x, w, experts, gate_up, down, chain=chain_moe)
            if sec:
                record("sweep_moe", dict(tokens=n), "_".join(f"{k}{v}" for k, v in kw.items()) or "plan", sec,
                       nbytes)


def section_sweep_final():
    """A few tile choices around the defaults, after the defaults were set from :func:`section_sweep`."""
    sm = ARGS.smoke
    hk, d = (2, 16) if sm else (16, 128)
    for b, t, hv in ([(64, 1, 32), (64, 5, 48)] if not sm else [(2, 3, 4)]):
        q, k, v, g, beta, s0 = gdn_inputs(jax.random.key(21), b, t, hk, hv, d)
        for bv, nw in ((8, 1), (16, 2), (32, 4), (64, 4)):
            if out_of_time("sweep_final"):
                return
            if bv > d:
                continue
            fn = functools.partial(fused_recurrent_gated_delta_rule_triton, use_qk_l2norm_in_kernel=True,
                                   output_step_states=t > 1, block_v=bv, num_warps=nw, **impl_kw())
            sec = guarded("sweep_final recurrent", time_jax, lambda *a, fn=fn: fn(*a[:5], initial_state=a[5]),
                          q, k, v, g, beta, s0, chain=chain_v)
            if sec:
                record("sweep_gdn_recurrent", dict(b=b, t=t, hv=hv), f"bv{bv}_w{nw}", sec,
                       gdn_bytes(b, t, hk, hv, d, t > 1))
    dd, s = (32, 128) if sm else (256, 32768)
    for b, t, hq in ([(1, 1, 16), (1, 5, 24)] if not sm else [(1, 1, 4)]):
        pos = np.broadcast_to(s - t + np.arange(t), (b, t))
        args = attn_inputs(jax.random.key(22), b, t, hq, 2, dd, s, pos)
        for bs, nw, ns in ((64, 4, 3), (32, 4, 3), (64, 8, 3), (64, 4, 2)):
            if out_of_time("sweep_final"):
                return
            fn = functools.partial(cached_attention_triton, block_kv=bs, num_warps=nw, num_stages=ns, **impl_kw())
            sec = guarded("sweep_final attention", time_jax, fn, *args, chain=chain_first)
            if sec:
                record("sweep_attention", dict(b=b, t=t, hq=hq, ctx=s), f"bs{bs}_w{nw}_s{ns}_plan", sec,
                       attn_bytes(b, t, hq, 2, dd, s))


def section_row_copy():
    """The prefix cache's copies (jaxmtp.engine.prefix_cache.save / restore) at Qwen3.5-4B shapes, 32 slots of 8k:
    a block is 256 rows of every attention layer's keys and values (target and MTP), a snapshot every GDN layer's
    state and conv ring. Row-copy kernel (one launch per array shape, in place) against XLA (gather + scatter for
    the save, a loop of dynamic updates for the restore); bytes: each copied byte read once and written once."""
    from jaxmtp import shapes
    from jaxmtp.engine import prefix_cache, steps

    slots, ctx, g = (32, 8192, 256) if not ARGS.smoke else (4, 512, 64)
    cfg = shapes.config("qwen3.5-4b") if not ARGS.smoke else shapes.config(
        "qwen3.5-0.8b", num_hidden_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
        moe_layers=(False,) * 4)
    state = steps.init_state(cfg, slots, ctx, 3, jnp.bfloat16)
    state = state.replace(carry=jax.tree.map(lambda a: jnp.ones_like(a) * 0.5, state.carry))
    cap_b, cap_s = (32, 8) if not ARGS.smoke else (8, 4)  # a publication batch's rows (the engine's at 8 prefill rows)
    n_blocks, n_snaps = 2 * cap_b, 2 * cap_s
    block_b, snap_b = prefix_cache.pool_bytes_per_entry(state, g)
    rng = np.random.default_rng(0)
    impls = {"triton": "triton_interpret" if ARGS.smoke else "triton", "xla": "xla"}
    for nb, ns in ((32, 0), (8, 8)) if not ARGS.smoke else ((4, 0), (2, 2)):
        blocks = np.stack([rng.integers(0, slots, cap_b), g * rng.integers(0, ctx // g, cap_b),
                           rng.permutation(n_blocks)[:cap_b]], 1).astype(np.int32)
        snaps = np.stack([rng.integers(0, slots, cap_s), rng.permutation(n_snaps)[:cap_s]], 1).astype(np.int32)
        nbytes = 2 * (nb * block_b + ns * snap_b)
        for name, impl in impls.items():
            def save(pool, st, impl=impl, nb=nb, ns=ns):
                return prefix_cache.save(pool, st, blocks, np.int32(nb), snaps if ns else None,
                                         np.int32(ns) if ns else None, copy=impl)
            pool = prefix_cache.init_pool(state, g, n_blocks, n_snaps)
            t = time_jax(save, pool, state, chain=chain_first, reps=8)
            record("prefix_save", {"blocks": nb, "snapshots": ns}, name, t, nbytes)
    hit = min(ctx // g - 1, 31)
    for name, impl in impls.items():
        pool = prefix_cache.init_pool(state, g, n_blocks, n_snaps)
        ids = np.zeros((ctx // g,), np.int32)
        ids[:hit] = rng.permutation(n_blocks)[:hit]

        def restore(st, pool, impl=impl):
            return prefix_cache.restore(st, pool, np.int32(3), jnp.asarray(ids), np.int32(hit), np.int32(5), copy=impl)

        t = time_jax(restore, state, pool, chain=chain_first, reps=8)
        record("prefix_restore", {"blocks": hit, "snapshots": 1}, name, t, 2 * (hit * block_b + snap_b))


SECTIONS = {
    "ceilings": section_ceilings, "check": section_check, "fla_check": section_fla_check,
    "recurrent": section_recurrent, "commit": section_commit, "chunk": section_chunk,
    "attention": section_attention, "moe": section_moe, "matmul": section_matmul,
    "sweep": section_sweep, "sweep_final": section_sweep_final, "moe_sweep": section_moe_sweep,
    "mixer": section_mixer, "fp8": section_fp8, "row_copy": section_row_copy,
}


def print_table():
    print("\n== checks ==")
    for c in RESULTS["checks"]:
        print(f"{'PASS' if c['pass'] else 'FAIL'} {c['check']}: rel_err {c['rel_err']:.2e} (tol {c['tol']})")
    print("\n== timings (us; GB/s and % of the measured copy bandwidth; TFLOP/s and % of the bf16 matmul) ==")
    print(f"copy {RESULTS.get('copy_GBps', 0):.0f} GB/s, matmul {RESULTS.get('matmul_TFLOPs', 0):.0f} TFLOP/s")
    for r in RESULTS["rows"]:
        shape = ",".join(f"{k}{v}" for k, v in r["shape"].items())
        extra = ""
        if "GB/s" in r:
            extra += f" {r['GB/s']:7.0f} GB/s {r.get('%bw', 0):5.1f}%"
        if "TFLOP/s" in r:
            extra += f" {r['TFLOP/s']:6.1f} TF/s {r.get('%mm', 0):5.1f}%"
        if "x_bf16" in r:
            extra += f" {r['x_bf16']:5.2f}x bf16"
        print(f"{r['op']:<22} {shape:<34} {r['impl']:<22} {r['us']:10.1f} us{extra}")
    if RESULTS["errors"]:
        print("\n== errors ==")
        for e in RESULTS["errors"]:
            print(e[:300])


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_kernels.json")
    p.add_argument("--sections", default="ceilings,check,recurrent,chunk,attention,moe,matmul")
    p.add_argument("--max-seconds", type=float, default=540.0)
    p.add_argument("--timer", choices=("wall", "trace"), default="wall",
                   help="wall: difference of two chained loops' wall times; trace: device kernel time from a "
                        "profiler trace (jaxmtp.benchmarking.device_seconds), steadier for ops of a few microseconds")
    p.add_argument("--moe-tokens", type=lambda v: tuple(int(t) for t in v.split(",")), default=None,
                   help="token counts of the moe_sweep section (default 1,4,8,32,128,512)")
    p.add_argument("--moe-variants", default=None,
                   help='moe_sweep: a JSON list of keyword sets to time instead of the single changes, e.g. '
                        '\'[{"block_k": 64, "num_stages": 2}]\' (the plan is always timed first)')
    p.add_argument("--mixer-variants", default=None,
                   help='mixer section: a JSON list of gdn_mixer_triton keyword sets, e.g. \'[{"num_warps": 2}]\'')
    p.add_argument("--attention-parts", default="decode,prefill,splits",
                   help="attention section parts: decode (the plan at decode/verify shapes), prefill (tile variants), "
                        "splits (decode split counts, fused layer and cached_attention_triton)")
    p.add_argument("--attention-variants", default=None,
                   help="attention prefill tiles to time after the plan, ';'-separated bm,bs,warps,stages[,splits], "
                        "e.g. '128,64,8,2;128,32,8,3'")
    p.add_argument("--attention-splits", default=None,
                   help="attention decode settings to time after the plan, ';'-separated splits[,bs,warps,stages], "
                        "e.g. '32;64;128;64,128,4,2'")
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode, no torch/FLA (CPU)")
    p.add_argument("--no-fla", action="store_true", help="no torch / FLA (FLA's fused_recurrent crashed at B >= 8)")
    p.add_argument("--chunk-pallas-only", action="store_true",
                   help="no XLA reference in the chunk section (FLA: see --no-fla)")
    p.add_argument("--chunk-shapes", type=lambda v: [tuple(int(x) for x in e.split(":")) for e in v.split(",")],
                   default="1:4096:32,1:16384:32,1:4096:48,1:16384:48,4:4096:32,4:4096:48,1:1024:48",
                   help="chunk section shapes B:T:Hv")
    p.add_argument("--chunk-variants", default="auto",
                   help="chunk kernel tiles, ';'-separated: auto (the policy's), f,bv,warps,stages (fused read-out) or "
                        "s,bv,warps,stages,out_bv,out_warps (separate read-out), then any field=value of ChunkTiles")
    ARGS = p.parse_args()
    sections = [s for s in ARGS.sections.split(",") if s]
    if ARGS.smoke:
        sections = [s for s in sections if s != "fla_check"]
    RESULTS["env"] = {
        "date": datetime.date.today().isoformat(), "jax": jax.__version__, "device": str(jax.devices()[0]),
        "device_kind": jax.devices()[0].device_kind, "command": " ".join(sys.argv), "reps": REPS, "iters": ITERS,
    }
    for mod in ("jaxlib", "triton", "torch", "fla"):
        try:
            RESULTS["env"][mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    print(json.dumps(RESULTS["env"]), flush=True)
    for s in sections:
        if out_of_time(s):
            continue
        t0 = time.time()
        guarded(s, SECTIONS[s])
        RESULTS.setdefault("section_seconds", {})[s] = time.time() - t0
        with open(ARGS.out, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    print_table()


if __name__ == "__main__":
    main()
