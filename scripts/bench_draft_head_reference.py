#!/usr/bin/env python
"""The draft head's product without a kernel (the XLA reference, what a CPU or TPU runs): int8 against int4 rows.

    python scripts/bench_draft_head_reference.py --out draft_head_reference.json

Times ``quantized_linear(..., implementation="xla")`` for the shipped default model's head (tied embedding,
quantised as ``jaxmtp.load`` does) at 1, 8 and 32 rows: mean of 200 calls after a warm-up. The int4 reference unpacks
the head on every call, int8's converts it, so where no kernel reads int4 the default stays int8
(``jaxmtp.param_layout.default_draft_head_bits``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxmtp  # noqa: E402
from jaxmtp.pallas.matmul import quantized_linear  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="draft_head_reference.json")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    heads = {bits: jaxmtp.load(None, dtype="float32", progress=False, draft_head_bits=bits).params["draft_head"]
             for bits in (8, 4)}
    hidden = heads[8]["weight"].shape[1]
    f = jax.jit(lambda x, q, s: quantized_linear(x, q, s, implementation="xla"))
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
           "command": " ".join(["scripts/bench_draft_head_reference.py"] + sys.argv[1:]), "rows": {}}
    for m in (1, 8, 32):
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, hidden)), jnp.float32)
        res = {}
        for bits, dh in heads.items():
            f(x, dh["weight"], dh["scale"]).block_until_ready()
            t = time.perf_counter()
            for _ in range(args.calls):
                y = f(x, dh["weight"], dh["scale"])
            y.block_until_ready()
            res[f"int{bits}_us"] = (time.perf_counter() - t) / args.calls * 1e6
        out["rows"][m] = res
        print(m, "rows", {k: round(v, 1) for k, v in res.items()}, flush=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
