#!/usr/bin/env python
"""The verify forward against plain decode steps at a released shape, on the device (the GPU kernels' arithmetic):
random bf16 weights of a Qwen3.5 shape, a random prompt prefilled, then for several random windows of T tokens the
target's logits from one verify forward (``step_states=True``, the k = T-1 step's path) and from T one-token decode
steps (the plain step's path), and the GDN states that committing each prefix n = 1..T leaves against the plain
steps' states after n tokens.

It measures what ``check_spec_exact.py`` cannot with random weights (whose top logits nearly tie, so that the two
paths' different summation orders flip greedy choices): how far the two paths' logits are apart, whether they pick
the same token wherever the plain step's top two logits are more than ``--margin`` apart, and how far the committed
states are from the stepped ones. Run two engine versions to check a change to either path for regressions.

    python scripts/check_verify_logits.py --model qwen3.5-0.8b --t 4 --windows 8 --out verify_logits.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_decode import random_model, tiny_config  # noqa: E402
from jaxmtp import shapes  # noqa: E402
from jaxmtp.layers.gated_deltanet import GDNCarry, select_steps  # noqa: E402
from jaxmtp.model import forward, init_carry  # noqa: E402


def compare(model, t: int, windows: int, prompt_len: int, margin: float, seed: int = 0) -> dict:
    """The statistics described in the module doc, over ``windows`` random windows after one random prompt."""
    cfg, params, backend = model.config, model.params, model.backend
    fwd = jax.jit(functools.partial(forward, cfg=cfg, backend=backend), static_argnames="step_states")
    commit = jax.jit(lambda steps, n: select_steps(steps, n, backend.gdn_recurrent))
    rng = np.random.default_rng(seed)
    ids = lambda n: jnp.asarray(rng.integers(0, cfg.vocab_size, (1, n)), jnp.int32)  # noqa: E731
    _, _, carry = fwd(params, ids(prompt_len), jnp.arange(prompt_len, dtype=jnp.int32)[None],
                      init_carry(cfg, 1, prompt_len + t + 8, model.dtype))
    pos = prompt_len + jnp.arange(t, dtype=jnp.int32)[None]
    diffs, scales, agree, decided, flips, state_err = [], [], 0, 0, [], 0.0
    for _ in range(windows):
        toks = ids(t)
        verify, _, steps = fwd(params, toks, pos, carry, step_states=True)
        c, plain, plain_states = carry, [], []
        for i in range(t):
            logits, _, c = fwd(params, toks[:, i : i + 1], pos[:, i : i + 1], c)
            plain.append(np.asarray(logits[0, 0], np.float64))
            plain_states.append([np.asarray(x.state, np.float64) for x in c if isinstance(x, GDNCarry)])
        verify = np.asarray(verify[0], np.float64)
        for i in range(t):
            diffs.append(float(np.abs(verify[i] - plain[i]).max()))
            scales.append(float(plain[i].std()))
            top2 = np.sort(plain[i])[-2:]
            same = int(np.argmax(verify[i])) == int(np.argmax(plain[i]))
            if top2[1] - top2[0] > margin:
                decided += 1
                agree += same
            elif not same:
                flips.append(float(top2[1] - top2[0]))
        for n in range(1, t + 1):
            got = [np.asarray(x.state, np.float64) for x in commit(steps, jnp.asarray([n], jnp.int32))
                   if isinstance(x, GDNCarry)]
            for g, w in zip(got, plain_states[n - 1]):
                state_err = max(state_err, float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)))
    return {"logit_max_abs_diff": max(diffs), "logit_median_max_abs_diff": float(np.median(diffs)),
            "logit_std": float(np.median(scales)), "decided_positions": decided, "decided_agree": agree,
            "undecided_flips_top2_gaps": flips, "committed_state_max_rel_diff": state_err}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-0.8b")
    ap.add_argument("--t", type=int, default=4, help="window length (k + 1)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--margin", type=float, default=0.05, help="top-2 logit gap above which a choice counts as decided")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tiny", action="store_true", help="a small model of the same layout (CPU smoke test)")
    ap.add_argument("--out", default="verify_logits.json")
    args = ap.parse_args()
    if args.t < 2:
        ap.error("--t must be at least 2 (a verify window)")
    cfg = shapes.config(args.model)
    if args.tiny:
        cfg = tiny_config(cfg)
    model = random_model(cfg, jnp.bfloat16, args.backend)
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
           "command": " ".join(sys.argv), "model": args.model, "t": args.t, "backend": str(model.backend),
           **compare(model, args.t, args.windows, args.prompt_len, args.margin)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "command"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
