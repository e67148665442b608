"""The ahead-of-time executable store (jaxmtp.engine.aot): an engine whose step loops and prefills were stored by an
earlier engine of the same configuration loads them without tracing, and decodes the tokens of a fresh compile; a
changed configuration or argument layout misses; a damaged file is dropped and the function compiled."""

import collections
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmtp
import jaxmtp.compile_cache
from jaxmtp.engine import Engine, aot
from jaxmtp.sampling import SamplingParams

pytestmark = pytest.mark.executable_store
# a configuration of this module's own (steps_per_sync 5), so no other test's compile is in the persistent cache
KW = dict(num_slots=2, max_context=96, num_draft_tokens=2, prefill_chunk=32, steps_per_sync=5, max_prefill_batch=2)


@pytest.fixture(scope="module", autouse=True)
def _no_persistent_cache():
    """JAX's persistent cache off in this module: on the CPU an executable it supplies is not stored (aot module
    doc), and every test here starts from an empty store."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    jaxmtp.compile_cache.enable_compile_cache()  # what jaxmtp.load would do, so that it changes nothing later
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", old)
    cc.reset_cache()


@pytest.fixture
def store(tmp_path, monkeypatch):
    s = aot.Store(str(tmp_path / "aot"))
    monkeypatch.setattr(aot, "default_store", lambda: s)
    return s


def _decode(eng, prompts):
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=t, seed=3) for t in (0.0, 0.9)]
    rids = [eng.add_request(p, params[i % 2]) for i, p in enumerate(prompts)]
    toks = collections.defaultdict(list)
    while eng.has_work():
        for o in eng.step():
            toks[o.request_id] += o.token_ids
    return [toks[r] for r in rids]


def _loop_and_prefill_traces(eng):
    return {k: v for k, v in eng.trace_counts.items() if k.startswith(("step", "prefill"))}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_second_engine_loads_the_stored_executables_and_decodes_the_same_tokens(ckpt, store, tp, rng):
    """The first engine traces and compiles each warmed executable and stores it; a second engine of the same
    configuration (a new model object, as a new process would have) loads every one without tracing, and both give
    the tokens of an engine that never used the store (greedy and seeded sampling; one device and TP 2)."""
    if len(jax.devices()) < tp:
        pytest.skip("needs more devices")
    load = lambda: jaxmtp.load(ckpt, dtype="float32", progress=False, tensor_parallel_size=tp)  # noqa: E731
    prompts = [rng.integers(3, 100, n).tolist() for n in (7, 40, 19)]
    want = _decode(Engine(load(), **KW), prompts)  # compiled at its calls: no store involved
    assert not os.path.isdir(store.directory)

    first = Engine(load(), **KW)
    first.warmup()
    warmed = first.warmup_status()["executables"]
    assert warmed and not any(x["stored"] for x in warmed)
    assert len(os.listdir(store.directory)) == len(warmed)
    assert _decode(first, prompts) == want

    second = Engine(load(), **KW)
    second.warmup()
    assert all(x["stored"] for x in second.warmup_status()["executables"])
    assert not _loop_and_prefill_traces(second)  # nothing traced, nothing lowered
    assert _decode(second, prompts) == want
    assert not _loop_and_prefill_traces(second)  # the requests ran on the loaded programs


def test_another_configuration_or_layout_misses(ckpt, store):
    """A different draft count, kernel policy, steps per sync, or argument shape gives another key; equal inputs
    give the same key."""
    model = jaxmtp.load(ckpt, dtype="float32", progress=False)
    eng = Engine(model, **KW)
    ex = eng.executables[("prefill", 1, 32)]
    args = (model.params, eng.state, *ex.args())
    key = aot.fingerprint(ex.identity, args)
    assert key == aot.fingerprint(Engine(model, **KW).executables[("prefill", 1, 32)].identity, args)
    for change in (dict(num_draft_tokens=1), dict(steps_per_sync=4)):
        other = Engine(model, **{**KW, **change})
        assert aot.fingerprint(other.executables[("prefill", 1, 32)].identity, args) != key
    policy = model.backend.policy
    field = next(f for f in policy.__dataclass_fields__ if isinstance(getattr(policy, f), int)
                 and not isinstance(getattr(policy, f), bool))
    import dataclasses
    changed = dataclasses.replace(model, backend=dataclasses.replace(
        model.backend, policy=dataclasses.replace(policy, **{field: getattr(policy, field) + 1})))
    assert aot.fingerprint(Engine(changed, **KW).executables[("prefill", 1, 32)].identity, args) != key
    wider = (model.params, eng.state, *eng.executables[("prefill", 2, 32)].args())
    assert aot.fingerprint(ex.identity, wider) != key
    as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, args[0])
    assert aot.fingerprint(ex.identity, (as_bf16,) + args[1:]) != key


def test_a_damaged_file_is_dropped_and_the_function_compiled(ckpt, store, caplog, rng):
    model = jaxmtp.load(ckpt, dtype="float32", progress=False)
    prompts = [rng.integers(3, 100, 23).tolist()]
    first = Engine(model, **KW)
    first.warmup()
    want = _decode(first, prompts)
    files = sorted(os.listdir(store.directory))
    damaged = os.path.join(store.directory, files[0])
    with open(damaged, "r+b") as f:
        f.truncate(os.path.getsize(damaged) // 2)
    second = Engine(model, **KW)
    with caplog.at_level(logging.WARNING, logger="jaxmtp.engine"):
        second.warmup()
    assert any("did not load" in r.getMessage() for r in caplog.records)
    stored = [x["stored"] for x in second.warmup_status()["executables"]]
    assert stored.count(False) == 1 and len(stored) == len(files)
    assert _decode(second, prompts) == want
    assert sorted(os.listdir(store.directory)) == files  # compiled afresh and stored again


def test_eviction_keeps_the_most_recently_used(tmp_path):
    s = aot.Store(str(tmp_path))
    f = jax.jit(lambda x: x * 2 + 1)
    x = jnp.arange(8.0)
    compiled = f.lower(x).compile()
    for i, key in enumerate("abc"):
        assert s.save(key, compiled)
        os.utime(s._path(key), (1000 + i, 1000 + i))
    size = os.path.getsize(s._path("c"))
    s.max_bytes = 2 * size + 1
    assert s.load("a", (x,)) is not None  # a is used now: b is the oldest
    s._evict()
    assert sorted(os.listdir(tmp_path)) == ["a.jaxexe", "c.jaxexe"]
    np.testing.assert_array_equal(np.asarray(s.load("a", (x,))(x)), np.asarray(x * 2 + 1))


_GPU_CHILD = """
import json
import jaxmtp
from jaxmtp.engine import Engine
from jaxmtp.sampling import SamplingParams

model = jaxmtp.load(progress=False)  # the default model, on the GPU
eng = Engine(model, num_slots=2, max_context=256, num_draft_tokens=3, prefill_chunk=16, steps_per_sync=4,
             max_prefill_batch=1, slot_buckets=False)
eng.warmup()
rids = [eng.add_request(list(range(5, 45)), SamplingParams(max_new_tokens=24, ignore_eos=True)),
        eng.add_request(list(range(60, 81)), SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8,
                                                            seed=7))]
toks = {r: [] for r in rids}
while eng.has_work():
    for o in eng.step():
        toks[o.request_id] += o.token_ids
print(json.dumps({"tokens": [toks[r] for r in rids], "backend": model.backend.attention,
                  "executables": eng.warmup_status()["executables"]}))
"""


@pytest.mark.gpu
def test_gpu_executables_stored_from_the_persistent_cache_run_correctly(tmp_path):
    """On a GPU an executable that JAX's persistent cache supplied is stored too (only the CPU client cannot
    serialize one again): three processes on one cache directory, the first compiling, the second (its store
    emptied) loading from the persistent cache and storing that copy, the third loading the copy; all three decode
    the same tokens with the Pallas kernels."""
    import json
    import shutil
    import subprocess
    import sys

    env = {**os.environ, "JAXMTP_COMPILE_CACHE_DIR": str(tmp_path / "xla")}
    runs = []
    for i in range(3):
        if i == 1:
            shutil.rmtree(tmp_path / "xla" / "aot")
        p = subprocess.run([sys.executable, "-c", _GPU_CHILD], capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    first, second, third = runs
    assert first["backend"] != "xla"  # the Pallas kernels are in these programs
    assert not any(x["stored"] for x in first["executables"] + second["executables"])
    assert all(x["cache_hits"] > 0 for x in second["executables"])
    assert all(x["stored"] for x in third["executables"])
    assert first["tokens"] == second["tokens"] == third["tokens"] and len(first["tokens"][0]) == 24
