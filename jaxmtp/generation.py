"""``jaxmtp.generate``: the library call (and ``python -m jaxmtp``, its command-line form).

    results = jaxmtp.generate(model_or_path, prompts, max_new_tokens=..., temperature=0.0, top_k=0, top_p=1.0,
                              seed=None, num_draft_tokens=None, stop=None, logprobs=None, n=1, ...)

``prompts`` is a string, a list of token ids, a list of chat messages (``{"role", "content"}`` dicts, rendered with
the checkpoint's chat template), or a list of those (a batch). A single prompt gives a single
:class:`GenerationResult`, a batch a list. With ``n`` > 1 samples per prompt, each prompt's result is a list of
``n`` GenerationResults (sample order). ``generate_stream`` yields :class:`StreamChunk` s as tokens are accepted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Iterator, Sequence

import numpy as np

from jaxmtp.engine.engine import Engine, RequestOutput, SpecStats, TokenLogprob
from jaxmtp.loaded_model import Model, load
from jaxmtp.sampling import SamplingParams


@dataclasses.dataclass
class GenerationResult:
    text: str | None
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]
    stats: dict
    logprobs: list[TokenLogprob] | None = None  # one per token id, when ``logprobs`` was set

    def __str__(self) -> str:
        return self.text if self.text is not None else str(self.token_ids)


@dataclasses.dataclass
class StreamChunk:
    index: int  # which prompt of the batch
    token_ids: list[int]
    text: str
    finished: bool = False  # this sample of this prompt ended
    finish_reason: str | None = None
    stats: dict | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when ``logprobs`` was set
    sample: int = 0  # which of the prompt's ``n`` samples


# ---- prompts ---------------------------------------------------------------------------------------------------
def _is_chat(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(m, dict) for m in p)


def _is_ids(p) -> bool:
    return isinstance(p, (list, tuple, np.ndarray)) and len(p) > 0 and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p)


def normalize_prompts(prompts) -> tuple[list, bool]:
    """Returns (list of single prompts, whether the input was a batch)."""
    if isinstance(prompts, str) or _is_ids(prompts) or _is_chat(prompts):
        return [prompts], False
    if isinstance(prompts, (list, tuple)) and prompts:
        for p in prompts:
            if not (isinstance(p, str) or _is_ids(p) or _is_chat(p)):
                raise ValueError("each prompt must be a string, a non-empty list of token ids or a list of chat "
                                 f"messages, got {type(p).__name__}: {str(p)[:60]!r}")
        return list(prompts), True
    raise ValueError("prompts must be a string, a list of token ids, chat messages, or a non-empty list of those")


def render_chat(model: Model, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """Render chat messages with the checkpoint's Jinja chat template, as ``transformers``' ``apply_chat_template``
    renders it (:mod:`jaxmtp.serving.chat_template`; raises ValueError when the template fails on them)."""
    from jaxmtp.serving.chat_template import ChatTemplate

    if not model.chat_template:
        raise ValueError("this checkpoint has no chat template; pass a string or token ids instead of messages")
    for m in messages:
        if "role" not in m or "content" not in m:
            raise ValueError(f"chat messages need 'role' and 'content', got {m!r}")
    return ChatTemplate.from_model(model).render(messages, add_generation_prompt=add_generation_prompt)


def encode_prompt(model: Model, prompt) -> list[int]:
    if _is_ids(prompt):
        return [int(t) for t in prompt]
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer (no tokenizer.json): pass token ids instead of text")
    if _is_chat(prompt):
        return model.tokenizer.encode(render_chat(model, prompt), add_special_tokens=False).ids
    if not prompt:
        raise ValueError("the prompt is empty")
    return model.tokenizer.encode(prompt).ids


# ---- engine reuse ----------------------------------------------------------------------------------------------
def _pow2(n: int, lo: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def get_engine(model: Model, *, num_slots: int, max_context: int, num_draft_tokens: int | None,
               steps_per_sync: int = 8, prefill_chunk: int | None = None) -> Engine:
    """An engine for these settings, cached on the model so repeated calls reuse compiled steps."""
    cache = model.__dict__.setdefault("_engines", {})
    dp = model.layout.dp if model.layout is not None else 1
    num_slots = -(-num_slots // dp) * dp  # an equal share of slots per data-parallel replica
    key = (num_slots, max_context, num_draft_tokens, steps_per_sync, prefill_chunk)
    if key not in cache:
        # No slot buckets: the slot count already matches the call's batch, and compiling smaller steps as
        # requests finish would cost more than it saves in one call.
        cache[key] = Engine(model, num_slots=num_slots, max_context=max_context, num_draft_tokens=num_draft_tokens,
                            steps_per_sync=steps_per_sync, prefill_chunk=prefill_chunk, slot_buckets=False)
    return cache[key]


def _prepare(model_or_path, prompts, *, max_new_tokens, temperature, top_k, top_p, seed, num_draft_tokens, stop,
             stop_token_ids, ignore_eos, num_slots, max_context, steps_per_sync, n=1, **processing):
    """``processing``: SamplingParams' logits-processing and logprobs fields (min_p, penalties, ...)."""
    model = model_or_path if isinstance(model_or_path, Model) else load(model_or_path)
    items, batched = normalize_prompts(prompts)
    ids = [encode_prompt(model, p) for p in items]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_k=top_k,
                            top_p=float(top_p), seed=seed, stop=tuple([stop] if isinstance(stop, str) else stop or ()),
                            stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos, n=n, **processing)
    limit = model.config.max_position_embeddings
    if max_context is None:
        max_context = min(limit, _pow2(max(len(x) for x in ids) + max_new_tokens, 256))
    num_slots = num_slots or max(n, min(64, _pow2(len(ids) * n, 1)))  # n samples: n slots
    engine = get_engine(model, num_slots=num_slots, max_context=max_context, num_draft_tokens=num_draft_tokens,
                        steps_per_sync=steps_per_sync)
    # One seed per prompt: the given seed for the first, seed + i * n for the others (sample j: + j), random when None.
    for p in ids:  # validate everything before queueing anything
        engine.validate(p, params)
    rids = []
    for i, p in enumerate(ids):
        pi = dataclasses.replace(params, seed=None if seed is None else (seed + i * n) % 2**63)
        rids.append(engine.add_request(p, pi))
    return model, engine, ids, rids, batched


def _stats(o: RequestOutput, k: int) -> dict:
    s: SpecStats = o.stats or SpecStats(k=k, accepted_per_position=[0] * k)
    d = s.as_dict()
    d["tokens_per_second"] = o.num_generated_tokens / o.elapsed if o.elapsed else 0.0
    d["time_to_first_token"] = o.time_to_first_token
    d["elapsed"] = o.elapsed
    d["num_generated_tokens"] = o.num_generated_tokens
    return d


def _drain(engine: Engine, rids: list[str], n: int = 1) -> Iterator[StreamChunk]:
    index = {r: i for i, r in enumerate(rids)}
    pending = dict.fromkeys(rids, n)  # request id -> samples not finished
    try:
        while pending:
            for o in engine.step():
                if o.request_id not in index:
                    continue
                if o.finished:
                    pending[o.request_id] -= 1
                    if not pending[o.request_id]:
                        del pending[o.request_id]
                yield StreamChunk(index[o.request_id], o.token_ids, o.text, o.finished, o.finish_reason,
                                  _stats(o, engine.k) if o.finished else None, o.logprobs, o.index)
    finally:  # a consumer that stops early must not leave requests running
        for r in pending:
            engine.abort(r)
        while engine.has_work():
            engine.step()


def generate_stream(model_or_path, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                    num_draft_tokens: int | None = None, stop=None, stop_token_ids=None, ignore_eos: bool = False,
                    min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    repetition_penalty: float = 1.0, logit_bias=None, min_tokens: int = 0,
                    logprobs: int | None = None, n: int = 1, num_slots: int | None = None,
                    max_context: int | None = None, steps_per_sync: int = 8) -> Iterator[StreamChunk]:
    """Yield :class:`StreamChunk` s (several token ids each) as the engine accepts them; the last chunk of each
    prompt (of each sample, with ``n`` > 1: ``StreamChunk.sample``) has ``finished=True``, its finish reason and
    statistics. Arguments as in :func:`generate`."""
    _, engine, _, rids, _ = _prepare(
        model_or_path, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, num_draft_tokens=num_draft_tokens, stop=stop, stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos, num_slots=num_slots, max_context=max_context, steps_per_sync=steps_per_sync,
        min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, logit_bias=logit_bias, min_tokens=min_tokens, logprobs=logprobs, n=n)
    yield from _drain(engine, rids, n)


def generate(model_or_path, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, num_draft_tokens: int | None = None, stop=None,
             stop_token_ids=None, ignore_eos: bool = False, min_p: float = 0.0, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, logit_bias=None, min_tokens: int = 0,
             logprobs: int | None = None, n: int = 1, num_slots: int | None = None, max_context: int | None = None,
             steps_per_sync: int = 8):
    """Generate for one prompt (returns a :class:`GenerationResult`) or a batch (returns a list).

    ``num_draft_tokens`` is k, the MTP draft tokens verified per step (0 = plain decoding; None = the engine's
    default for the model and slot count, see :mod:`jaxmtp.engine.policy`). Greedy output (temperature 0) is token-for-token the same for every k; a seeded
    sampled output is the same for every k and batch composition. With a batch, prompt i uses seed + i.

    The logits processing (``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``,
    ``logit_bias`` {token id: value}, ``min_tokens``) is :class:`jaxmtp.SamplingParams`'. ``logprobs`` N: each result
    carries ``logprobs``, one :class:`jaxmtp.engine.TokenLogprob` per output token (its log-probability and the N
    most likely ids with theirs, under the model's raw distribution: before temperature, penalties, bias, filters).

    ``n``: samples per prompt (1..128, and the engine needs a slot per sample: ``num_slots`` defaults to enough).
    Each prompt's result is then a list of ``n`` GenerationResults in sample order (so a batch gives a list of
    lists); the prompt is prefilled once; sample j of prompt i uses seed + i * n + j (n = 1: seed + i, as above).
    """
    model, engine, prompt_ids, rids, batched = _prepare(
        model_or_path, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, num_draft_tokens=num_draft_tokens, stop=stop, stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos, num_slots=num_slots, max_context=max_context, steps_per_sync=steps_per_sync,
        min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, logit_bias=logit_bias, min_tokens=min_tokens, logprobs=logprobs, n=n)
    keys = [(i, j) for i in range(len(rids)) for j in range(n)]  # (prompt, sample)
    texts = {key: [] for key in keys}
    ids = {key: [] for key in keys}
    lps: dict[tuple, list[TokenLogprob] | None] = dict.fromkeys(keys)
    final: dict[tuple, StreamChunk | None] = dict.fromkeys(keys)
    for c in _drain(engine, rids, n):
        key = (c.index, c.sample)
        texts[key].append(c.text)
        ids[key].extend(c.token_ids)
        if c.logprobs is not None:
            if lps[key] is None:
                lps[key] = []
            lps[key].extend(c.logprobs)
        if c.finished:
            final[key] = c

    def result(key) -> GenerationResult:
        return GenerationResult(text="".join(texts[key]) if model.tokenizer is not None else None,
                                token_ids=ids[key], finish_reason=final[key].finish_reason,
                                prompt_token_ids=prompt_ids[key[0]], stats=final[key].stats, logprobs=lps[key])

    results = [[result((i, j)) for j in range(n)] if n > 1 else result((i, 0)) for i in range(len(rids))]
    return results if batched else results[0]


# A prompt the default (standard-library code) model continues sensibly; it ends at a colon, not a newline (its
# byte-level BPE merges a newline with the next line's indentation).
DEFAULT_PROMPT = 'class Stack:\n    """A last-in, first-out container."""\n\n    def __init__(self):'


def _process_seconds() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): start-up includes Python's imports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxmtp",
                                 description="Generate text with MTP speculative decoding.")
    ap.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="prompt text (default: a small class)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", "--num-draft-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: float32 on CPU, bfloat16 on accelerators (as jaxmtp.load and the server)")
    ap.add_argument("-q", "--quantization", default=None, choices=["fp8"],
                    help="quantise a floating checkpoint's projections to block FP8 on load (FP8 checkpoints load "
                         "as FP8 without it)")
    ap.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="split the model over N devices (docs/engine.md, Parallelism)")
    ap.add_argument("-dp", "--data-parallel-size", type=int, default=1, metavar="M",
                    help="M replicas of the tensor-parallel group (docs/engine.md, Parallelism)")
    ap.add_argument("--draft-vocab", default=None, metavar="FILE",
                    help="draft only among these token ids (jaxmtp.draft_vocab; same output, cheaper drafts)")
    from jaxmtp.compile_cache import add_arguments, enable_from_args

    add_arguments(ap)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    try:
        enable_from_args(args)  # before anything compiles
        model = load(args.model, dtype=args.dtype, draft_vocab=args.draft_vocab, quantization=args.quantization,
                     tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size)
        _, engine, ids, rids, _ = _prepare(
            model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed, num_draft_tokens=args.num_draft_tokens, stop=args.stop,
            stop_token_ids=None, ignore_eos=False, num_slots=None, max_context=None, steps_per_sync=8)
        load_s = time.perf_counter() - t_start
        # Compile what this request runs, with progress on stderr, so that the timings below exclude it.
        keys = engine.keys_for_request(len(ids[0]), sampling=args.temperature > 0)
        compile_s = engine.warmup(keys=keys, progress=True)
        from_cache = sum(engine.executables[k].cache_hits > 0 or engine.executables[k].stored for k in keys)
        t0 = time.perf_counter()
        sys.stdout.write(args.prompt)
        final, first, since_start = None, None, None
        for c in _drain(engine, rids):
            if first is None and c.token_ids:
                first = time.perf_counter()
                since_start = _process_seconds()
            sys.stdout.write(c.text)
            sys.stdout.flush()
            final = c
        t_end = time.perf_counter()
    except (ValueError, OSError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    s = final.stats
    n = s["num_generated_tokens"]
    decode = f"{(n - 1) / (t_end - first):.1f} tokens/s" if first is not None and n > 1 and t_end > first else "-"
    print(f"\n\n[{n} tokens, finish={final.finish_reason}, k={s['k']}, "
          f"mean acceptance length {s['mean_acceptance_length']:.2f}, "
          f"acceptance per position {[round(a, 2) for a in s['acceptance_per_position']]}]\n"
          f"[load {load_s:.1f} s, compile {compile_s:.1f} s ({len(keys)} executables, {from_cache} from the "
          f"compilation cache), time to first token {((first or t_end) - t0) * 1e3:.0f} ms, decode {decode} "
          f"(after the first token, compile excluded), first token "
          f"{since_start if since_start is not None else (first or t_end) - t_start:.1f} s after the start]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
