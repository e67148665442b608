#!/usr/bin/env python
"""Server start-up (``--serve``): time to SERVING on a first and a second start; or an engine's warm-up time against
the number of compile threads, and the step time after it.

    python scripts/bench_warmup.py --serve --out docs/results/warmup_serve_cpu.json     # the default model's server
    python scripts/bench_warmup.py --serve --serve-args "--random-model qwen3.5-0.8b --slots 32" --out x.json

``--serve`` starts ``python -m jaxmtp.serve --port 0`` twice with one fresh compilation cache directory (the first
start compiles, the second loads from the cache) and records for each: seconds from the process start to SERVING,
the warm-up's executables and their compile times (GetModelInfo), one request's latency right after SERVING, and
when the background compiles were done. The machine's load average is recorded too: other work on the cores slows
the compiles.

    python scripts/bench_warmup.py --model qwen3.5-4b --slots 8 --k 3 --threads 1 --out warmup.json

Builds a random bf16 model of a released shape and an engine (slot buckets on: every width's greedy and sampling
loops, every prefill bucket), times ``Engine.warmup(compile_threads=...)``, then fills every slot with a synthetic
request (``jaxmtp.benchmarking.fill_synthetic``) and times the full-width step loop, so that a warm-up whose parallel
compiles autotuned worse kernels would show. Run each thread count in its own process (compiled executables are
cached per process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import shapes
from jaxmtp.benchmarking import fill_synthetic, random_model, timed_loops, tiny_config
from jaxmtp.engine import Engine


def _start_server(cmd: list[str], timeout: float, background_wait: float = float("inf")) -> dict:
    """One server start: seconds to listening and to SERVING, the warm-up (GetModelInfo), a first request, the
    background compiles' end (waited for at most ``background_wait`` seconds after the request); then SIGTERM."""
    import signal
    import subprocess

    from jaxmtp.serving.client import Client

    import tempfile

    t0 = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: progress lines must never block the server
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        if "listening on" not in line:
            proc.wait(timeout=30)
            log.seek(0)
            raise RuntimeError(f"the server did not start: {line!r}\n{log.read()[-4000:]}")
        listening = time.perf_counter() - t0
        address = line.split()[-1]
        with Client(address, timeout=timeout) as c:
            try:
                c.wait_ready(timeout=timeout, poll_seconds=0.1, on_progress=lambda info: None)
            except Exception as e:  # noqa: BLE001 - the server's own log says why (it may have exited)
                log.seek(0)
                raise RuntimeError(f"the server was not SERVING ({e}); exit code {proc.poll()}; its log ends:\n"
                                   f"{log.read()[-4000:]}") from None
            serving = time.perf_counter() - t0
            info = c.model_info()
            t = time.perf_counter()
            prompt = "def fibonacci(n):" if info["has_tokenizer"] else [1, 2, 3]
            out = c.generate(prompt, max_tokens=32, ignore_eos=True)
            request = time.perf_counter() - t
            background, late = None, info
            while time.perf_counter() - t0 < min(timeout, serving + request + background_wait):
                late = c.model_info()
                if late["executables_compiled"] >= late["executables_total"]:
                    background = time.perf_counter() - t0
                    break
                time.sleep(0.5)
        log.seek(0)
        lines = [x for x in log.read().splitlines() if " INFO " in x]  # the memory plan's lines, then the last
        return {"server_log": [x for x in lines if "memory" in x] + lines[-20:], "listening_s": listening, "serving_s": serving, "warmup_s": info["warmup_s"],
                "executables_before_serving": info["warmup_done"], "executables_total": info["executables_total"],
                "warmup_executables": [x for x in info["executables"] if x["phase"] == "warmup"],
                "first_request_s": request, "first_request_tokens": out.completion_tokens,
                "first_request_ttft_s": out.time_to_first_token, "all_compiled_s": background,
                "executables": late["executables"], "compile_cache_dir": info["compile_cache_dir"],
                "backend": info["backend"]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_main(args) -> int:
    import shlex
    import tempfile

    cache = args.cache_dir or tempfile.mkdtemp(prefix="jaxmtp-xla-")
    cmd = [sys.executable, "-m", "jaxmtp.serve", "--port", "0", "--compile-cache-dir", cache]
    cmd += shlex.split(args.serve_args)
    runs = {}
    for name in ("first", "second")[:args.starts]:
        load = os.getloadavg()
        runs[name] = {**_start_server(cmd, args.timeout, args.background_wait), "load_average_before": load,
                      "load_average_after": os.getloadavg()}
        r = runs[name]
        print(f"{name} start: SERVING after {r['serving_s']:.1f} s ({r['executables_before_serving']} of "
              f"{r['executables_total']} executables, warm-up {r['warmup_s']:.1f} s), first request "
              f"{r['first_request_s']:.2f} s, all compiled after {r['all_compiled_s']} s, load {load[0]:.1f}",
              flush=True)
    res = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "cpu_count": os.cpu_count(),
           "command": " ".join(sys.argv), "server_command": " ".join(cmd), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "runs": runs}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help="time python -m jaxmtp.serve starts (first, cached)")
    ap.add_argument("--serve-args", default="", help="--serve: extra server flags")
    ap.add_argument("--cache-dir", default=None, help="--serve: the compilation cache (default: a fresh one)")
    ap.add_argument("--starts", type=int, default=2, choices=(1, 2), help="--serve: a first start only, or also a "
                    "second (cached)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="--serve: seconds per start")
    ap.add_argument("--background-wait", type=float, default=float("inf"),
                    help="--serve: seconds to wait for the background compiles after the first request")
    ap.add_argument("--model", default="qwen3.5-4b")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="Engine.warmup(compile_threads=)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--syncs", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="a small shape (CPU smoke test of the script)")
    ap.add_argument("--out", default="warmup.json")
    args = ap.parse_args(argv)
    if args.serve:
        return serve_main(args)
    from jaxmtp.compile_cache import enable_compile_cache

    enable_compile_cache(enabled=False)  # this mode times compiles: none may come from the cache
    model = random_model(tiny_config(args.model) if args.tiny else shapes.config(args.model), jnp.bfloat16, "auto")
    steps = 8
    eng = Engine(model, num_slots=args.slots, max_context=args.context + steps * (args.syncs + 2) * (args.k + 1) + 16,
                 num_draft_tokens=args.k, steps_per_sync=steps, check_memory=False)
    warm_s = eng.warmup(compile_threads=args.threads)
    fill_synthetic(eng, args.context, 7)
    times = [dt for dt, _ in timed_loops(eng, model.params, args.syncs)]
    dev = jax.devices()[0]
    res = {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__, "command": " ".join(sys.argv), "model": args.model, "slots": args.slots,
           "k": args.k, "threads": args.threads, "loops": len(eng._loops), "warmup_s": warm_s,
           "step_ms": float(np.median(times[1:])) / steps * 1e3, "cpu_count": os.cpu_count()}
    print(json.dumps(res), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
