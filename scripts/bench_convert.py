#!/usr/bin/env python
"""Time and peak memory of converting an HF checkpoint with the shapes of a released model (random bf16 weights).

    python scripts/bench_convert.py [--shape qwen3.5-0.8b] [--workdir DIR] [--out R.json]

Writes a random checkpoint in the HF layout (``model.safetensors`` or shards, bf16, with ``mtp.*``), then runs
``scripts/convert_hf.py`` on it in a fresh process and reports that process's wall time and peak resident memory
(``ru_maxrss`` of the child), plus the sizes on disk. The conversion reads tensor by tensor from memory-mapped
files, so its peak is about the converted model plus one tensor, not the checkpoint twice.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-0.8b")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default="bench_convert.json")
    args = ap.parse_args(argv)

    import jax

    from jaxmtp import shapes
    from jaxmtp.hf_export import save_hf_checkpoint
    from jaxmtp.model import init_params, param_count

    work = args.workdir or tempfile.mkdtemp(prefix="jaxmtp_convert_")
    src, dst = os.path.join(work, "hf"), os.path.join(work, "native")
    cfg = shapes.config(args.shape)
    t0 = time.perf_counter()
    params = init_params(cfg, jax.random.PRNGKey(0), "bfloat16")
    n_params = param_count(params)
    save_hf_checkpoint(params, cfg, src, dtype="bfloat16")
    del params
    t_write = time.perf_counter() - t0

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "convert_hf.py")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, script, src, dst, "--dtype", "bfloat16"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        return proc.returncode
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(), "jax": jax.__version__, "shape": args.shape, "params": n_params,
        "hf_checkpoint_bytes": du(src), "native_checkpoint_bytes": du(dst), "write_random_checkpoint_s": t_write,
        "convert_wall_s": wall, "convert_peak_rss_bytes": peak_kib * 1024,
        "converter_report": json.loads(proc.stdout.strip().splitlines()[-1]),
        "command": f"python scripts/convert_hf.py {src} {dst} --dtype bfloat16",
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
