"""Start-up: the persistent compilation cache, warm-up (before SERVING and in the background), progress, and the
README's server quick start as a new user runs it."""

import collections
import io
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from hf_builders import EOS

from jaxmtp import compile_cache
from jaxmtp.engine import Engine
from jaxmtp.engine import warmup as warmup_mod
from jaxmtp.progress import Progress
from jaxmtp.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(engine, prompts, params):
    rids = [engine.add_request(p, params[i]) for i, p in enumerate(prompts)]
    toks = collections.defaultdict(list)
    while engine.has_work():
        for o in engine.step():
            toks[o.request_id] += o.token_ids
    return [toks[r] for r in rids]


# ---- the compilation cache ---------------------------------------------------------------------------------------
def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve_cache_dir() == str(tmp_path / "xdg" / "jaxmtp" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.resolve_cache_dir() == str(tmp_path / "home" / ".cache" / "jaxmtp" / "xla")
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.resolve_cache_dir() == str(tmp_path / "env")
    assert compile_cache.resolve_cache_dir(tmp_path / "flag") == str(tmp_path / "flag")  # the flag wins
    assert compile_cache.resolve_cache_dir(tmp_path / "flag", enabled=False) is None
    for off in ("off", "0", "", "None"):
        monkeypatch.setenv(compile_cache.ENV_VAR, off)
        assert compile_cache.resolve_cache_dir() is None


_CHILD = textwrap.dedent("""
    import json, sys
    import jaxmtp
    from jaxmtp.compile_cache import CompileCounter, cache_dir
    from jaxmtp.engine import Engine
    from jaxmtp.sampling import SamplingParams

    with CompileCounter() as c:
        model = jaxmtp.load(sys.argv[1], dtype="float32", progress=False)
        eng = Engine(model, num_slots=2, max_context=64, num_draft_tokens=2, prefill_chunk=16, steps_per_sync=2,
                     slot_buckets=False)
        eng.warmup()
        eng.add_request([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=12, ignore_eos=True))
        toks = []
        while eng.has_work():
            for o in eng.step():
                toks += o.token_ids
    print(json.dumps({"counter": c.as_dict(), "requests": c.requests, "tokens": toks, "dir": cache_dir(),
                      "warmup": [x["cache_hits"] for x in eng.warmup_status()["executables"]],
                      "stored": [x["stored"] for x in eng.warmup_status()["executables"]],
                      "traced": sum(n for f, n in eng.trace_counts.items() if f.startswith(("step", "prefill")))}))
""")


def test_second_start_in_a_fresh_process_compiles_nothing(ckpt, tmp_path):
    """The same engine started twice, each in a new process, with the cache directory from the environment (as
    every entry point resolves it): the first start compiles and writes the cache, and stores the warmed step loops
    and prefills (jaxmtp.engine.aot); the second loads those from the store (nothing traced) and everything else
    from the cache (no XLA compile, no new file) and decodes the same tokens."""
    cache = tmp_path / "xla"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", compile_cache.ENV_VAR: str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    outs, files = [], []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _CHILD, ckpt], capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        files.append(sorted(os.listdir(cache)) + sorted(os.listdir(cache / "aot")))
    first, second = outs
    assert first["dir"] == second["dir"] == str(cache)
    # A cold start compiles (a repeated small computation may already hit what the same process wrote) ...
    assert first["counter"]["cache_misses"] > 5 and first["counter"]["cache_hits"] < first["requests"] / 4
    assert len(files[0]) >= first["counter"]["cache_misses"]  # ... and writes each executable
    n = len(first["stored"])  # a prefill of 1 and of 2 rows, the greedy and the sampling loop
    assert n == 4 and not any(first["stored"]) and len(os.listdir(cache / "aot")) == n
    assert second["counter"]["cache_misses"] == 0 and second["counter"]["cache_hits"] == second["requests"]
    assert files[1] == files[0]
    assert all(second["stored"]) and not any(second["warmup"]) and first["traced"] == n and second["traced"] == 0
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 12


# ---- warm-up -----------------------------------------------------------------------------------------------------
ENGINE_KW = dict(num_slots=2, max_context=96, num_draft_tokens=2, prefill_chunk=64, steps_per_sync=3,
                 max_prefill_batch=1)


def test_background_warmup_serves_on_compiled_substitutes(model, monkeypatch, rng):
    """Before the background compiles run, every request runs on the two executables compiled for serving (the
    sampling loop over all slots, a one-row prefill of the largest chunk), with the tokens of an engine that runs
    each exact shape; once the background is done every executable is compiled and the tokens are the same."""
    prompts = [rng.integers(0, EOS, n).tolist() for n in (5, 70, 12, 33, 9)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=i)
              for i, (n, t) in enumerate([(9, 0.0), (14, 0.8), (6, 0.0), (11, 1.1), (7, 0.0)])]
    want = run(Engine(model, **{**ENGINE_KW, "slot_buckets": False}), prompts, params)

    started = []
    monkeypatch.setattr(warmup_mod.BackgroundCompiler, "start", lambda self: started.append(self) or self)
    eng = Engine(model, **ENGINE_KW)
    assert len(eng.executables) == 2 + 2 * 3  # prefill chunks {16, 64}; loops over slots {1, 2} x 3 modes
    eng.warmup(background=True)
    status = eng.warmup_status()
    assert (status["planned"], status["done"], status["compiled"]) == (2, 2, 2)
    assert {x["name"] for x in status["executables"]} == {"prefill[1x64]", "step[2]+sampling"}
    traced = dict(eng.trace_counts)
    assert run(eng, prompts, params) == want
    assert dict(eng.trace_counts) == traced  # nothing else was compiled: the substitutes served every request

    bg = started[0]
    bg.thread.start()
    assert bg.finished.wait(600) and bg.error is None
    status = eng.warmup_status()
    assert status["compiled"] == status["total"] == len(eng.executables)
    assert {x["phase"] for x in status["executables"]} == {"warmup", "background"}
    assert all(x["seconds"] > 0 for x in status["executables"])
    assert run(eng, prompts, params) == want
    for name in ("step[1]", "step[1]+sampling", "prefill"):
        assert eng.trace_counts[name] >= 1


def test_substitute_choice(model):
    eng = Engine(model, **{**ENGINE_KW, "num_slots": 4, "max_prefill_batch": 2})
    eng._lazy = True
    eng._ready = {("step", 4, True), ("step", 2, False), ("prefill", 1, 64), ("prefill", 2, 16)}
    assert eng._loop_for(1, False) == (2, False)  # the narrowest compiled greedy loop that covers the slots
    assert eng._loop_for(1, True) == (4, True)  # sampling slots need a sampling loop
    assert eng._loop_for(4, False) == (4, True)
    assert eng._prefill_rows_limit() == 2
    assert eng._prefill_shape(1, 10) == (2, 16)  # the fewest padded tokens with enough rows
    assert eng._prefill_shape(1, 40) == (1, 64)
    assert eng._prefill_shape(2, 40) == (2, 16)  # no 2-row chunk of 64 yet: split into chunks of 16
    assert eng._loop_for(1, "features") == (1, "features")  # nothing serves it but a feature loop: compile it
    eng._ready |= {("step", 4, "features")}
    assert eng._loop_for(2, "features") == (4, "features") and eng._loop_for(2, True) == (4, True)
    eng._ready = {("step", 4, "features"), ("prefill", 1, 64)}
    assert eng._loop_for(1, False) == (4, "features")  # a feature loop decodes greedy slots as the greedy loop
    eng._lazy = False
    assert eng._loop_for(1, False) == (1, False) and eng._prefill_shape(2, 40) == (2, 64)


def test_keys_for_request(model):
    eng = Engine(model, **{**ENGINE_KW, "slot_buckets": False})
    assert eng.keys_for_request(70, sampling=False) == [("prefill", 1, 64), ("prefill", 1, 16), ("step", 2, False)]
    assert eng.keys_for_request(3, sampling=True) == [("prefill", 1, 16), ("step", 2, True)]


def test_progress_lines_off_a_terminal():
    out = io.StringIO()
    with Progress(4, "compiling", unit=" executables", stream=out, log_interval=0.0) as p:
        for i in range(4):
            p.update(1, note=f"x{i}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and "\r" not in out.getvalue()
    assert lines[1].startswith("compiling [###############---------------] 2/4 executables") and "x1" in lines[1]
    assert "eta" in lines[-1]


# ---- the server ----------------------------------------------------------------------------------------------------
def test_client_waits_through_the_warm_up_and_model_info_reports_it(model):
    import threading

    from jaxmtp.serving.client import Client
    from jaxmtp.serving.server import ServerConfig, ServerThread

    with ServerThread(model, ServerConfig(port=0, **{k: v for k, v in dict(
            num_slots=2, max_context=64, num_draft_tokens=2, prefill_chunk=16, steps_per_sync=2).items()}),
            warmup=False) as srv:
        seen = []
        with Client(srv.address, timeout=60) as c:
            waiter = threading.Thread(target=c.wait_ready, kwargs=dict(timeout=600, on_progress=seen.append,
                                                                       poll_seconds=0.05))
            waiter.start()
            while not seen:
                waiter.join(0.05)
            srv.warmup(timeout=600)
            waiter.join(60)
            assert not waiter.is_alive()
            assert seen and all(i is not None and i["warmup_done"] <= i["warmup_planned"] for i in seen), [
                i and (i["warmup_done"], i["warmup_planned"]) for i in seen]
            info = c.model_info()
            assert (info["warmup_planned"], info["warmup_done"]) == (2, 2) and info["warmup_s"] > 0
            assert info["executables_total"] == 2 * 1 + 2 * 3  # prefill rows {1, 2} x chunk 16; loops {1, 2} x 3
            warm = [x for x in info["executables"] if x["phase"] == "warmup"]
            assert sorted(x["name"] for x in warm) == ["prefill[1x16]", "step[2]+sampling"]
            assert all(x["seconds"] > 0 for x in warm)
            assert c.generate([1, 2, 3], max_tokens=4, ignore_eos=True).completion_tokens == 4


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _readme_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = [ln.strip() for ln in f]
    serve = next(ln for ln in lines if ln.startswith("python -m jaxmtp.serve"))
    client = next(ln for ln in lines if ln.startswith("python -m jaxmtp.client"))
    return serve.split("#")[0].split(), client


def test_readme_server_quick_start(tmp_path):
    """The README's two commands as written (and the compilation cache where a user's would be): the server, then
    the client with its default wait, started while the server still loads and compiles. The client waits, then
    prints the prompt and the generated text."""
    import shlex

    serve, client = _readme_commands()
    if not (_port_free(50051) and _port_free(8000)):
        pytest.skip("the README's default ports (50051, 8000) are in use on this machine")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with open(tmp_path / "serve.err", "w") as err:
        proc = subprocess.Popen([sys.executable if w == "python" else w for w in serve], stdout=subprocess.DEVNULL,
                                stderr=err, env=env, cwd=ROOT)
    try:
        argv = [sys.executable if w == "python" else w for w in shlex.split(client)]
        out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
        log = (tmp_path / "serve.err").read_text()
        assert out.returncode == 0, (out.stderr[-2000:], log[-3000:])
        prompt = shlex.split(client)[3]
        assert out.stdout.startswith(prompt) and len(out.stdout) > len(prompt) + 8, out.stdout
        assert "tokens, finish=" in out.stderr
        assert "warmed up in" in log and "compiled" in log
    finally:
        proc.terminate()
        proc.wait(60)


# ---- memory --------------------------------------------------------------------------------------------------------
def test_memory_fraction_is_set_only_where_it_can_apply(monkeypatch):
    from jaxmtp.engine import EngineConfigError
    from jaxmtp.engine import memory

    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(memory, "backend_initialized", lambda: False)
    assert memory.set_memory_fraction(None) == 0.9 and os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.55")  # the user's setting wins
    assert memory.set_memory_fraction(0.8) == 0.55 and os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.55"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setattr(memory, "backend_initialized", lambda: True)  # too late: nothing changes
    assert memory.set_memory_fraction(0.8) is None and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(EngineConfigError, match="memory fraction"):
            memory.set_memory_fraction(bad)


def test_too_many_slots_names_the_most_that_fit(model):
    from jaxmtp.engine import EngineConfigError
    from jaxmtp.engine.memory import device_memory_bytes, most_slots

    eng = Engine(model, num_slots=1, max_context=64, num_draft_tokens=2)
    most = most_slots(eng.plan, device_memory_bytes())
    assert most > 1 and eng.plan.weights + most * eng.plan.per_slot <= 0.9 * device_memory_bytes()
    assert eng.plan.weights + (most + 1) * eng.plan.per_slot > 0.9 * device_memory_bytes()
    with pytest.raises(EngineConfigError, match=f"at most {most} slots fit"):
        Engine(model, num_slots=most + 1, max_context=64, num_draft_tokens=2)


def test_load_builds_the_layout_on_the_host(model):
    import jax

    leaves = jax.tree_util.tree_leaves(model.params)
    assert all(isinstance(x, jax.Array) for x in leaves)
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
    assert model.load_info["weight_bytes"] == nbytes
    if not model.load_info["peak_measured"]:  # a CPU: no allocator statistics, the analytic peak is the weights
        assert model.load_info["peak_device_bytes"] == nbytes


def test_client_wait_progress_lines():
    from jaxmtp.client import DEFAULT_WAIT, WaitProgress

    assert DEFAULT_WAIT >= 300  # a first start on a small CPU compiles for minutes under load
    out = io.StringIO()
    p = WaitProgress("127.0.0.1:1", stream=out, every=1e9)
    for info in (None, None, {"warmup_planned": 0, "warmup_done": 0}, {"warmup_planned": 2, "warmup_done": 0},
                 {"warmup_planned": 2, "warmup_done": 0}, {"warmup_planned": 2, "warmup_done": 1}):
        p(info)
    lines = [ln.split("] ", 1)[1] for ln in out.getvalue().splitlines()]
    assert lines == ["waiting for the server at 127.0.0.1:1 to start", "the server is starting its warm-up",
                     "the server is warming up: compiled 0 of 2 executables",
                     "the server is warming up: compiled 1 of 2 executables"]
