"""Step times of whichever jaxmtp tree is on PYTHONPATH: an older commit against this one, across processes.

    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/old python scripts/bench_tree_ab.py --tag old1 --out old1.json
    PYTHONPATH=.        python scripts/bench_tree_ab.py --tag new1 --out new1.json   # then new2, old2: alternate

Random bf16 weights of released shapes in the serving layout, one busy slot at ``--context`` (a synthetic state),
the plain and k = 3 device loops timed in alternating rounds within the process. It uses only APIs that both trees
have (the slot admission with and without the logits-processing fields), so it runs on older commits unchanged. ``AB_CACHE``: the compilation cache directory (one per tree, so that a
tree never loads the other's executables).
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_compilation_cache_dir", os.environ.get("AB_CACHE", "/tmp/ab_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from jaxmtp import shapes  # noqa: E402
from jaxmtp.engine import Engine  # noqa: E402
from jaxmtp.model import init_params  # noqa: E402
from jaxmtp.pallas import resolve_backend  # noqa: E402
from jaxmtp.param_layout import serving_layout  # noqa: E402

try:
    from jaxmtp.loaded_model import Model
except ImportError:
    from jaxmtp.loading import Model


def engine(model, k, context, room, steps):
    eng = Engine(model, num_slots=1, max_context=context + room, num_draft_tokens=k, steps_per_sync=steps,
                 check_memory=False)
    s, vocab = 1, model.config.vocab_size
    rng = np.random.default_rng(k)
    ids = jnp.arange(s, dtype=jnp.int32)
    zi, zf = jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.float32)
    args = (eng.state, ids, zi + 10**9, zf, zi, zf + 1, zi.astype(jnp.uint32), zi.astype(jnp.uint32),
            jnp.full((s, eng.state.stop_ids.shape[1]), -1, jnp.int32))
    try:  # trees with the logits processing take its settings too
        from jaxmtp.engine.steps import neutral_processing
        st = eng._admit(*args, {n: jnp.asarray(v) for n, v in neutral_processing(s).items()})
    except ImportError:
        st = eng._admit(*args)
    eng.state = st.replace(length=jnp.full((s,), context, jnp.int32),
                           last=jnp.asarray(rng.integers(0, vocab, s), jnp.int32),
                           drafts=jnp.asarray(rng.integers(0, vocab, (s, k)), jnp.int32),
                           generated=jnp.ones((s,), jnp.int32), active=jnp.ones((s,), bool))
    return eng


def loop_ms(eng, params, syncs):
    ts = []
    for _ in range(syncs):
        t0 = time.perf_counter()
        eng.state, out = eng.device_loop()(params, eng.state)
        jax.device_get(out)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / eng.steps_per_sync * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3.5-0.8b,qwen3.5-4b")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tag", default="tree")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    res = {"tag": a.tag, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "models": {}}
    for name in a.models.split(","):
        cfg = shapes.config(name)
        if a.tiny:
            import dataclasses
            cfg = dataclasses.replace(cfg, hidden_size=64, vocab_size=512, intermediate_size=128, num_hidden_layers=4,
                                      layer_types=cfg.layer_types[:4], moe_layers=cfg.moe_layers[:4], head_dim=32,
                                      linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                      linear_num_value_heads=2 * cfg.gdn_v_per_k, num_attention_heads=4,
                                      num_key_value_heads=2)
        dtype = jnp.bfloat16
        backend = resolve_backend("auto", cfg, dtype)
        params = serving_layout(init_params(cfg, jax.random.PRNGKey(0), dtype), backend=backend)
        jax.block_until_ready(params)
        model = Model(config=cfg, params=params, tokenizer=None, dtype=dtype, backend=backend)
        room = a.steps * (a.rounds * a.syncs + 2) * 4 + 16
        t0 = time.perf_counter()
        engines = [engine(model, k, a.context, room, a.steps) for k in (0, 3)]
        for e in engines:
            loop_ms(e, params, 1)
        compile_s = time.perf_counter() - t0
        rounds = [[], []]
        for _ in range(a.rounds):
            for i, e in enumerate(engines):
                rounds[i].append(loop_ms(e, params, a.syncs))
        res["models"][name] = {"plain_round_ms": rounds[0], "k3_round_ms": rounds[1],
                               "plain_ms": float(np.median(rounds[0])), "k3_ms": float(np.median(rounds[1])),
                               "ratio": float(np.median([b / p for p, b in zip(*rounds)])), "compile_s": compile_s,
                               "backend": str(backend)}
        print(a.tag, name, json.dumps({k: v for k, v in res["models"][name].items() if "round" not in k}), flush=True)
        del engines, model, params
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
