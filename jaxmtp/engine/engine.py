"""The host side of the engine: requests, slots, chunked prefill, stops, statistics.

``Engine.step()`` is one scheduling iteration: admit queued requests into free slots, run one prefill chunk for
every request still prefilling (batched), then ``steps_per_sync`` speculative steps in one device loop, and turn
the emitted tokens into :class:`RequestOutput` deltas. Device-to-host traffic per iteration is one transfer of the
loop's outputs (tokens ``[N, slots, k+1]`` int32 plus a few ``[N, slots]`` vectors) and, after a prefill chunk,
the first tokens of the finished prompts.

Thread safety: ``add_request`` and ``abort`` may be called from any thread; ``step`` from one thread at a time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import threading
import time
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxmtp.engine import prefix_cache as _prefix
from jaxmtp.engine import steps
from jaxmtp.engine import warmup as _warmup
from jaxmtp.engine.memory import EngineConfigError, check_fits, device_memory_bytes, memory_plan
from jaxmtp.engine.policy import (default_max_prefill_tokens, default_mid_prompt_prefill, default_num_draft_tokens,
                                  default_prefill_chunk)
from jaxmtp.pallas.backend import platform
from jaxmtp.param_layout import weight_bytes
from jaxmtp.parallel import DP, data_parallel_prefill, device_bytes, state_specs
from jaxmtp.engine.text import IncrementalDetokenizer, StopMatcher, check_stop_strings
from jaxmtp.sampling import SamplingParams, split_seed, stop_id_row

_REASONS = {steps.STOP: "stop", steps.LENGTH: "length"}
_MODES = (False, True, _warmup.FEATURES)  # the step loops' modes: greedy only, sampling, features


@dataclasses.dataclass
class SpecStats:
    """Speculation statistics of one request (or aggregated)."""

    k: int = 0
    steps: int = 0  # verify (or decode) steps the request took part in
    drafted: int = 0  # draft tokens proposed to the target
    accepted: int = 0  # draft tokens accepted
    accepted_per_position: list = dataclasses.field(default_factory=list)  # counts, length k

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.steps if self.steps else 0.0 for a in self.accepted_per_position]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step (1 + accepted drafts per step)."""
        return (self.steps + self.accepted) / self.steps if self.steps else 0.0

    def add(self, accepted: int) -> None:
        self.steps += 1
        self.drafted += self.k
        self.accepted += accepted
        for i in range(min(accepted, self.k)):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict:
        return {"k": self.k, "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_per_position": self.acceptance_per_position,
                "mean_acceptance_length": self.mean_acceptance_length}


@dataclasses.dataclass
class TokenLogprob:
    """An output token's log-probability under the target model and the ``logprobs`` most likely ids with theirs
    (most likely first; :class:`jaxmtp.sampling.SamplingParams`)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class RequestOutput:
    """What one ``step`` produced for a request: new token ids and text, and the final state once finished."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    stats: SpecStats | None = None
    time_to_first_token: float | None = None
    elapsed: float | None = None
    queue_time: float | None = None  # arrival to admission into a slot
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    logprobs: list[TokenLogprob] | None = None  # one per id in token_ids, when the request asked for them
    index: int = 0  # which of the request's ``n`` samples
    # with SamplingParams.prompt_logprobs, in the output that carries the first token: one per prompt token (None for
    # the first, which follows nothing)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class _Request:
    id: str
    prompt: np.ndarray
    params: SamplingParams
    arrival: float
    detok: IncrementalDetokenizer | None = None
    slot: int = -1
    admitted: float | None = None
    prefilled: int = 0  # prompt tokens already run through the target
    cached: int = 0  # prompt tokens restored from the prefix cache
    keys: list | None = None  # the prompt's prefix-cache block keys (PrefixIndex.prompt_keys, set at admission)
    branch: int = 0  # where its prefill publishes a snapshot besides its last boundary (PrefixIndex.branch_point)
    generated: list = dataclasses.field(default_factory=list)
    stats: SpecStats = None
    first_token_time: float | None = None
    stops: StopMatcher | None = None  # the stop strings' matcher (None: no stop strings, or not before min_tokens)
    later_stops: StopMatcher | None = None  # the matcher, held until min_tokens tokens are out
    held: str = ""  # text not streamed yet because it may begin a stop string
    done: bool = False
    reason: str | None = None
    oracle: np.ndarray | None = None  # prompt + reference continuation (oracle drafts)
    index: int = 0  # sample index (SamplingParams.n)
    group: list | None = None  # every sample of the request, index order (None: n = 1)
    waiting: bool = False  # a sample past the first, until the first's prefill is copied into its slot
    prompt_lps: list | None = None  # the prompt's log-probabilities so far (SamplingParams.prompt_logprobs)
    published: int = 0  # the committed length up to which its decode published its state (the prefix cache)


def _set_processing_row(rows: dict, i: int, p: SamplingParams) -> None:
    rows["min_p"][i], rows["repetition_penalty"][i] = p.min_p, p.repetition_penalty
    rows["frequency_penalty"][i], rows["presence_penalty"][i] = p.frequency_penalty, p.presence_penalty
    rows["min_tokens"][i] = p.min_tokens
    for j, (t, v) in enumerate(p.logit_bias):
        rows["bias_ids"][i, j], rows["bias_vals"][i, j] = t, v


def _token_logprobs(lps, at: tuple, ids: list[int], n: int) -> list[TokenLogprob]:
    """The :class:`TokenLogprob` of ``ids`` (positions 0..) at index ``at`` of unpacked logprobs
    (:func:`jaxmtp.engine.steps.unpack_logprobs`), with ``n`` alternatives each."""
    lp, top_ids, top_lp = (a[at] for a in lps)
    return [TokenLogprob(t, float(lp[i]), [(int(a), float(b)) for a, b in zip(top_ids[i, :n], top_lp[i, :n])
                                           if a >= 0]) for i, t in enumerate(ids)]


def _slot_buckets(num_slots: int, smallest: int = 1) -> list[int]:
    """``smallest``, twice that, ... below ``num_slots``, then ``num_slots``."""
    out, b = [], smallest
    while b < num_slots:
        out.append(b)
        b *= 2
    return out + [num_slots]


class Engine:
    """Continuous-batching speculative decoding over a fixed number of slots.

    Args:
        model: a loaded :class:`jaxmtp.Model`.
        num_slots: concurrent requests held on the device.
        max_context: most tokens (prompt + output) per request; default min(8192, the model's maximum).
        num_draft_tokens: k; None picks :func:`jaxmtp.engine.policy.default_num_draft_tokens` (3 for dense models
            with an MTP head up to 64 slots, and for MoE models on the grouped-expert kernel; less for MoE models on the
            XLA path at larger slot counts; 0 without an MTP head).
        prefill_chunk: largest prompt chunk per prefill call (shorter ones use buckets 16, 64, 256, ...); None:
            :func:`jaxmtp.engine.policy.default_prefill_chunk` (1024 on accelerators, 256 on the CPU).
        steps_per_sync: speculative steps per device loop before the host reads tokens.
        max_prefill_batch: prompts prefilled together in one call (under data parallelism: per replica); default
            min(num_slots, 8, max_prefill_tokens // 16).
        max_prefill_tokens: most tokens (rows x chunk, per replica) in one prefill call, >= ``prefill_chunk``; a call
            of several rows takes a shorter chunk to stay within it (SGLang's ``--max-prefill-tokens``); a budget
            below the default chunk lowers that default to it; None:
            :func:`jaxmtp.engine.policy.default_max_prefill_tokens` (2048, or one whole chunk if larger).
        slot_buckets: run each step over the smallest prefix of slots (1, 2, 4, ... num_slots) that holds every busy
            slot, each prefix compiled once (``warmup`` compiles them all); under data parallelism the same prefix
            of every replica's slots; False: always all slots. In the fixed reduction mode the smallest prefix, and
            the fewest rows of a prefill call, is 2 (see ``_fewest_rows``).
        oracle_probs: for tests and benchmarks only: enables :class:`jaxmtp.engine.steps.Oracle` drafts with this
            distribution over the corrupted draft index (length k+1); requests then pass ``oracle_continuation``.
        prefix_cache_memory: bytes of device memory for the prefix cache (:mod:`jaxmtp.engine.prefix_cache`), half
            for KV blocks and half for GDN snapshots; ``"auto"``: half what the memory plan leaves free, at most every
            slot's whole context; 0 (default): off. A request whose prompt begins with an earlier prompt's prefix
            resumes after it with the same tokens (``RequestOutput.num_cached_tokens``).
        prefix_cache_granularity: G, the cached prefixes' unit in tokens (a power of two >= 16; default 256). A
            prompt's chunks end at the boundaries it publishes, so G and ``prefill_chunk`` are independent.
        mid_prompt_prefill: prefill calls in which no prompt ends run a function without the LM head and the first
            token's sampling (:func:`jaxmtp.engine.steps.prefill_chunk` with ``ends_prompts=False``; same state), so
            that the host queues a long prompt's next chunk while the device runs this one; None:
            :func:`jaxmtp.engine.policy.default_mid_prompt_prefill` (on GPUs).
    """

    def __init__(self, model, *, num_slots: int = 8, max_context: int | None = None,
                 num_draft_tokens: int | None = None, prefill_chunk: int | None = None, steps_per_sync: int = 8,
                 max_prefill_batch: int | None = None, check_memory: bool = True, oracle_probs=None,
                 slot_buckets: bool = True, prefix_cache_memory=0, prefix_cache_granularity: int | None = None,
                 max_prefill_tokens: int | None = None, mid_prompt_prefill: bool | None = None):
        cfg = model.config
        if num_draft_tokens is None:
            num_draft_tokens = default_num_draft_tokens(cfg, num_slots, moe_kernel=model.backend.moe != "xla")
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
            raise EngineConfigError(f"num_draft_tokens must be a non-negative integer, got {num_draft_tokens!r}")
        if num_draft_tokens > 0 and not cfg.has_mtp:
            raise EngineConfigError("num_draft_tokens > 0 needs an MTP head, and this checkpoint has none; use 0")
        if num_slots < 1:
            raise EngineConfigError(f"num_slots must be >= 1, got {num_slots}")
        if max_context is None:  # (0 is an error below, not the default)
            max_context = min(8192, cfg.max_position_embeddings)
        if not 2 <= max_context <= cfg.max_position_embeddings:
            raise EngineConfigError(
                f"max_context must be in [2, {cfg.max_position_embeddings}] (the model's max_position_embeddings), "
                f"got {max_context}"
            )
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(platform())
            if max_prefill_tokens:  # a budget below the default chunk takes the chunk down with it
                prefill_chunk = max(16, min(prefill_chunk, 1 << (max_prefill_tokens.bit_length() - 1)))
        if prefill_chunk < 16 or prefill_chunk & (prefill_chunk - 1):
            raise EngineConfigError(f"prefill_chunk must be a power of two >= 16, got {prefill_chunk}")
        if max_prefill_tokens is None:
            max_prefill_tokens = default_max_prefill_tokens(prefill_chunk)
        if max_prefill_tokens < prefill_chunk:
            raise EngineConfigError(f"max_prefill_tokens={max_prefill_tokens} must hold one whole prefill_chunk "
                                    f"({prefill_chunk})")
        if not isinstance(steps_per_sync, int) or steps_per_sync < 1:  # 0 steps would never finish a request
            raise EngineConfigError(f"steps_per_sync must be a positive integer, got {steps_per_sync!r}")
        if max_prefill_batch is not None and not 1 <= max_prefill_batch <= max_prefill_tokens // 16:
            raise EngineConfigError(f"max_prefill_batch must be in [1, {max_prefill_tokens // 16}] (rows of at least "
                                    f"16 tokens within max_prefill_tokens={max_prefill_tokens}), got "
                                    f"{max_prefill_batch}")
        self.model = model
        self.cfg = cfg
        self.k = num_draft_tokens
        self.num_slots = num_slots
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self.steps_per_sync = steps_per_sync
        self.max_prefill_batch = max_prefill_batch or min(num_slots, 8, max_prefill_tokens // 16)
        self.mid_prompt_prefill = (default_mid_prompt_prefill(platform()) if mid_prompt_prefill is None
                                   else bool(mid_prompt_prefill))
        layout = model.layout  # tensor parallelism (jaxmtp.parallel): the device functions run one rank's shapes
        run_cfg = model.run_config
        self.data_parallel = dp = layout.dp if layout is not None else 1
        if num_slots % dp:
            raise EngineConfigError(f"num_slots={num_slots} must be a multiple of data_parallel_size={dp} (each "
                                    "replica holds an equal share of the slots)")
        self.replica_slots = per_replica = num_slots // dp  # slot buckets are prefixes of each replica's slots
        weights = (weight_bytes(model.params) if layout is None
                   else device_bytes(model.params) + layout.workspace_bytes)
        # one device's bytes: a rank's heads and widths, its share of the weights (and collective workspace), its
        # replica's slots
        # KV rows per slot (plan.capacity): max_context + k, in whole blocks where the attention kernel reads blocks
        self.plan = memory_plan(run_cfg, per_replica, max_context, self.k, model.dtype, weights=weights,
                                kv_block=model.backend.policy.kv_row_block(model.backend.attention))
        self.prefix_cache = self._pool = None
        if prefix_cache_memory:
            self._plan_prefix_cache(prefix_cache_memory, prefix_cache_granularity or _prefix.DEFAULT_GRANULARITY,
                                    device_memory_bytes() if check_memory else None)
        self.check_memory = check_memory
        if check_memory:
            check_fits(self.plan, device_memory_bytes())
        if oracle_probs is not None and len(oracle_probs) != self.k + 1:
            raise EngineConfigError(f"oracle_probs needs k + 1 = {self.k + 1} entries")
        init = functools.partial(steps.init_state, slots=num_slots, capacity=self.plan.capacity, k=self.k,
                                 dtype=model.dtype, oracle_probs=oracle_probs)
        if layout is None:
            self.state = init(cfg=cfg)
            state_out = None
        else:  # made in place on the mesh: no device ever holds another rank's carry
            specs = state_specs(jax.eval_shape(lambda: init(cfg=layout.state_config())))
            state_out = jax.tree.map(layout.sharding, specs)
            self.state = jax.jit(lambda: init(cfg=layout.state_config()), out_shardings=state_out)()
        if self.prefix_cache is not None:
            self._make_prefix_pools(layout, None if layout is None else specs, state_out)
        self.eos_ids = model.eos_token_ids
        self.tokenizer = model.tokenizer

        backend = model.backend
        self.trace_counts = collections.Counter()  # how often each device function was traced (= compiled)

        def counted(name, fn):
            def wrapper(*a, **kw):
                self.trace_counts[name] += 1
                return fn(*a, **kw)
            return wrapper

        # slot bookkeeping: elementwise over the slot axis, partitioned by XLA on a sharded state
        slot_jit = functools.partial(jax.jit, donate_argnums=0, out_shardings=state_out)
        self._admit = slot_jit(counted("admit", steps.admit))
        self._deactivate = slot_jit(counted("deactivate", steps.deactivate))
        self._mark_prompt = slot_jit(counted("mark_prompt", steps.mark_prompt))
        self._set_oracle = slot_jit(steps.set_oracle_row)
        if layout is not None:  # the model's functions run inside the mesh's shard_map
            s_spec, rep, per_slot = state_specs(self.state), P(), P(None, DP)  # step outputs [N, slots, ...]

        # outputs: state, then 4 (5 with prompt log-probabilities) arrays
        def prefill_fn(name, prompt_logprobs, ends_prompts=True):
            fn = functools.partial(steps.prefill_chunk, cfg=run_cfg, k=self.k, backend=backend,
                                   prompt_logprobs=prompt_logprobs, ends_prompts=ends_prompts)
            if layout is not None:
                rows = rep
                if dp > 1:  # each replica prefills its own block of rows
                    fn, rows = data_parallel_prefill(fn), P(DP)
                fn = layout.shard_map(fn, (s_spec,) + (rows,) * 5,
                                      (s_spec,) + (rows,) * (5 if prompt_logprobs else 4))
            return jax.jit(counted(name, fn), donate_argnums=1)

        self._prefill = prefill_fn("prefill", False)
        self._prefill_mid = prefill_fn("prefill_mid", False, ends_prompts=False)  # calls where no prompt ends
        # requests with prompt_logprobs: one row at a time, compiled at the first such request (not in the warm-up)
        self._prefill_lp = prefill_fn("prefill+prompt_logprobs", True)
        # Slot-count buckets: with only low slots busy (slots are taken lowest first), a step runs over the smallest
        # power-of-two prefix that holds every active slot, so a lone request does not pay for the whole batch.
        # The fixed reduction mode keeps every layout bit-identical to one device (docs/engine.md, "Reduction
        # modes"); XLA's CPU backend sums a one-row product in another order than the same row among several, so
        # no step or prefill call there runs one row where another layout (a DP replica's share) would run more.
        self._fewest_rows = 2 if layout is not None and layout.collectives.fixed else 1
        self.slot_buckets = _slot_buckets(per_replica, self._fewest_rows) if slot_buckets else [per_replica]
        self._move = slot_jit(counted("move", steps.move_slots))
        self._copy_carries = slot_jit(counted("copy_carries", steps.copy_carries))

        def loop(width, mode):
            name = _warmup.key_name(_warmup.step_key(width, mode))
            if width == per_replica:
                name = "step" + name[name.index("]") + 1:]
            run = steps.run_steps if width == per_replica else functools.partial(steps.run_steps_on_prefix, n=width)
            fn = functools.partial(run, cfg=run_cfg, k=self.k, num_steps=steps_per_sync, backend=backend,
                                   sampling=bool(mode), features=mode == _warmup.FEATURES)
            if layout is not None:
                fn = layout.shard_map(fn, (s_spec,), (s_spec, per_slot))
            return jax.jit(counted(name, fn), donate_argnums=1)

        # Each width three times: greedy only, with sampling, and with the logits processing and log-probabilities
        # (features). The greedy loop has no sampling conditional, whose predicate costs a host round trip inside
        # every plain step on GPUs (docs/engine.md has the measurement); neither of the first two processes logits.
        self._loops = {(w, mode): loop(w, mode) for w in self.slot_buckets for mode in _MODES}
        # what the loops and prefills compute beyond their arguments' shapes: the ahead-of-time store's key
        # (jaxmtp.engine.aot; with the source digest, versions and argument layouts it adds)
        self._identity = ("jaxmtp.Engine", run_cfg, self.k, steps_per_sync, backend, str(jnp.dtype(model.dtype)), dp)
        # Every shape the engine can run (jaxmtp.engine.warmup). After warmup(background=True) the calls use only
        # the compiled ones (``_ready``), substituting a wider bucket or the sampling loop until the rest are done.
        self.executables = self._list_executables()
        self._ready: set = set()
        self._lazy = False
        self.background: _warmup.BackgroundCompiler | None = None
        self.warmup_seconds: float | None = None
        self._warmup_plan: list = []
        self._warmup_t0: float | None = None

        self._lock = threading.RLock()
        self._queue: collections.deque[_Request] = collections.deque()
        self._slots: list[_Request | None] = [None] * num_slots
        self._by_id: dict[str, _Request] = {}
        self._aborted: list[str] = []
        self._ids = itertools.count()
        self.totals = SpecStats(k=self.k, accepted_per_position=[0] * self.k)
        self.num_steps_run = 0
        self.prefilled_tokens = 0  # prompt tokens run through the target (prefix-cache hits and shared samples not)

    def set_oracle_probs(self, probs) -> None:
        """Change the oracle drafter's corruption distribution (k + 1 entries) without recompiling."""
        if self.state.oracle is None or len(probs) != self.k + 1:
            raise EngineConfigError("set_oracle_probs needs an engine built with oracle_probs, and k + 1 entries")
        self.state = self.state.replace(oracle=self.state.oracle.replace(probs=jnp.asarray(probs, jnp.float32)))

    # ---- requests -------------------------------------------------------------------------------------------
    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> np.ndarray:
        """Check a request; returns the prompt as int32. Raises ValueError with a clear message."""
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a jaxmtp.SamplingParams")
        prompt = self.model.check_token_ids(np.asarray(list(prompt_ids)))
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError("the prompt is empty")
        if prompt.size >= self.max_context:
            raise ValueError(
                f"prompt of {prompt.size} tokens does not fit the context of {self.max_context} tokens "
                "(at least one generated token must fit)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        check_stop_strings(params.stop)
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        stop_id_row(params, self.eos_ids)  # raises if stop ids + EOS ids exceed what a slot holds
        if params.n > self.num_slots:
            raise ValueError(f"n={params.n} samples need as many slots, and the engine has {self.num_slots}")
        bad = [t for t, _ in params.logit_bias if t >= self.cfg.vocab_size]
        if bad:
            raise ValueError(f"logit_bias id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        return prompt

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, oracle_continuation: Sequence[int] | None = None,
                    stop_matcher: StopMatcher | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError for invalid input (nothing is queued then).
        ``stop_matcher``: ``StopMatcher(params.stop)`` built beforehand (the server builds it off the event loop)."""
        params = (params or SamplingParams()).with_seed()
        prompt = self.validate(prompt_ids, params)
        if params.stop and self.tokenizer is not None and stop_matcher is None:
            stop_matcher = StopMatcher(params.stop)
        if oracle_continuation is not None and self.state.oracle is None:
            raise ValueError("oracle_continuation needs an engine built with oracle_probs")
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._by_id:
                raise ValueError(f"request id {rid!r} is already in use")
            now, group = time.perf_counter(), []
            for i in range(params.n):  # sample i: seed + i, its own detokeniser and stop matcher
                matcher = stop_matcher if i == 0 else (StopMatcher(params.stop) if stop_matcher else None)
                req = _Request(rid, prompt, params.sample(i), now, index=i, waiting=i > 0,
                               detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None,
                               stops=matcher if params.stop and not params.min_tokens else None,
                               later_stops=matcher if params.stop and params.min_tokens else None,
                               stats=SpecStats(k=self.k, accepted_per_position=[0] * self.k))
                if oracle_continuation is not None:
                    req.oracle = np.concatenate([prompt, np.asarray(oracle_continuation, np.int32)])
                group.append(req)
            if params.n > 1:
                for req in group:
                    req.group = group
            self._by_id[rid] = group[0]
            self._queue.extend(group)
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a queued or running request; its slot is freed at the next step. False if unknown/finished."""
        with self._lock:
            req = self._by_id.get(request_id)
            if req is None or all(m.done for m in req.group or [req]):
                return False
            self._aborted.append(request_id)
            return True

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._queue or self._aborted or any(r is not None for r in self._slots))

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self._slots)

    # ---- one scheduling iteration ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling iteration. An iteration that completes a prompt returns right after the prefill, so the
        first token is not held back by a decode loop (the next iteration decodes)."""
        outputs: dict[tuple, RequestOutput] = {}
        self._handle_aborts(outputs)
        self._admit_queued()
        if self._prefill_once(outputs):
            return list(outputs.values())
        if any(r is not None and r.prefilled == r.prompt.size and not r.done for r in self._slots):
            self._decode(outputs)
        return list(outputs.values())

    def _out(self, outputs, req: _Request) -> RequestOutput:
        key = (req.id, req.index)
        if key not in outputs:
            outputs[key] = RequestOutput(req.id, [], "", num_prompt_tokens=int(req.prompt.size), index=req.index)
        return outputs[key]

    def _handle_aborts(self, outputs):
        with self._lock:
            aborted, self._aborted = self._aborted, []
            for rid in aborted:
                lead = self._by_id.get(rid)
                for req in (lead.group or [lead]) if lead is not None else ():
                    if req.done:
                        continue
                    if req in self._queue:
                        self._queue.remove(req)
                    self._finish(outputs, req, "abort")
        slots = [s for s, r in enumerate(self._slots) if r is not None and r.done]
        self._free(slots)

    def _free(self, slots):
        if not slots:
            return
        ids = np.full((self.num_slots,), self.num_slots, np.int32)
        ids[: len(slots)] = slots
        self.state = self._deactivate(self.state, jnp.asarray(ids))
        for s in slots:
            self._slots[s] = None

    def _mark_prompt_ids(self, r: _Request) -> None:
        """Mark ``r``'s prompt ids in its slot's ``seen`` row, a prefill chunk's worth per call (one shape)."""
        c = self.prefill_chunk
        for start in range(0, r.prompt.size, c):
            ids = np.full((c,), -1, np.int32)
            part = r.prompt[start : start + c]
            ids[: part.size] = part
            self.state = self._mark_prompt(self.state, np.int32(r.slot), jnp.asarray(ids))

    # ---- prefix cache (jaxmtp.engine.prefix_cache) -----------------------------------------------------------
    def _make_prefix_pools(self, layout, specs, state_out) -> None:
        """The prefix cache's device pools, its publication queue and its jitted copies (a save, a save of blocks
        alone, a restore). On a mesh (``specs`` / ``state_out``: the state's partition specs and shardings) the pools
        split over the ranks as the carries they copy and are whole on each replica; under data parallelism the
        copies run in a ``shard_map`` (each replica reads and writes its own slots; a saved entry reaches every
        replica's pool)."""
        g, idx = self.prefix_cache.granularity, self.prefix_cache
        make_pool = functools.partial(_prefix.init_pool, granularity=g, num_blocks=idx.num_blocks,
                                      num_snapshots=idx.num_snapshots)
        save = save_blocks = _prefix.save
        restore = _prefix.restore
        save_out, restore_out = {}, {}
        if layout is None:  # one device: the copies may run the row-copy kernel (jaxmtp.pallas.row_copy)
            save = save_blocks = functools.partial(save, copy=self.model.backend.row_copy)
            restore = functools.partial(restore, copy=self.model.backend.row_copy)
            self._pool = make_pool(self.state)
        else:
            pool_specs = _prefix.pool_specs(jax.eval_shape(lambda: make_pool(self.state)), layout.collectives.axis)
            pool_out = jax.tree.map(layout.sharding, pool_specs)
            self._pool = jax.jit(lambda: make_pool(self.state), out_shardings=pool_out)()
            save_out, restore_out = {"out_shardings": pool_out}, {"out_shardings": state_out}
            if layout.dp > 1:
                def on_replicas(fn, n_args, returns_pool=True):
                    io = (pool_specs, specs) if returns_pool else (specs, pool_specs)
                    return jax.shard_map(functools.partial(fn, dp_axis=DP), mesh=layout.mesh,
                                         in_specs=io + (P(),) * n_args, out_specs=io[0], check_vma=False)

                save, save_blocks = on_replicas(save, 4), on_replicas(save, 2)
                restore = on_replicas(restore, 4, returns_pool=False)
        # A batch holds a prefill call's publications (a snapshot and its missing blocks per row) in one call. XLA's
        # copies gather its unused rows too (fixed shapes), so there the capacity follows the prefill rows; the
        # row-copy kernel's programs for unused rows return at once, so a batch there holds several whole prefixes
        # (fewer calls, each of which costs about half a millisecond of host time to dispatch).
        rows = self.max_prefill_batch * self.data_parallel
        if layout is None and self.model.backend.row_copy != "xla":
            self._publications = _prefix.Publications(max_blocks=max(4 * rows, 256), max_snaps=4 * rows)
        else:
            self._publications = _prefix.Publications(max_blocks=4 * rows, max_snaps=rows)
        # The state is read, not donated: a later call that donates it waits for this one (JAX orders them).
        self._save = jax.jit(save, donate_argnums=0, **save_out)
        self._save_blocks = jax.jit(save_blocks, donate_argnums=0, **save_out)
        self._restore = jax.jit(restore, donate_argnums=0, **restore_out)

    def _plan_prefix_cache(self, memory, granularity: int, available: int | None) -> None:
        """Size the prefix cache's pools to ``memory`` bytes, half for KV blocks and half for GDN snapshots, and add
        them to the memory plan; refuse settings it cannot honour (EngineConfigError). ``"auto"``: half the memory
        the plan leaves within the 90% headroom of ``available`` bytes, at most what every slot's whole context
        takes (a block and a snapshot per G tokens). On a mesh the bytes are one device's: a rank's share of each
        entry, every entry on each data-parallel replica."""
        auto = memory == "auto"
        if granularity < 16 or granularity & (granularity - 1):
            raise EngineConfigError(f"prefix_cache_granularity must be a power of two >= 16, got {granularity}")
        capacity = self.plan.capacity
        # one device's entry: a rank's heads under tensor parallelism (the pools split over the ranks as the carries)
        shapes = jax.eval_shape(lambda: steps.init_state(self.model.run_config, 1, capacity, self.k, self.model.dtype))
        block, snap = _prefix.pool_bytes_per_entry(shapes, granularity)
        if auto:
            most = self.num_slots * (capacity // granularity)  # a block and a snapshot per G tokens of every slot
            half = max(0, int(0.9 * available) - self.plan.total) // 2 if available else most * (block + snap)
            n_blocks, n_snaps = min(most, half // block), min(most, half // snap)
        else:
            n_blocks, n_snaps = int(memory) // 2 // block, int(memory) // 2 // snap
        if min(n_blocks, n_snaps) < 1:
            if auto:
                return
            raise EngineConfigError(f"prefix_cache_memory={memory} bytes holds no entry: half of it must hold a "
                                    f"block of {granularity} tokens ({block} bytes), half a snapshot ({snap} bytes)")
        self.prefix_cache = _prefix.PrefixIndex(granularity, n_blocks, n_snaps)
        self.plan = dataclasses.replace(self.plan, prefix_cache=n_blocks * block + n_snaps * snap)

    def _restore_prefixes(self, new) -> None:
        """Resume each newly admitted request at its longest cached prefix (the slot's KV rows and GDN carries
        copied from the pools; its prefill continues from there). Samples past a group's first (``waiting``: the
        first's prefill is copied into their slots) get their prompt's keys only, which their outputs publish."""
        idx = self.prefix_cache
        max_blocks = (self.max_context + self.k) // idx.granularity
        for r in new:
            r.keys = idx.prompt_keys(r.prompt)  # hashed once: the lookup here, the snapshots its prefill publishes
            if r.waiting:
                continue
            # every position of a prompt_logprobs request must run (it still publishes)
            hit = idx.lookup(r.prompt, r.keys) if r.params.prompt_logprobs is None else None
            r.branch = idx.branch_point(r.prompt, r.keys, hit.tokens if hit else 0)
            if hit is None:
                continue
            blocks = np.zeros((max_blocks,), np.int32)
            blocks[: len(hit.blocks)] = hit.blocks
            self.state = self._restore(self.state, self._pool, np.int32(r.slot), jnp.asarray(blocks),
                                       np.int32(len(hit.blocks)), np.int32(hit.snapshot))
            idx.used(hit)
            r.prefilled = r.cached = hit.tokens

    def _publish_prefix(self, r: _Request, end: int) -> None:
        """After a prompt chunk of ``r`` ended at ``end`` (a multiple of G, before the prompt's end): if ``end`` is
        the prompt's last boundary or its branch point (``r.branch``), hold its blocks and a snapshot keyed by tokens
        0..end-1 and token ``end`` (copies queued after the chunk that filled the slot; :meth:`_flush_publications`
        runs them before any restore reads them)."""
        g = self.prefix_cache.granularity
        if end in (r.branch, len(r.keys) * g):
            self._publish_snapshot(r.keys[: end // g], r.prompt, r.slot)

    def _publish_snapshot(self, keys: list[bytes], seq: np.ndarray, slot: int) -> None:
        """Hold ``slot``'s state at the boundary after ``keys``' blocks of ``seq``, with the token of ``seq`` there:
        the blocks the pool lacks, then the snapshot (unless held already, or the pools have no room)."""
        idx = self.prefix_cache
        next_token = int(seq[len(keys) * idx.granularity])
        idx.follow(keys, seq)
        if idx.has_snapshot(keys[-1], next_token) or not self._save_missing_blocks(keys, slot):
            return
        snap = idx.add_snapshot(keys, next_token)
        if snap is not None:
            self._queue_copy(snapshot=(slot, snap))

    def _queue_copy(self, block=None, snapshot=None) -> None:
        """Queue a copy of ``block`` (slot, start, block id) or ``snapshot`` (slot, snapshot id) into the pools."""
        q = self._publications
        if block is not None:
            if q.blocks_full():  # the blocks alone: the snapshots queued so far go with the site's last call
                self._flush_publications(blocks_only=True)
            q.block(*block)
        else:
            if q.snaps_full():
                self._flush_publications()
            q.snapshot(*snapshot)

    def _flush_publications(self, blocks_only: bool = False) -> None:
        """Run the queued copies (one :func:`prefix_cache.save` call; ``blocks_only``: the blocks', the snapshots
        staying queued): every publishing site ends with this, so nothing queued outlives the state it reads."""
        if self.prefix_cache is None:
            return
        args = self._publications.take(blocks_only)
        if args is None:
            return
        if not blocks_only and args[3]:
            self._pool = self._save(self._pool, self.state, *args)
        else:  # blocks alone: no snapshot row is gathered
            self._pool = self._save_blocks(self._pool, self.state, *args[:2])

    def _save_missing_blocks(self, keys: list[bytes], slot: int) -> bool:
        """Queue copies of ``slot``'s rows of each block of ``keys`` the pool lacks; False if the pool has no room."""
        idx, g = self.prefix_cache, self.prefix_cache.granularity
        for i in idx.missing_blocks(keys):
            block = idx.add_block(keys[i])
            if block is None:
                return False
            self._queue_copy(block=(slot, i * g, block))
        return True

    def _publish_state(self, r: _Request) -> None:
        """With the prefix cache on, after a device loop (``r`` still decoding, or just ended on the device: a stop id
        or its budget): its slot holds exactly its prompt and output but the last token (steps commit what they emit),
        a final state, so hold it for a later prompt that continues the text: whole blocks as for prompts, the rows
        past the last boundary as a block of their own, and a snapshot keyed by every id and the last token
        (:meth:`PrefixIndex.add_tail_snapshot`). The copies are queued (:meth:`_flush_publications`). Not when a
        block of its prompt was evicted since its prefill: under pressure on the pools a request copies each prompt
        block in at most once (copying them again evicted other prompts' blocks, each prompt in turn)."""
        if self.prefix_cache is None:
            return
        idx, g = self.prefix_cache, self.prefix_cache.granularity
        seq = np.concatenate([r.prompt, np.asarray(r.generated, np.int32)])
        length = seq.size - 1  # positions the target consumed; seq[length] is the slot's ``last``
        m = length // g
        if length < 1 or (m + (length % g > 0)) * g > self.max_context + self.k:
            return  # no whole tail block fits the slot's rows past the last boundary
        keys = _prefix.block_keys(seq, g, m, known=r.keys)  # the prompt's blocks are hashed already
        if any(i < len(r.keys) for i in idx.missing_blocks(keys)):
            return
        if length % g == 0:  # on the grid: a snapshot as a prompt's
            self._publish_snapshot(keys, seq, r.slot)
            return
        idx.follow(keys, seq)
        if not self._save_missing_blocks(keys, r.slot):
            return
        ids = idx.add_tail_snapshot(keys, seq[m * g : length], seq[length])
        if ids is None:
            return
        snap, block = ids
        self._queue_copy(block=(r.slot, m * g, block))
        self._queue_copy(snapshot=(r.slot, snap))

    def _publish_decoding(self, width: int) -> None:
        """After a device loop: each request still decoding whose committed length crossed a multiple of G since it
        last published holds its state (:meth:`_publish_state`), so a later prompt that continues its text resumes
        there even when the request ends off the device (a stop string, an abort) or is still running."""
        g = self.prefix_cache.granularity
        for r in (self._slots[s] for s in self._columns(width)):
            if r is None or r.done or r.waiting:
                continue
            length = len(r.prompt) + len(r.generated) - 1  # committed: every emitted token but the last
            if length // g > max(r.published, len(r.prompt) - 1) // g:
                self._publish_state(r)
                r.published = length

    def prefix_cache_stats(self) -> dict | None:
        """The prefix cache's counters (queried / hit prompt tokens, evictions, blocks and snapshots held) and its
        pools' bytes; None when it is off."""
        if self.prefix_cache is None:
            return None
        return {**self.prefix_cache.stats(), "pool_bytes": self.plan.prefix_cache,
                "granularity": self.prefix_cache.granularity}

    def _admit_queued(self):
        free = [s for s, r in enumerate(self._slots) if r is None]
        new = []
        per = self.replica_slots
        busy = collections.Counter(s // per for s, r in enumerate(self._slots) if r is not None)
        with self._lock:
            while free and self._queue:
                if len(self._queue[0].group or ()) > len(free):  # a request's samples enter together
                    break
                for _ in range(len(self._queue[0].group or [0])):
                    req = self._queue.popleft()
                    # the least busy replica's lowest free slot (slot buckets step the busy prefix)
                    req.slot = min(free, key=lambda s: (busy[s // per], s))
                    free.remove(req.slot)
                    busy[req.slot // per] += 1
                    req.admitted = time.perf_counter()
                    self._slots[req.slot] = req
                    new.append(req)
        if not new:
            return
        b = self.num_slots
        slots = np.full((b,), b, np.int32)
        max_gen = np.zeros((b,), np.int32)
        temp, top_p = np.zeros((b,), np.float32), np.ones((b,), np.float32)
        top_k, lo, hi = np.zeros((b,), np.int32), np.zeros((b,), np.uint32), np.zeros((b,), np.uint32)
        stops = np.full((b, len(stop_id_row(SamplingParams(), ()))), -1, np.int32)
        proc = steps.neutral_processing(b)
        for i, r in enumerate(new):
            p = r.params
            slots[i] = r.slot
            max_gen[i] = min(p.max_new_tokens, self.max_context - r.prompt.size)
            temp[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
            lo[i], hi[i] = split_seed(p.seed)
            stops[i] = stop_id_row(p, self.eos_ids)
            _set_processing_row(proc, i, p)
        self.state = self._admit(self.state, *map(jnp.asarray, (slots, max_gen, temp, top_k, top_p, lo, hi, stops)),
                                 {name: jnp.asarray(v) for name, v in proc.items()})
        for r in new:  # the repetition penalty's prompt half: the whole prompt, cached prefix included
            if r.params.repetition_penalty != 1.0:
                self._mark_prompt_ids(r)
        if self.prefix_cache is not None:
            self._restore_prefixes(new)
        self._fork_samples()
        if self.state.oracle is not None:
            cap = self.state.oracle.seq.shape[1]
            for r in new:
                row = np.full((cap,), -1, np.int32)
                if r.oracle is not None:
                    row[: min(cap, r.oracle.size)] = r.oracle[:cap]
                self.state = self._set_oracle(self.state, r.slot, jnp.asarray(row))

    def _prefill_once(self, outputs) -> bool:
        """One chunk for every prefilling request; True if some prompt finished (its first token is out)."""
        pending = [r for r in self._slots if r is not None and r.prefilled < self._prefill_end(r) and not r.done]
        alone = [r for r in pending if r.params.prompt_logprobs is not None]  # one row each, logits at every position
        pending = [r for r in pending if r.params.prompt_logprobs is None]
        completed = False
        batch = self._prefill_rows_limit()
        # up to `batch` rows per data-parallel replica in each call
        mine = [[r for r in pending if r.slot // self.replica_slots == d] for d in range(self.data_parallel)]
        calls = max(-(-len(m) // batch) for m in mine)
        groups = [[r for m in mine for r in m[i * batch : (i + 1) * batch]] for i in range(calls)]
        groups += [[r] for r in alone]
        for group in groups:
            completed |= self._prefill_group(group, outputs)
        self._fork_samples()
        return completed

    def _add_prompt_logprobs(self, r: _Request, lps, end: int, row: int) -> None:
        """Record the prompt log-probabilities of a chunk of ``r`` (prefill row ``row``) that ended at ``end``:
        position p's are those of prompt token p + 1 (the last prompt position's belong to the first output token,
        not kept)."""
        if r.prompt_lps is None:
            r.prompt_lps = [None]  # the first prompt token follows nothing
        start = len(r.prompt_lps) - 1
        ids = [int(t) for t in r.prompt[start + 1 : min(end + 1, r.prompt.size)]]
        r.prompt_lps += _token_logprobs(lps, (row,), ids, r.params.prompt_logprobs)

    def _prefill_end(self, r: _Request) -> int:
        """How far ``r``'s prompt prefills now: all of it; for the first of n samples while the others wait, all
        but the last token (then copied into their slots); for the others, nothing before that copy."""
        if r.waiting:
            return r.prefilled
        if r.group and any(m.waiting for m in r.group):
            return r.prompt.size - 1
        return r.prompt.size

    def _fork_samples(self) -> None:
        """Copy the first sample's prefill (all but the last prompt token) into the slots of the others, which
        then prefill that token and draw their own first token."""
        for lead in [r for r in self._slots if r is not None and r.group and r.index == 0]:
            waiting = [m for m in lead.group if m.waiting and m.slot >= 0]
            if not waiting or lead.prefilled < lead.prompt.size - 1 or lead.done:
                continue
            dst = np.full((self.num_slots,), self.num_slots, np.int32)
            dst[: len(waiting)] = [m.slot for m in waiting]
            self.state = self._copy_carries(self.state, np.int32(lead.slot), jnp.asarray(dst))
            for m in waiting:
                m.waiting, m.prefilled = False, lead.prefilled

    def _bucket(self, n: int, lo: int, hi: int) -> int:
        b = lo
        while b < n and b < hi:
            b *= 2
        return min(b, hi)

    def _chunk_bucket(self, n: int, rows: int = 1) -> int:
        """Prompt chunk lengths: 16, 64, 256, ... (x4) capped at prefill_chunk: few compiled shapes; for a call of
        ``rows`` rows, the longest bucket within ``max_prefill_tokens / rows`` at most."""
        cap = max(16, min(self.prefill_chunk, self.max_prefill_tokens // rows))
        b = 16
        while b < n and b < self.prefill_chunk and min(b * 4, self.prefill_chunk) <= cap:
            b *= 4
        return min(b, self.prefill_chunk)

    def _prefill_group(self, group, outputs):
        limit = {id(r): self._prefill_end(r) for r in group}
        # under data parallelism each replica takes a block of `rows` rows, its requests first
        replica = [r.slot // self.replica_slots for r in group]
        rows, chunk = self._prefill_shape(max(collections.Counter(replica).values()),
                                          max(min(self.prefill_chunk, limit[id(r)] - r.prefilled) for r in group))
        # the executable compiled (or loaded) for this shape, else the jitted function (traced at this call)
        general = self.executables[_warmup.prefill_key(rows, chunk)]
        prefill = general.compiled or self._prefill
        mid = self.executables.get(_warmup.prefill_mid_key(rows, chunk))  # for a call in which no prompt ends
        row_of, taken = [], collections.Counter()
        for d in replica:
            row_of.append(d * rows + taken[d])
            taken[d] += 1
        rows *= self.data_parallel
        slots = np.full((rows,), self.num_slots, np.int32)
        tokens = np.zeros((rows, chunk), np.int32)
        positions = np.full((rows, chunk), -1, np.int32)
        nxt = np.zeros((rows, chunk), np.int32)
        final = np.zeros((rows,), bool)
        ends = []
        for i, r in zip(row_of, group):
            start = r.prefilled
            n = min(chunk, limit[id(r)] - start)
            if self.prefix_cache is not None:
                g = self.prefix_cache.granularity
                if start % g:  # resumed off the grid
                    n = min(n, g - start % g)
                # end the chunk where the prompt publishes a snapshot (taken of the state a chunk ends with)
                n = min([n] + [p - start for p in (r.branch, len(r.keys or ()) * g) if start < p < start + n])
            slots[i] = r.slot
            tokens[i, :n] = r.prompt[start : start + n]
            positions[i, :n] = np.arange(start, start + n)
            follow = r.prompt[start + 1 : start + n + 1]
            nxt[i, : follow.size] = follow
            final[i] = start + n == r.prompt.size
            r.prefilled += n
            self.prefilled_tokens += n
            ends.append(start + n)
        args = (self.model.params, self.state, *map(jnp.asarray, (slots, tokens, positions, nxt, final)))
        if mid is not None and not final.any() and (mid.compiled is not None or (general.compiled is None
                                                                                 and not self._lazy)):
            # no prompt ends here: the call without the head (compiled, or traced now where the general shape
            # would be too: never a compile where a compiled substitute exists)
            prefill = mid.compiled or self._prefill_mid
        if group[0].params.prompt_logprobs is not None:  # a group of one (_prefill_once)
            self.state, first, finished, reason, logprobs, prompt_lps = self._prefill_lp(*args)
            self._add_prompt_logprobs(group[0], steps.unpack_logprobs(np.asarray(prompt_lps)), ends[0], row_of[0])
        else:
            self.state, first, finished, reason, logprobs = prefill(*args)
        if self.prefix_cache is not None:
            for r, end, fin in zip(group, ends, final[row_of]):
                if not fin and end % self.prefix_cache.granularity == 0:
                    self._publish_prefix(r, end)
        if not final.any():
            self._flush_publications()
            return False
        first, finished, reason = np.asarray(first), np.asarray(finished), np.asarray(reason)
        if any(r.params.logprobs is not None for r in group):
            lps = steps.unpack_logprobs(np.asarray(logprobs))
        now = time.perf_counter()
        done_slots = []
        for i, r in zip(row_of, group):
            if not final[i]:
                continue
            r.first_token_time = now
            if r.prompt_lps is not None:
                self._out(outputs, r).prompt_logprobs = r.prompt_lps
            self._emit(outputs, r, [int(first[i])],
                       None if r.params.logprobs is None else _token_logprobs(lps, (i,), [int(first[i])],
                                                                              r.params.logprobs))
            if finished[i] and not r.done:
                self._finish(outputs, r, _REASONS[int(reason[i])])
                self._publish_state(r)
            if r.done:
                done_slots.append(r.slot)
        self._flush_publications()
        self._free(done_slots)
        return True

    def _columns(self, width: int) -> list[int]:
        """The slots a loop over slot bucket ``width`` steps, in its output columns' order: slots ``0 .. width-1`` of
        each data-parallel replica, replica by replica."""
        per = self.replica_slots
        return [d * per + j for d in range(self.data_parallel) for j in range(width)]

    def _pack_slots(self) -> int:
        """With slot buckets: move busy requests from slots past the smallest bucket that could hold them all into
        free slots below it (one device copy of those slots' state), in each data-parallel replica. Returns the
        bucket width to step over."""
        per = self.replica_slots
        busy = [[j for j in range(per) if (r := self._slots[d * per + j]) is not None and not r.done]
                for d in range(self.data_parallel)]
        covering = next(b for b in self.slot_buckets if b > max(bl[-1] if bl else 0 for bl in busy))  # as they stand
        width = next(b for b in self.slot_buckets if b >= max(1, *map(len, busy)))  # after packing
        if width == covering:
            return width
        movers, free = [], []
        for d, bl in enumerate(busy):
            m = [d * per + j for j in bl if j >= width]
            f = [d * per + j for j in range(width) if self._slots[d * per + j] is None][: len(m)]
            if len(f) < len(m):  # slots of finished requests not yet freed: step over what is busy
                return covering
            movers, free = movers + m, free + f
        src = np.full((self.num_slots,), self.num_slots, np.int32)
        dst = np.full((self.num_slots,), self.num_slots, np.int32)
        src[: len(movers)], dst[: len(movers)] = movers, free
        self.state = self._move(self.state, jnp.asarray(src), jnp.asarray(dst))
        for a, b in zip(movers, free):
            req = self._slots[a]
            req.slot, self._slots[b], self._slots[a] = b, req, None
        return width

    def device_loop(self, width: int | None = None, sampling: bool | None = None, ready_only: bool = False):
        """The jitted loop of ``steps_per_sync`` steps over slots ``0 .. width-1`` of each data-parallel replica (a
        slot bucket; default all; output columns in :meth:`_columns` order):
        ``(params, state) -> (state, outputs)``. ``sampling`` None: with sampling if a busy slot among them has
        temperature > 0, else greedy only (benchmarks and profiles call it as the engine does). ``ready_only``:
        while a background warm-up runs, a compiled loop that serves these slots (:meth:`_loop_for`)."""
        return self._loops[self._loop_key(width, sampling, ready_only)]

    def _loop_key(self, width: int | None, sampling, ready_only: bool) -> tuple:
        """(width, mode) of :meth:`device_loop`'s loop."""
        width = self.replica_slots if width is None else width
        if sampling is None:
            busy = [r.params for s in self._columns(width) if (r := self._slots[s]) is not None and not r.done]
            sampling = (_warmup.FEATURES if any(p.processes_logits for p in busy)
                        else any(p.temperature > 0 for p in busy))
        if ready_only:
            width, sampling = self._loop_for(width, sampling)
        return width, sampling

    # ---- compiled shapes and their substitutes (jaxmtp.engine.warmup) ---------------------------------------
    def _list_executables(self) -> dict:
        ex = {}
        rows = 1
        while True:
            chunk = 16
            while True:
                key = _warmup.prefill_key(rows, chunk)
                ex[key] = _warmup.Executable(key, self._prefill, _warmup.prefill_args(rows * self.data_parallel,
                                                                                         chunk, self.num_slots),
                                             identity=(self._identity, key))
                if chunk >= self._chunk_bucket(self.prefill_chunk, rows):
                    if self.mid_prompt_prefill:  # a prompt's chunks before its last are whole ones: this shape
                        key = _warmup.prefill_mid_key(rows, chunk)
                        ex[key] = _warmup.Executable(
                            key, self._prefill_mid, _warmup.prefill_args(rows * self.data_parallel, chunk,
                                                                         self.num_slots),
                            identity=(self._identity, key))
                    break
                chunk = self._chunk_bucket(chunk + 1, rows)
            if rows >= self.max_prefill_batch:
                break
            rows = self._bucket(rows + 1, 1, self.max_prefill_batch)
        for (w, mode), fn in self._loops.items():
            key = _warmup.step_key(w, mode)
            ex[key] = _warmup.Executable(key, fn, tuple, identity=(self._identity, key))
        return ex

    def _loop_for(self, width: int, mode) -> tuple[int, object]:
        """A compiled loop for slots ``0 .. width-1``: the narrowest ready bucket at least as wide, each mode's
        loop serving its own slots and those of the modes before it (a feature loop with neutral settings decodes
        as the sampling loop, which decodes greedy slots as the greedy loop). Not lazy: exactly (width, mode)."""
        if not self._lazy or _warmup.step_key(width, mode) in self._ready:
            return width, mode
        serving = _MODES[_MODES.index(mode):] if mode != _warmup.FEATURES else (mode,)
        for w in self.slot_buckets:
            if w >= width:
                for m in serving:
                    if _warmup.step_key(w, m) in self._ready:
                        return w, m
        return width, mode  # nothing compiled yet: the call compiles it

    def _prefill_rows_limit(self) -> int:
        """Prompts prefilled together: the most rows of a compiled prefill while a background warm-up runs."""
        if not self._lazy:
            return self.max_prefill_batch
        rows = [k[1] for k in tuple(self._ready) if k[0] == "prefill"]  # a copy: the background thread adds keys
        return max(rows) if rows else self.max_prefill_batch

    def _prefill_shape(self, n_rows: int, n_tokens: int) -> tuple[int, int]:
        """(rows, chunk) of the prefill call for ``n_rows`` prompts whose longest remaining part (capped at the
        chunk) is ``n_tokens``: the buckets; while a background warm-up runs, the compiled shape with the fewest
        padded tokens among those with enough rows (a shorter chunk splits the prompts, a longer one pads)."""
        rows = self._bucket(n_rows, min(self._fewest_rows, self.max_prefill_batch), self.max_prefill_batch)
        chunk = self._chunk_bucket(n_tokens, rows)
        if not self._lazy or _warmup.prefill_key(rows, chunk) in self._ready:
            return rows, chunk
        ready = [(k[1], k[2]) for k in tuple(self._ready) if k[0] == "prefill" and k[1] >= rows]
        if not ready:
            return rows, chunk
        fits = [rc for rc in ready if rc[1] >= chunk]
        return min(fits, key=lambda rc: (rc[1], rc[0])) if fits else max(ready, key=lambda rc: (rc[1], -rc[0]))

    def _decode(self, outputs):
        width = self._pack_slots() if len(self.slot_buckets) > 1 else self.replica_slots
        key = self._loop_key(width, None, True)
        loop = self.executables[_warmup.step_key(*key)].compiled or self._loops[key]
        self.state, out = loop(self.model.params, self.state)
        out = jax.device_get(out)
        self.num_steps_run += self.steps_per_sync
        done_slots = []
        lps = steps.unpack_logprobs(out["logprobs"]) if "logprobs" in out else None
        for step in range(self.steps_per_sync):
            for s, slot in enumerate(self._columns(width)):  # s: the output column
                r = self._slots[slot]
                if r is None or r.done or not out["was_active"][step, s]:
                    continue
                n = int(out["n_emit"][step, s])
                accepted = min(int(out["accepted"][step, s]), max(n - 1, 0))
                r.stats.add(accepted)
                self.totals.add(accepted)
                ids = out["tokens"][step, s, :n].tolist()
                self._emit(outputs, r, ids, None if r.params.logprobs is None else
                           _token_logprobs(lps, (step, s), ids, r.params.logprobs))
                if out["finished"][step, s] and not r.done:
                    self._finish(outputs, r, _REASONS[int(out["reason"][step, s])])
                    self._publish_state(r)
        if self.prefix_cache is not None:
            self._publish_decoding(width)
            self._flush_publications()
        for s, r in enumerate(self._slots):
            if r is not None and r.done:
                done_slots.append(s)
        self._free(done_slots)

    def _emit(self, outputs, req: _Request, ids: list[int], logprobs: list | None = None):
        """Record new tokens (and their :class:`TokenLogprob`, when asked for); stream their text, holding back any
        tail that may begin a stop string. The work is proportional to the new tokens and text (and the held-back
        tail), not to the output so far. Stop strings are looked for once ``min_tokens`` tokens are out."""
        if req.done or not ids:
            return
        o = self._out(outputs, req)
        if logprobs is not None and o.logprobs is None:
            o.logprobs = []
        delta = req.detok.add(ids) if req.detok is not None else ""
        if req.later_stops is not None and len(req.generated) + len(ids) >= req.params.min_tokens:
            req.stops, req.later_stops = req.later_stops, None  # from the text after these tokens on
            delta_for_stops = ""
        else:
            delta_for_stops = delta
        hit = req.stops.feed(delta_for_stops) if req.stops is not None and delta_for_stops else None
        if hit is None:
            req.generated.extend(ids)
            o.token_ids.extend(ids)
            if logprobs is not None:
                o.logprobs.extend(logprobs)
            text = req.held + delta
            safe = len(text) - (req.stops.held if req.stops is not None else 0)
            o.text += text[:safe]
            req.held = text[safe:]
            return
        # A stop string: the text ends before it; the ids end with the token that completes it.
        end, length = hit
        o.text += (req.held + delta)[: len(req.held) + end - length]
        req.held = ""
        keep = max(req.detok.tokens_covering(req.detok.n_chars - len(delta) + end), len(req.generated))
        new_ids = req.detok.ids[len(req.generated) : keep]
        req.generated.extend(new_ids)
        o.token_ids.extend(new_ids)
        if logprobs is not None:  # the ids end at the token that completes the stop string: a prefix of ``ids``
            o.logprobs.extend(logprobs[: len(new_ids)])
        self._finish(outputs, req, "stop", flush=False)

    def _finish(self, outputs, req: _Request, reason: str, flush: bool = True):
        o = self._out(outputs, req)
        if flush and req.detok is not None:
            o.text += req.held + req.detok.flush()
            req.held = ""
        req.done, req.reason = True, reason
        now = time.perf_counter()
        o.finished, o.finish_reason = True, reason
        o.num_generated_tokens = len(req.generated)
        o.stats = req.stats
        o.time_to_first_token = (req.first_token_time - req.arrival) if req.first_token_time else None
        o.elapsed = now - req.arrival
        o.queue_time = (req.admitted if req.admitted is not None else now) - req.arrival
        o.num_cached_tokens = req.cached
        with self._lock:
            if all(m.done for m in req.group or [req]):
                self._by_id.pop(req.id, None)

    # ---- warm-up --------------------------------------------------------------------------------------------
    def warmup(self, compile_threads: int | None = None, *, background: bool = False, progress: bool = False,
               keys=None) -> float:
        """Compile the device functions (prefill buckets, the step loops) with no effect on the state; returns the
        seconds until the engine can serve. Each executable's time is logged (``jaxmtp.engine``) and kept in
        :attr:`executables`; ``progress`` draws compiled n of m, elapsed and ETA on stderr.

        ``background``: compile only :func:`jaxmtp.engine.warmup.serving_keys` now (a sampling loop over all slots,
        a one-row prefill) and the rest in a daemon thread (:attr:`background`) while no request is in the engine;
        meanwhile steps and prefills run on compiled substitutes, with the same tokens. ``keys``: compile just these (e.g. what one request needs).

        The compiles run ``compile_threads`` at a time (default: one per CPU core, at most 8): each function is
        lowered (traced) in its thread and XLA compiles in parallel; the calls that follow find it compiled. If a
        compile fails there (concurrent autotuning can run out of device memory beside a large model), a warning
        says so and the calls compile what is left one at a time, as they would without threads."""
        t0 = time.perf_counter()
        if keys is None:  # the feature loops compile in the background, or at the first request needing one
            keys = (_warmup.serving_keys(self.slot_buckets, self.prefill_chunk) if background
                    else [k for k in self.executables if not (k[0] == "step" and k[2] == _warmup.FEATURES)])
        todo = [self.executables[k] for k in keys if not self.executables[k].ready]
        self._warmup_plan, self._warmup_t0, self.warmup_seconds = list(keys), t0, None
        workers = compile_threads or min(8, os.cpu_count() or 1)
        bookkeeping = self._bookkeeping_calls()
        # slot moves, the samples' copy and the prefix cache's restore (nothing can hit before a first request has
        # published) are not in a first request's path: compiled after SERVING
        later = []
        if background:
            later_fns = (self._move, self._copy_carries, getattr(self, "_restore", None))
            later = [c for c in bookkeeping if c[0] in later_fns]
            bookkeeping = [c for c in bookkeeping if c not in later]
        errors = _warmup.compile_all(todo, self.model.params, self.state, threads=workers, progress=progress,
                                     extra=[(fn, args()) for fn, args, _ in bookkeeping])
        if errors:
            e = errors[0]
            warnings.warn(f"compiling {workers} functions at a time failed ({type(e).__name__}: {str(e)[:200]}); "
                          "compiling the rest one at a time", RuntimeWarning, stacklevel=2)
        out = ()
        for ex in [self.executables[k] for k in keys]:  # one whose threaded compile failed compiles at a dummy call
            if ex.compiled is not None:
                self._ready.add(ex.key)
                continue
            t = time.perf_counter()
            self.state, *out = ex(self.model.params, self.state, *ex.args())
            if not ex.ready:  # its threaded compile failed: this call compiled it
                jax.block_until_ready(out)
                ex.seconds, ex.phase = time.perf_counter() - t, _warmup.BEFORE_SERVING
            self._ready.add(ex.key)
        for fn, args, returns in bookkeeping:  # compiled above: each called once on ids past the slots (no effect)
            setattr(self, "_pool" if returns == "pool" else "state", fn(*args()))
        jax.block_until_ready(self.state.length)
        self._plan_prefill_activations()
        self.warmup_seconds = time.perf_counter() - t0
        rest = [ex for ex in self.executables.values() if not ex.ready]
        if background and (rest or later):
            self._lazy = True
            order = _warmup.background_order([ex.key for ex in rest], self.slot_buckets)
            # Lowering needs only the shapes of params and state: the thread reads them as they stand.
            self.background = _warmup.BackgroundCompiler(
                [self.executables[k] for k in order], lambda: (self.model.params, self.state),
                self._ready.add, idle=lambda: not self.has_work(),
                extra=[(fn, args) for fn, args, _ in later]).start()
        return self.warmup_seconds

    def _plan_prefill_activations(self) -> None:
        """Put the temporaries of the engine's most demanding prefill call into the memory plan: read from each
        compiled prefill executable (XLA's own figure), and for a shape not compiled yet (a background warm-up)
        estimated as rows x the persistent bytes of a slot (a call of several rows gathers each row's carries: KV
        rows, GDN states) + its tokens x the per-token temporaries of the longest one-row call compiled. Measured on
        an H200 at 4B shapes, 8 slots x 8192 tokens (docs/engine.md, "Prefill"), the estimate is 4-23% above XLA's
        figure for every shape of several rows (one row of a shorter chunk it underestimates, but the longer chunk
        measured bounds it). Raises EngineConfigError if the plan no longer fits the device."""
        shapes = [key for key in self.executables if key[0] in ("prefill", "prefill_mid")]
        temps = {key: _warmup.temp_bytes(self.executables[key].compiled) for key in shapes
                 if self.executables[key].compiled is not None}
        temps = {key: t for key, t in temps.items() if t is not None}
        one_row = [(key[2], t) for key, t in temps.items() if key[1] == 1]
        if not one_row:
            return
        chunk, temp = max(one_row)
        per_token = temp / chunk

        def estimate(rows, chunk):
            return int((rows > 1) * rows * self.plan.persistent_per_slot + rows * chunk * per_token)

        need = max(temps[key] if key in temps else estimate(key[1], key[2]) for key in shapes)
        self.plan = dataclasses.replace(self.plan, prefill_activations=need)
        if self.check_memory:
            try:
                check_fits(self.plan, device_memory_bytes())
            except EngineConfigError as e:
                raise EngineConfigError(f"{e}\na prefill call needs up to {need / 2**20:.0f} MiB of temporaries: "
                                        "lower max_prefill_batch (--max-prefill-batch), max_prefill_tokens "
                                        "(--max-prefill-tokens) or the slots") from None

    def _bookkeeping_calls(self) -> list[tuple]:
        """The small functions every request uses (slot moves, the samples' copy, the prefix cache's copies,
        admission), each as ``(jitted function, args() on the current state and pool, "state" or "pool": what it
        returns)``, on ids past the slots and pools or with nothing to copy: calling them changes nothing."""
        n = self.num_slots
        none, no_slot = jnp.full((n,), n, jnp.int32), np.int32(n)
        zi, zf = jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.float32)
        calls = []
        if len(self.slot_buckets) > 1:
            calls.append((self._move, lambda: (self.state, none, none), "state"))
        calls.append((self._copy_carries, lambda: (self.state, np.int32(0), none), "state"))
        if self.prefix_cache is not None:
            idx = self.prefix_cache
            blocks = jnp.zeros(((self.max_context + self.k) // idx.granularity,), jnp.int32)
            q = self._publications
            calls += [
                (self._save, lambda: (self._pool, self.state, q.blocks, np.int32(0), q.snaps, np.int32(0)), "pool"),
                (self._save_blocks, lambda: (self._pool, self.state, q.blocks, np.int32(0)), "pool"),
                (self._restore, lambda: (self.state, self._pool, no_slot, blocks, np.int32(0), np.int32(0)), "state")]
        processing = {name: jnp.asarray(v) for name, v in steps.neutral_processing(n).items()}
        stops = jnp.full((n, self.state.stop_ids.shape[1]), -1, jnp.int32)
        calls += [(self._deactivate, lambda: (self.state, none), "state"),
                  (self._admit, lambda: (self.state, none, zi, zf, zi, zf + 1, zi.astype(jnp.uint32),
                                         zi.astype(jnp.uint32), stops, processing), "state"),
                  (self._mark_prompt, lambda: (self.state, no_slot, jnp.full((self.prefill_chunk,), -1, jnp.int32)),
                   "state")]
        return calls

    def keys_for_request(self, prompt_len: int, sampling) -> list[tuple]:
        """The executables (``warmup(keys=...)``) one request runs alone in the engine: its prompt's one-row
        prefill chunks (the mid-prompt program for those before the last, where the engine has it) and the step loop
        of the narrowest slot bucket (``sampling``: a loop mode, False for greedy only, True with sampling,
        :data:`jaxmtp.engine.warmup.FEATURES` with logits processing)."""
        keys, left = [], prompt_len
        while left > 0:
            chunk = self._chunk_bucket(min(self.prefill_chunk, left))
            mid = _warmup.prefill_mid_key(1, chunk)
            keys.append(mid if left > chunk and mid in self.executables else _warmup.prefill_key(1, chunk))
            left -= min(chunk, left)
        keys.append(_warmup.step_key(self.slot_buckets[0], sampling))
        return list(dict.fromkeys(keys))

    def warmup_status(self) -> dict:
        """Where the warm-up stands: ``planned`` / ``done`` executables of the (last) :meth:`warmup` call and its
        ``seconds`` (so far, or in all once it returned); ``compiled`` of the ``total`` the engine can run, and
        each compiled one (name, seconds, phase, cache use)."""
        exs = list(self.executables.values())
        ready = [ex for ex in exs if ex.ready]
        seconds = self.warmup_seconds
        if seconds is None:
            seconds = 0.0 if self._warmup_t0 is None else time.perf_counter() - self._warmup_t0
        return {"planned": len(self._warmup_plan), "done": sum(self.executables[k].ready for k in self._warmup_plan),
                "seconds": seconds, "compiled": len(ready), "total": len(exs),
                "executables": [ex.as_dict() for ex in ready]}

    def stop_background_compiles(self) -> None:
        """End the background warm-up after the compile in progress (the engine goes on with what is compiled)."""
        if self.background is not None:
            self.background.stop()
