"""Bit equality on a CPU whose codegen does not depend on shapes (tests/test_parallel.py and tests/test_fp8.py run
this in a subprocess).

XLA's CPU backend is started here with :data:`jaxmtp.pallas.collectives.SHAPE_STABLE_CPU_XLA_FLAGS`, under which an
op's bits do not depend on the sizes of its other axes (how many heads a rank holds, how many projections a fused
product holds), so two computations of the same numbers must give the same bits. Prints a JSON object: for each
comparison, the list of what differed (empty when bit-identical).

    python tests/bitwise_worker.py layouts CHECKPOINT K LAYOUTS PROMPTS_JSON   (LAYOUTS: e.g. 1x2,1x4,1x8,2x2)
        the fixed reduction mode at each layout ("DPxTP") against TP 1
    python tests/bitwise_worker.py twin FP8_CHECKPOINT TWIN_CHECKPOINT IDS_JSON
        a block-FP8 model against its dequantised twin (logits and drafts, float32)
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jaxmtp.pallas.collectives import SHAPE_STABLE_CPU_XLA_FLAGS  # noqa: E402  (starts no backend)

# 8 devices for the layouts; the twins on one: with 4 or more forced host devices, even under the flags, XLA's CPU
# product of a [22, 160] by a [160, 1000] differs from its two 500-column halves, where on one device it does not
# (measured; the products of the layouts' models, hidden 48, are below whatever changes)
DEVICES = 8 if sys.argv[1] == "layouts" else 1
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES} {SHAPE_STABLE_CPU_XLA_FLAGS}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_parallel import _one_device_carry, _params, _state_by_request  # noqa: E402

import jaxmtp  # noqa: E402
from jaxmtp.engine import Engine  # noqa: E402


def run(model, prompts, k):
    """Every prompt through one engine, one device step per host read. Returns the tokens and log-probabilities of
    each request, the drafts it held after each step while active (keyed by its emitted count), and the state."""
    eng = Engine(model, num_slots=4, max_context=64, num_draft_tokens=k, steps_per_sync=1, prefill_chunk=16)
    ids = [eng.add_request(p, prm) for p, prm in zip(prompts, _params(len(prompts)))]
    reqs = [eng._by_id[i] for i in ids]
    tokens = {i: [] for i in ids}
    logprobs = {i: [] for i in ids}
    drafts = {i: {} for i in ids}
    while eng.has_work():
        for o in eng.step():
            tokens[o.request_id] += o.token_ids
            logprobs[o.request_id] += [(lp.token_id, lp.logprob, list(lp.top)) for lp in o.logprobs or []]
        if k:  # the drafts a slot still decoding will verify next (a finished slot's are never read)
            held, active = (np.asarray(a) for a in jax.device_get((eng.state.drafts, eng.state.active)))
            for i, r in zip(ids, reqs):
                if r.slot >= 0 and active[r.slot] and tokens[i]:
                    drafts[i][len(tokens[i])] = held[r.slot, :k].tolist()
    return ([tokens[i] for i in ids], [logprobs[i] for i in ids], [drafts[i] for i in ids],
            _state_by_request(eng, reqs))


def differences(got, want, model):
    (tok, lps, drafts, state), (tok1, lps1, drafts1, ref) = got, want
    bad = [what for what, a, b in (("tokens", tok, tok1), ("logprobs", lps, lps1), ("drafts", drafts, drafts1))
           if a != b]
    for name in ("carry", "mtp_carry"):
        ours = _one_device_carry(getattr(state, name), model.config, model.layout.tp)
        theirs = [(c.conv, c.state) if hasattr(c, "conv") else (c.k, c.v) for c in getattr(ref, name)]
        for i, (a, b) in enumerate(zip(ours, theirs)):
            bad += [f"{name}[{i}][{j}] by {float(np.abs(x - y).max()):.3g}" for j, (x, y) in enumerate(zip(a, b))
                    if not np.array_equal(x, y)]
    if not np.array_equal(state.length, ref.length):
        bad.append("length")
    return bad


FORWARDS = ("logits", "drafts", "exact drafts")


def forwards(model, ids):
    """:data:`FORWARDS` over one window: target logits, drafts from the int8 draft head and from the exact head."""
    return [np.asarray(x) for x in (model.logits(ids), model.draft_logits(ids),
                                    model.draft_logits(ids, exact_head=True))]


def forward_differences(got, want) -> list[str]:
    """The :data:`FORWARDS` whose bits differ between two :func:`forwards` results."""
    return [what for what, a, b in zip(FORWARDS, got, want) if not np.array_equal(a, b)]


def compare_layouts(path, k, layouts, prompts) -> dict:
    load = lambda dp, tp: jaxmtp.load(path, backend="xla", progress=False, tensor_parallel_size=tp,  # noqa: E731
                                      data_parallel_size=dp, tensor_parallel_reduce="fixed")
    one = load(1, 1)
    window = np.asarray([p[:8] for p in prompts[:2]])
    want, want_fwd = run(one, prompts, k), forwards(one, window)
    assert all(want[2]) or not k, "a request held no drafts while active"
    out = {}
    for layout in layouts:
        dp, tp = map(int, layout.split("x"))
        model = load(dp, tp)
        bad = differences(run(model, prompts, k), want, model)
        out[layout] = bad + forward_differences(forwards(model, window), want_fwd)
    return out


def compare_twin(fp8_path, twin_path, ids) -> dict:
    fp8, twin = (jaxmtp.load(p, dtype="float32", backend="xla", progress=False) for p in (fp8_path, twin_path))
    ids = np.asarray(ids)
    return {"fp8 vs twin": forward_differences(forwards(fp8, ids), forwards(twin, ids))}


def main():
    if sys.argv[1] == "layouts":
        out = compare_layouts(sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","), json.loads(sys.argv[5]))
    else:
        out = compare_twin(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
