"""Sampling parameters and the on-device token choice.

The token at output position j of a request is ``argmax(masked(logits / T) + Gumbel(key(seed, j)))``, or the plain
argmax for temperature 0. The noise depends only on (request seed, j), so a seeded request produces the same
sequence as plain sampling whatever the number of draft tokens and whatever else shares the batch. A draft token is
accepted exactly when it equals that token, which makes speculative sampling lossless for deterministic drafts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp

MAX_STOP_IDS = 8  # stop token ids (EOS included) held per slot on the device
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs bound); the device always computes this many
MAX_LOGIT_BIAS = 300  # most logit_bias entries per request, held per slot on the device
MAX_N = 128  # most samples per request (each takes a slot: the engine also refuses n above its slot count)


def _int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)) or (isinstance(v, str) and not v.strip().lstrip("-").isdigit()):
        raise ValueError(f"{what} {v!r} is not an integer")
    return int(v)


FLOAT32_MAX = 3.4028234663852886e38  # the largest temperature (the step holds temperatures in float32)
MIN_TEMPERATURE = 1e-5  # smaller temperatures decode greedily (vLLM's _SAMPLING_EPS)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    temperature 0 is greedy, and so is a temperature below :data:`MIN_TEMPERATURE` (as in vLLM: dividing float32
    logits by it would overflow them to ties of infinities); ``top_k`` 0 disables top-k; ``top_p`` in (0, 1];
    ``seed`` None draws one at random.
    ``stop`` strings end the output before the string (text) / at the token that completes it (ids);
    ``stop_token_ids`` and the model's EOS ids end it at that token (included in the ids, not in the text).

    The logits processing (the vLLM order, all on the device inside the step): ``logit_bias`` ({id: value}, at most
    :data:`MAX_LOGIT_BIAS` ids, values in [-100, 100]) is added; the stop ids and EOS are masked while fewer than
    ``min_tokens`` tokens are out (stop strings are not looked for before then either); then the penalties, over
    the prompt and the output so far (in a verify window, the drafts before each position too, so speculative
    decoding equals plain decoding): ``repetition_penalty`` r > 0 divides positive and multiplies negative logits
    of every id seen in the prompt or output; ``frequency_penalty`` subtracts f x the id's count in the output,
    ``presence_penalty`` p once for an id that occurs in it (both in [-2, 2]). Greedy decoding takes the argmax of
    the processed logits; sampling divides by the temperature, drops ids below ``min_p`` x the top probability,
    then applies top-k and top-p.

    ``n``: independent samples of the prompt, which is prefilled once (all but its last token; each sample then
    runs the last token and draws its own first token); sample i uses seed ``seed + i`` (mod 2**63).

    ``logprobs`` N (0..:data:`MAX_LOGPROBS`): every output token comes with its log-probability and the N most
    likely ids with theirs, under the target model's own distribution (log-softmax of its logits, before the
    processing, temperature and filters above: vLLM's default ``raw_logprobs``). None: no log-probabilities.
    ``prompt_logprobs`` N: the same for every prompt token after the first (given the tokens before it); such a
    request prefills in chunks of its own and takes no prefix-cache hit (every position must run).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a dict {id: value} is accepted and stored sorted
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        bias = self.logit_bias or ()
        try:
            pairs = sorted((_int(k, "logit_bias id"), float(v)) for k, v in (bias.items() if isinstance(bias, dict)
                                                                              else bias))
        except (TypeError, ValueError) as e:
            raise ValueError(f"logit_bias must map token ids to numbers: {e}") from None
        object.__setattr__(self, "logit_bias", tuple(pairs))
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= FLOAT32_MAX:  # NaN fails too; the step holds it in float32
            raise ValueError(f"temperature must be a finite number >= 0 (at most {FLOAT32_MAX:.4g}, float32's "
                             f"largest), got {self.temperature!r}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop_token_ids) > MAX_STOP_IDS - 1:
            raise ValueError(f"at most {MAX_STOP_IDS - 1} stop_token_ids are supported")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not (0.0 < self.repetition_penalty <= 1e4):
            raise ValueError(f"repetition_penalty must be in (0, 10000] (1 is off), got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} token ids, got {len(self.logit_bias)}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        for t, v in self.logit_bias:
            if t < 0:
                raise ValueError(f"logit_bias id {t} is negative")
            if not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for id {t}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (None: none), got {v!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")

    def sample(self, i: int) -> "SamplingParams":
        """The settings of sample ``i`` of ``n``: seed + i, one sample (the prompt's log-probabilities with the
        first)."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % 2**63,
                                   prompt_logprobs=self.prompt_logprobs if i == 0 else None)

    @property
    def processes_logits(self) -> bool:
        """Whether the request needs the step with logits processing and log-probabilities (a loop of its own;
        the plain greedy and sampling loops do none of it)."""
        return bool(self.logprobs is not None or self.min_p > 0 or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens)

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed (drawn at random when None)."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=int.from_bytes(os.urandom(7), "little"))


def stop_id_row(params: SamplingParams, eos_ids: Sequence[int]) -> list[int]:
    """The slot's stop ids padded with -1 to MAX_STOP_IDS."""
    ids = list(params.stop_token_ids) + ([] if params.ignore_eos else [e for e in eos_ids])
    ids = list(dict.fromkeys(ids))
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"too many stop ids ({len(ids)} > {MAX_STOP_IDS}) including EOS")
    return ids + [-1] * (MAX_STOP_IDS - len(ids))


def _keys(seed_lo, seed_hi, index):
    """Per-(row, position) PRNG keys. seed_lo/hi: [B] uint32; index: [B, T] int32 -> keys [B, T]."""

    def one(lo, hi, j):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(lo), hi), j)

    return jax.vmap(lambda lo, hi, js: jax.vmap(lambda j: one(lo, hi, j))(js))(seed_lo, seed_hi, index)


def _min_p_mask(logits, min_p):
    """Mask logits [B, T, V] whose probability is below ``min_p`` [B] x the row's top probability (0: none)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    floor = top + jnp.log(jnp.where(min_p > 0, min_p, 1.0))[:, None, None]
    return jnp.where((min_p[:, None, None] <= 0) | (logits >= floor), logits, -jnp.inf)


def _filter(logits, top_k, top_p):
    """Mask logits [B, T, V] outside each row's top-k and top-p sets (sort-based, exact; ties at the threshold are
    kept). top_k/top_p: [B]; top_k 0 and top_p 1 keep everything."""
    v = logits.shape[-1]
    order = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None, None]
    kth = jnp.take_along_axis(order, k - 1, axis=-1)
    probs = jax.nn.softmax(order, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    keep_sorted = (cum_before < top_p[:, None, None]) | (top_p[:, None, None] >= 1.0)
    pth = jnp.min(jnp.where(keep_sorted, order, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def greedy_tokens(logits):
    """The argmax token at each (row, position): logits [B, T, V] -> int32 [B, T]."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample_tokens(logits, temperature, top_k, top_p, seed_lo, seed_hi, index, min_p=None):
    """Choose the token at each (row, position).

    logits: [B, T, V] float32; temperature/top_p: [B] f32; top_k: [B] int32; seed_lo/seed_hi: [B] uint32;
    index: [B, T] int32 output positions (the j in key(seed, j)); min_p: [B] f32 or None. Returns int32 [B, T].
    """
    greedy = greedy_tokens(logits)
    sampling = temperature > 0

    def sampled(_):
        scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None, None]
        if min_p is not None:  # on the tempered distribution, before top-k / top-p (vLLM's order)
            scaled = _min_p_mask(scaled, min_p)
        needs_filter = jnp.any(sampling & ((top_k > 0) | (top_p < 1.0)))
        scaled = jax.lax.cond(needs_filter, lambda x: _filter(x, top_k, top_p), lambda x: x, scaled)
        keys = _keys(seed_lo, seed_hi, index)
        noise = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)))(keys)
        return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)

    chosen = jax.lax.cond(jnp.any(sampling), sampled, lambda _: greedy, None)
    return jnp.where(sampling[:, None], chosen, greedy)


def split_seed(seed: int) -> tuple[int, int]:
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def _penalize(x, count, seen, rep, freq, pres):
    """vLLM's penalties on logits ``x`` given each id's output ``count`` (f32) and whether the prompt holds it
    (``seen``); rep/freq/pres broadcast against x."""
    x = jnp.where(seen | (count > 0), jnp.where(x > 0, x / rep, x * rep), x)
    return x - freq * count - pres * (count > 0)


def process_logits(logits, window, counts, seen, bias_ids, bias_vals, rep, freq, pres, min_tokens, generated,
                   stop_ids):
    """The logits processing of :class:`SamplingParams` on logits [B, T, V] (f32) at output positions
    ``generated + t``: logit bias, stop ids masked below ``min_tokens``, then the penalties with the history up to
    each position.

    window: [B, T - 1] int32, the tokens the window puts before positions 1 .. T-1 (a verify window's drafts: a
    position's token is kept only if every draft before it is, so they are its history); counts: [B, V] int32 output
    counts before position 0; seen: [B, V] bool prompt ids; bias_ids/bias_vals: [B, L] (ids >= V unused);
    rep/freq/pres: [B] f32; min_tokens/generated: [B] int32; stop_ids: [B, MAX_STOP_IDS] (-1 unused).
    """
    b, t, v = logits.shape
    rows = jnp.arange(b)[:, None, None]
    pos = jnp.arange(t)[None, :, None]
    x = logits.at[rows, pos, bias_ids[:, None, :]].add(bias_vals[:, None, :], mode="drop")
    early = (generated[:, None] + jnp.arange(t)[None]) < min_tokens[:, None]  # [B, T]
    stop = jnp.where(early[..., None] & (stop_ids[:, None, :] >= 0), stop_ids[:, None, :], v)
    x = x.at[rows, pos, stop].set(-jnp.inf, mode="drop")
    biased = x
    r, f, p = (a[:, None, None] for a in (rep, freq, pres))
    x = _penalize(biased, counts[:, None, :].astype(jnp.float32), seen[:, None, :], r, f, p)
    if t > 1:  # each draft before a position counts once more at the positions after it
        k = t - 1
        same = (window[:, :, None] == window[:, None, :]).astype(jnp.float32)  # [B, K(j), K(j')]
        before = (jnp.arange(k)[None, :] < jnp.arange(t)[:, None]).astype(jnp.float32)  # [T, K]: j' < position
        extra = jnp.einsum("bjk,tk->btj", same, before)  # [B, T, K]: copies of draft j's id before the position
        base = jnp.take_along_axis(counts, window, axis=1).astype(jnp.float32)[:, None, :]
        ids = jnp.broadcast_to(window[:, None, :], (b, t, k))
        raw = jnp.take_along_axis(biased, ids, axis=2)
        val = _penalize(raw, base + extra, jnp.take_along_axis(seen, window, axis=1)[:, None, :], r, f, p)
        ids = jnp.where(before[None] > 0, ids, v)  # drafts at or after the position: nothing to write
        x = x.at[rows, pos, ids].set(val, mode="drop")
    return x


def token_logprobs(logits, tokens, n: int = MAX_LOGPROBS):
    """The raw log-probabilities: of ``tokens`` [B, T] under logits [B, T, V], and the top ``n`` (ids, values)
    at each position. Returns (lp [B, T] f32, top_ids [B, T, n] int32, top_lp [B, T, n] f32)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, min(n, lp.shape[-1]))
    pad = [(0, 0)] * (lp.ndim - 1) + [(0, n - top_lp.shape[-1])]  # a vocabulary under n ids: id -1, -inf
    return (chosen, jnp.pad(top_ids.astype(jnp.int32), pad, constant_values=-1),
            jnp.pad(top_lp, pad, constant_values=-jnp.inf))
