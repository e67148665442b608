"""Helpers shared by the benchmark scripts (``scripts/bench_*.py``, ``scripts/profile_step.py``) and their tests.

* Models: :func:`tiny_config` (a released shape's layout at width 64), :func:`random_model` (random weights in a
  params layout), :func:`variant_model` (the same weights under a backend / kernel-policy override).
* Engines with every slot busy: :func:`synthetic_engine`, :func:`fill_synthetic`, :func:`timed_loops`; one prompt's
  prefill: :func:`prefill_engine`, :func:`timed_prefill`.
* Timing: :func:`median_time`, :func:`alternating_step_ms` (variants timed in alternating rounds of one process),
  :func:`alternating_call_seconds` (the same for jitted functions),
  :class:`CompileClock`, :func:`device_seconds` (kernel time from a profiler trace) and the trace readers
  (:func:`read_trace`, :func:`is_device_stream`, :func:`covered_time`, :func:`hlo_sources`).
* Roofline: :func:`hbm_bandwidth`, :func:`step_bytes` (the bytes a decode step must move), :func:`speedup_bound`.
* Results: :func:`run_metadata` (device, date, versions, command) and :func:`write_json`.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import glob
import gzip
import json
import os
import platform
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp import shapes
from jaxmtp.config import Qwen35Config
from jaxmtp.engine import Engine, steps
from jaxmtp.fp8 import STANDARD, check_quantization, has_fp8
from jaxmtp.loaded_model import Model
from jaxmtp.model import init_params, param_shapes
from jaxmtp.pallas import override_backend, resolve_backend
from jaxmtp.param_layout import (has_quantized_mtp, quantize_mtp, quantizes_mtp, serving_layout, set_output_layout,
                                 transposes_outputs, weight_bytes)
from jaxmtp.sampling import SamplingParams

# Mean acceptance lengths (tokens per verify step) published for Qwen3.5's MTP head: k = 1, 2, 3; k = 4 extrapolated
# with the per-position rate 0.7 that k = 3's 2.9 implies (1 + .7 + .49 + .343 + .24).
PUBLISHED_AL = {0: 1.0, 1: 1.9, 2: 2.4, 3: 2.9, 4: 3.14}

LAYOUTS = ("serving", "fused", "native")


# ---------------------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------------------
def tiny_config(cfg: Qwen35Config | str) -> Qwen35Config:
    """``cfg`` (a config or a shape name of :mod:`jaxmtp.shapes`) shrunk to its first four layers at width 64, keeping
    its layout (layer types, MoE layers, GDN value heads per key head, a dense MLP or routed experts): the scripts'
    CPU smoke runs and the checks' tests."""
    cfg = shapes.config(cfg) if isinstance(cfg, str) else cfg
    over = dict(hidden_size=64, vocab_size=512, intermediate_size=128 if cfg.intermediate_size else 0,
                num_hidden_layers=4, layer_types=cfg.layer_types[:4], moe_layers=cfg.moe_layers[:4], head_dim=32,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=2 * cfg.gdn_v_per_k, num_attention_heads=4, num_key_value_heads=2)
    if cfg.is_moe:
        over.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return dataclasses.replace(cfg, **over)


def random_model(cfg: Qwen35Config, dtype, backend="auto", layout: str = "serving", draft_vocab: int | None = None,
                 draft_head_bits: int | None = None, quantize_mtp_layer: bool | None = None, seed: int = 0,
                 tensor_parallel_size: int = 1, quantization: str | None = None) -> Model:
    """A :class:`jaxmtp.loaded_model.Model` of random weights in ``layout``: "serving" (what ``jaxmtp.load`` gives:
    fused projections, the quantised draft head and, where the backend wants it, the int8 MTP layer), "fused" (fused
    projections, exact drafts) or "native" (the checkpoint layout). ``backend``: a name or a
    :class:`jaxmtp.pallas.Backend`. ``draft_vocab``: a hot draft vocabulary of that many ids (the first ones; which
    ids does not matter for step costs). ``quantize_mtp_layer``: as :func:`jaxmtp.param_layout.serving_layout`.
    ``tensor_parallel_size``: split over that many devices (:func:`jaxmtp.load`; serving layout only), each rank's
    weights drawn on its device (:func:`jaxmtp.parallel.random_params`: not the unsharded model's values).
    ``quantization="fp8"``: the linears the official FP8 checkpoints quantise drawn as block FP8
    (:func:`jaxmtp.model.init_params`)."""
    check_quantization(quantization)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    backend = resolve_backend(backend, cfg, dtype)
    if tensor_parallel_size != 1:  # drawn on each rank's device (jaxmtp.parallel.random_params)
        from jaxmtp.parallel import make_layout, random_params

        if layout != "serving" or draft_vocab is not None:
            raise ValueError("a tensor-parallel random model comes in the serving layout, without a draft vocabulary")
        par = make_layout(cfg, tensor_parallel_size)
        params = random_params(cfg, par, dtype, backend, seed=seed, draft_head_bits=draft_head_bits,
                               quantize_mtp_layer=quantize_mtp_layer)
        return Model(config=cfg, params=params, tokenizer=None, dtype=dtype, backend=par.backend(backend), layout=par)
    if quantization and tensor_parallel_size != 1:
        raise ValueError("a random FP8 model is drawn on one device (no tensor_parallel_size)")
    params = init_params(cfg, jax.random.PRNGKey(seed), dtype, fp8=STANDARD if quantization else None)
    if layout != "native":
        ids = None if draft_vocab is None else np.arange(draft_vocab, dtype=np.int32)
        params = serving_layout(params, draft_head=layout == "serving", draft_vocab=ids,
                                draft_head_bits=draft_head_bits, backend=backend,
                                quantize_mtp_layer=quantize_mtp_layer)
    jax.block_until_ready(params)
    return Model(config=cfg, params=params, tokenizer=None, dtype=dtype, backend=backend)


def variant_model(model: Model, spec: str) -> Model:
    """``model`` under the override ``spec`` (``"name=value,..."``: :class:`jaxmtp.pallas.Backend` fields and kernel
    policy fields, :func:`jaxmtp.pallas.override_backend`), its params in the layout that backend reads (output
    projections transposed or not, the MTP layer int8 or not; arrays shared otherwise). Build ``model`` with an exact
    MTP layer (``random_model(..., quantize_mtp_layer=False)``) to compare variants that differ there: int8 cannot be
    undone."""
    m = dataclasses.replace(model, backend=override_backend(model.backend, spec))
    params = model.params
    if transposes_outputs(m.backend) != transposes_outputs(model.backend):
        params = set_output_layout(jax.tree.map(lambda a: a, params), transposes_outputs(m.backend),  # new dicts
                                   stacked=model.layout is not None)
    if "draft_head" in params and quantizes_mtp(m.backend) != has_quantized_mtp(params):
        if has_quantized_mtp(params):
            raise ValueError(f"variant {spec!r} wants an exact MTP layer but the model's is int8: build the model "
                             "with quantize_mtp_layer=False")
        if model.layout is not None:
            raise ValueError(f"variant {spec!r} changes the MTP layer's quantisation, which a sharded model's "
                             "stacked params cannot: load it with that backend instead")
        params = quantize_mtp(jax.tree.map(lambda a: a, params))
    return dataclasses.replace(m, params=params)


# ---------------------------------------------------------------------------------------------------------------
# engines with every slot busy
# ---------------------------------------------------------------------------------------------------------------
def oneshot_mesh(spin_limit: int | None = None):
    """Every GPU of the host (at most the one-shot kernels' ``MAX_RANKS``) as a ``tp`` mesh with its one-shot
    workspaces, for the one-shot benchmarks: ``(ranks, mesh, workspaces, peers)``; exits where there are fewer than
    two CUDA GPUs or no jax_triton. ``spin_limit``: polls before a kernel gives up on a peer and writes NaN (lower:
    a broken protocol shows at once)."""
    from jax.sharding import Mesh

    from jaxmtp.pallas import allreduce_oneshot

    if spin_limit:
        allreduce_oneshot.SPIN_LIMIT = spin_limit
    if not allreduce_oneshot.available() or len(jax.devices()) < 2:
        raise SystemExit("needs two or more CUDA GPUs and jax_triton")
    n = min(len(jax.devices()), allreduce_oneshot.MAX_RANKS)
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("tp",))
    return (n, mesh, *allreduce_oneshot.allocate(mesh))


def fill_synthetic(eng: Engine, context: int, seed: int) -> None:
    """Make every slot of ``eng`` an active request ``context`` tokens deep (random last token and drafts, KV as
    allocated), so that the step can be timed without compiling prefill shapes: step cost does not depend on the
    cache values."""
    s = eng.num_slots
    vocab = eng.cfg.vocab_size
    rng = np.random.default_rng(seed)
    ids = jnp.arange(s, dtype=jnp.int32)
    zi, zf = jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.float32)
    state = eng._admit(eng.state, ids, zi + 10**9, zf, zi, zf + 1, zi.astype(jnp.uint32), zi.astype(jnp.uint32),
                       jnp.full((s, eng.state.stop_ids.shape[1]), -1, jnp.int32),
                       {name: jnp.asarray(v) for name, v in steps.neutral_processing(s).items()})
    fields = dict(length=np.full((s,), context, np.int32), last=rng.integers(0, vocab, s).astype(np.int32),
                  drafts=rng.integers(0, vocab, eng.state.drafts.shape).astype(np.int32),
                  generated=np.ones((s,), np.int32), active=np.ones((s,), bool))
    # from the host, placed as the engine's state is (a sharded model's state spans the mesh, in the mesh's device
    # order; the loop donates it)
    state = state.replace(**{name: jax.device_put(v, getattr(state, name).sharding) for name, v in fields.items()})
    # every leaf committed to its device(s), as the loop's outputs are: jit keys its cache on that, so a state of
    # uncommitted leaves (created outside jit) would compile the loop once for the first call and again for the next
    eng.state = jax.tree_util.tree_map(lambda a: jax.device_put(a, a.sharding), state)


def synthetic_engine(model: Model, batch: int, k: int, context: int, room: int, steps_per_sync: int) -> Engine:
    """An engine of ``batch`` slots and k = ``k`` with ``room`` KV rows of headroom past ``context``, every slot busy
    (:func:`fill_synthetic`)."""
    eng = Engine(model, num_slots=batch, max_context=context + room, num_draft_tokens=k,
                 steps_per_sync=steps_per_sync, check_memory=False)
    fill_synthetic(eng, context, batch * 10 + k)
    return eng


def prefill_engine(model: Model, prompt_len: int, chunk: int, **engine_kw) -> Engine:
    """One slot with room for a ``prompt_len``-token prompt, prefilled ``chunk`` tokens per call, k = 0 (``engine_kw``:
    more :class:`jaxmtp.engine.Engine` arguments)."""
    return Engine(model, num_slots=1, max_context=prompt_len + 8, num_draft_tokens=0, prefill_chunk=chunk,
                  steps_per_sync=1, check_memory=False, **engine_kw)


def timed_prefill(eng: Engine, prompt_len: int, rng) -> float:
    """Seconds to prefill one random prompt of ``prompt_len`` tokens (and emit its first token)."""
    eng.add_request(rng.integers(0, eng.cfg.vocab_size - 1, prompt_len).tolist(),
                    SamplingParams(max_new_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    while eng.has_work():
        eng.step()
    return time.perf_counter() - t0


def timed_loops(eng: Engine, params, n: int, loop=None) -> list[tuple[float, dict]]:
    """``n`` device loops of ``eng`` (``loop``: one of its jitted loops; default the one it would run), each timed
    until its outputs are on the host: ``[(seconds, outputs)]``."""
    res = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.state, out = (loop or eng.device_loop())(params, eng.state)
        out = jax.device_get(out)
        res.append((time.perf_counter() - t0, out))
    return res


# ---------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------
def median_time(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn()``, each waited for."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def chained_loop(fn, chain, calls: int):
    """A jitted ``loop(sets)`` of ``calls`` calls of ``fn``: the first ``fn(*sets[0])``, call i
    ``fn(*chain(sets[i % len(sets)], previous_output))`` with the output passed through an optimization barrier, so
    that calls run one after another and cannot merge; returns the last output."""
    @jax.jit
    def loop(sets):
        out = fn(*sets[0])
        for i in range(1, calls):
            out = fn(*chain(sets[i % len(sets)], jax.lax.optimization_barrier(out)))
        return out

    return loop


def chained_product_seconds(fn, x, operands: list[tuple], calls: int, reps: int):
    """Seconds per product of ``calls`` products ``fn(y, *operands[i % len(operands)])`` chained by
    :func:`chained_loop`, y being ``x`` made to wait on the previous product (rotating the operands over copies
    larger than L2 streams them from HBM): the loop's median wall time over ``reps`` runs, divided by ``calls``."""
    loop = chained_loop(fn, lambda a, out: (a[0] + out[..., :1].astype(a[0].dtype) * 0, *a[1:]), calls)
    sets = [(x, *ops) for ops in operands]
    jax.block_until_ready(loop(sets))
    return median_time(lambda: loop(sets), reps) / calls


def alternating_step_ms(engines, params, rounds: int, syncs: int) -> list[list[float]]:
    """Step times (ms) of each engine, timed in alternation so that drift within the process (clocks, other tenants)
    moves every engine alike: ``rounds`` rounds, each timing every engine's ``syncs`` device loops (their median per
    step). ``params``: one params tree for all engines, or a list of one per engine. Returns ``[engine][round]``."""
    params = params if isinstance(params, list) else [params] * len(engines)
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(rounds):
        for i, (eng, p) in enumerate(zip(engines, params)):
            ts = [dt for dt, _ in timed_loops(eng, p, syncs)]
            times[i].append(float(np.median(ts)) / eng.steps_per_sync * 1e3)
    return times


def alternating_call_seconds(fns: dict, args: tuple, rounds: int) -> dict[str, list[float]]:
    """Wall seconds of one call ``fn(*args)`` of each jitted function of ``fns`` (name -> function, each compiled
    already), timed in ``rounds`` alternating rounds (as :func:`alternating_step_ms` for engines):
    ``{name: [seconds per round]}``."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t)
    return times


class CompileClock:
    """Seconds spent compiling (XLA backend compiles, from ``jax.monitoring`` events) since :meth:`reset`.

    One listener serves every clock; each clock reads the process total relative to its last reset."""

    _total = 0.0
    _listening = False

    def __init__(self):
        if not CompileClock._listening:
            jax.monitoring.register_event_duration_secs_listener(CompileClock._on_event)
            CompileClock._listening = True
        self._start = CompileClock._total

    @staticmethod
    def _on_event(event, duration, **_):
        if "backend_compile" in event or event.endswith("compile_duration"):
            CompileClock._total += duration

    def reset(self) -> None:
        self._start = CompileClock._total

    @property
    def seconds(self) -> float:
        return CompileClock._total - self._start


def read_trace(trace_dir: str) -> dict:
    """Events of the newest ``*.trace.json.gz`` under ``trace_dir`` (a ``jax.profiler`` trace), grouped by
    ``(process name, thread name)``: ``{(process, thread): [event, ...]}``."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"]["name"]
    groups = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            key = (pname.get(e["pid"], str(e["pid"])), tname.get((e["pid"], e["tid"]), str(e["tid"])))
            groups[key].append(e)
    return groups


def is_device_stream(process: str, thread: str) -> bool:
    """Whether a trace thread holds device kernels (one per CUDA stream), not the derived "XLA Ops" lines."""
    p, t = process.lower(), thread.lower()
    return ("gpu" in p or "device" in p) and "stream" in t


def covered_time(intervals) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def hlo_sources(text: str, depth: int = 4) -> dict[str, str]:
    """Instruction name -> its innermost ``depth`` source frames (``file:line function < caller ...``), read from
    the optimised HLO text's FileNames / FunctionNames / FileLocations / StackFrames tables and each instruction's
    ``stack_frame_id``. A frame's printed ``parent_frame_id`` is the parent's number + 1 (0: none)."""
    tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    section = None
    for line in text.splitlines():
        s = line.strip()
        if s in tables:
            section = s
            continue
        m = re.match(r"^(\d+) (.*)$", s) if section else None
        if not m:
            section = None
            continue
        i, rest = int(m.group(1)), m.group(2)
        if section in ("FileNames", "FunctionNames"):
            tables[section][i] = rest.strip('"')
        else:
            tables[section][i] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", rest)}
    files, funcs, locs, frames = (tables[k] for k in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"))
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?stack_frame_id=(\d+)", text, re.M):
        fid, chain, seen = int(m.group(2)), [], set()
        while fid in frames and fid not in seen and len(chain) < depth:
            seen.add(fid)
            loc = locs[frames[fid]["file_location_id"]]
            chain.append(f"{os.path.basename(files[loc['file_name_id']])}:{loc['line']} "
                         f"{funcs[loc['function_name_id']].split('.')[-1]}")
            fid = frames[fid]["parent_frame_id"] - 1
        out.setdefault(m.group(1), " < ".join(chain))
    return out


def device_kernels(fn, *args, chain, calls: int = 20, min_set_bytes: int = 256 << 20) -> tuple[list[dict], float]:
    """The device's kernel events of ``calls`` chained calls of ``fn(*args)`` from a profiler trace, and the wall
    seconds of the traced run.

    Jits ``calls`` chained calls (``chain(args, previous_output) -> next args``, the output passed through an
    optimization barrier so that calls cannot merge; the inputs rotate over copies of at least ``min_set_bytes`` in
    all, so that weights come from HBM, not L2), runs it once to compile, then once under ``jax.profiler``. Without
    device streams (a CPU) the event list is empty."""
    set_bytes = sum(a.size * a.dtype.itemsize for a in args if a is not None)
    n_sets = max(1, min(calls, -(-min_set_bytes // max(set_bytes, 1))))
    sets = [tuple(args)] + [tuple(None if a is None else jnp.copy(a) for a in args) for _ in range(n_sets - 1)]
    loop = chained_loop(fn, chain, calls)
    jax.block_until_ready(loop(sets))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        jax.block_until_ready(loop(sets))
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        groups = read_trace(d)
    return [e for (p, t), evs in groups.items() if is_device_stream(p, t) for e in evs], wall


def device_seconds(fn, *args, chain, calls: int = 20, min_set_bytes: int = 256 << 20) -> float:
    """Device time of one call of ``fn(*args)``: the union of the kernel intervals of :func:`device_kernels` over
    ``calls`` (launch gaps excluded, the chain op included); without device streams (a CPU) wall time over
    ``calls``."""
    kernels, wall = device_kernels(fn, *args, chain=chain, calls=calls, min_set_bytes=min_set_bytes)
    if not kernels:
        return wall / calls
    return covered_time((e["ts"], e["ts"] + e["dur"]) for e in kernels) * 1e-6 / calls


# ---------------------------------------------------------------------------------------------------------------
# roofline
# ---------------------------------------------------------------------------------------------------------------
def hbm_bandwidth() -> float:
    """Bytes/s (read + written) of 20 chained elementwise passes over 1 GiB of float32 (16 MiB on a CPU) in one
    jitted loop: the memory roofline's bandwidth."""
    n = 1 << 28 if jax.default_backend() != "cpu" else 1 << 22
    passes = 20
    x = jnp.full((n,), 1.5, jnp.float32)

    @jax.jit
    def f(a):
        return jax.lax.fori_loop(0, passes, lambda i, v: jax.lax.optimization_barrier(v * 1.0001), a)

    jax.block_until_ready(f(x))
    t = median_time(lambda: f(x), 5)
    return passes * 2 * 4 * n / t


def draft_head_bytes(params) -> int | None:
    """Bytes of the serving layout's draft head (int8 / int4 and / or a hot vocabulary), None without one (the drafts
    read the LM head)."""
    if "draft_head" not in params:
        return None
    return weight_bytes({name: a for name, a in params["draft_head"].items() if name != "ids"})


def mtp_bytes(params) -> int | None:
    """Bytes of the MTP head's weights as stored (int8 after :func:`jaxmtp.param_layout.quantize_mtp`), None
    without one."""
    return weight_bytes(params["mtp"]) if "mtp" in params else None


def fp8_scheme(params):
    """The FP8 scheme of ``params`` for :func:`step_bytes`: :data:`jaxmtp.fp8.STANDARD` where any weight is block FP8
    (``random_model(..., quantization="fp8")``), else None."""
    return STANDARD if has_fp8(params) else None


def step_bytes(cfg: Qwen35Config, batch: int, k: int, context: int, dtype_bytes: int = 2,
               head_bytes: int | None = None, mtp_stored: int | None = None, fp8=None) -> dict:
    """Bytes one decode step of ``batch`` slots ``context`` tokens deep must move at least: ``{"weights", "kv",
    "gdn_state", "total"}``: the weights it touches, the KV it reads, the GDN state it reads and writes. With k > 0
    the k drafts each read the draft head (``head_bytes``, :func:`draft_head_bytes`; None: the LM head) and the MTP
    layer (``mtp_stored``, :func:`mtp_bytes`; None: bfloat16), besides the verify's own reads. ``fp8`` (a
    :class:`jaxmtp.fp8.Fp8Scheme`): the linears it converts count their e4m3 bytes and block scales."""
    leaves = [(jax.tree_util.keystr(p), int(np.prod(s.shape)) * s.dtype.itemsize)
              for p, s in jax.tree_util.tree_leaves_with_path(param_shapes(cfg, jnp.bfloat16, fp8=fp8))]

    def touched(mtp: bool, tokens: int) -> float:
        """Bytes of the main model's (or the MTP head's) weights that ``tokens`` tokens read."""
        total = 0.0
        for name, nbytes in leaves:
            if ("'mtp'" in name) != mtp:
                continue
            if "embed_tokens" in name and not cfg.tie_word_embeddings:
                nbytes = tokens * cfg.hidden_size * dtype_bytes  # gathered rows only
            elif "experts" in name:  # routed experts: expected distinct experts hit by the tokens
                e, top = cfg.num_experts, cfg.num_experts_per_tok
                nbytes = nbytes * (1 - (1 - top / e) ** tokens)
            total += nbytes
        return total

    weights = touched(False, batch * (k + 1))
    if k > 0:  # each draft reads the draft head; the window's pass and k - 1 recursive ones read the MTP layer
        head = head_bytes if head_bytes is not None else cfg.vocab_size * cfg.hidden_size * dtype_bytes
        full = sum(nbytes for name, nbytes in leaves if "'mtp'" in name)
        # int8 MTP weights: the stored share of bf16 bytes, applied to every MTP leaf (an MoE MTP layer's routed
        # experts stay bf16, so there it undercounts them)
        stored = (mtp_stored / full) if mtp_stored is not None and full else 1.0
        # (the window's pass runs the MLP on the accepted row only, so every pass touches the routed experts of
        # `batch` tokens)
        weights += k * head + stored * k * touched(True, batch)
    weights = int(weights)
    n_attn, n_gdn = len(cfg.full_attention_layers), len(cfg.linear_attention_layers)
    kv = batch * n_attn * 2 * cfg.num_key_value_heads * context * cfg.head_dim * dtype_bytes
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    gdn = batch * n_gdn * state * 2  # read + write (a verify commits its accepted prefix: still one state out)
    return {"weights": weights, "kv": kv, "gdn_state": gdn, "total": weights + kv + gdn}


def speedup_bound(step: dict, plain: dict, bw: float) -> dict:
    """What the bytes allow a k-step (``step``, a :func:`step_bytes`-carrying result with ``k`` and ``step_ms``)
    against the plain step of the same batch: ``step_ratio_at_roofline`` (its bytes over the plain step's: the cost
    ratio if both ran at the roofline) and ``tokens_ratio_bound`` (output tokens/s over plain at the published AL if
    the step cost the measured plain step plus its extra bytes at bandwidth ``bw``, and nothing else)."""
    extra_s = max(step["bytes_needed"]["total"] - plain["bytes_needed"]["total"], 0) / bw
    plain_s = plain["step_ms"] / 1e3
    return {"step_ratio_at_roofline": step["bytes_needed"]["total"] / plain["bytes_needed"]["total"],
            "tokens_ratio_bound": PUBLISHED_AL[step["k"]] * plain_s / (plain_s + extra_s)}


# ---------------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------------
def run_metadata(argv: list[str] | None = None) -> dict:
    """What a result file records about its run: date, device, platform, jax and python versions, XLA_FLAGS and the
    command line (``argv``, default ``sys.argv``)."""
    argv = sys.argv if argv is None else argv
    dev = jax.devices()[0]
    return {"date": datetime.date.today().isoformat(), "device": getattr(dev, "device_kind", str(dev)),
            "platform": dev.platform, "jax": jax.__version__, "python": platform.python_version(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "command": " ".join([os.path.basename(argv[0]) if argv else ""] + list(argv[1:]))}


def write_json(path: str, result: dict) -> None:
    """Write ``result`` to ``path`` (indented; values JSON cannot hold are written as their ``str``), through a
    temporary file so that a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)
