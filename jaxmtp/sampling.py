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


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    temperature 0 is greedy; ``top_k`` 0 disables top-k; ``top_p`` in (0, 1]; ``seed`` None draws one at random.
    ``stop`` strings end the output before the string (text) / at the token that completes it (ids);
    ``stop_token_ids`` and the model's EOS ids end it at that token (included in the ids, not in the text).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
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


def sample_tokens(logits, temperature, top_k, top_p, seed_lo, seed_hi, index):
    """Choose the token at each (row, position).

    logits: [B, T, V] float32; temperature/top_p: [B] f32; top_k: [B] int32; seed_lo/seed_hi: [B] uint32;
    index: [B, T] int32 output positions (the j in key(seed, j)). Returns int32 [B, T].
    """
    greedy = greedy_tokens(logits)
    sampling = temperature > 0

    def sampled(_):
        scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None, None]
        needs_filter = jnp.any(sampling & ((top_k > 0) | (top_p < 1.0)))
        scaled = jax.lax.cond(needs_filter, lambda x: _filter(x, top_k, top_p), lambda x: x, scaled)
        keys = _keys(seed_lo, seed_hi, index)
        noise = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)))(keys)
        return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)

    chosen = jax.lax.cond(jnp.any(sampling), sampled, lambda _: greedy, None)
    return jnp.where(sampling[:, None], chosen, greedy)


def split_seed(seed: int) -> tuple[int, int]:
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
