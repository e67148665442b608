"""Device-side state and the pure functions the engine jits: admit, prefill a chunk, run speculative steps.

One speculative step over all slots, with fixed shape ``[slots, k + 1]``:

1. verify: the target runs over ``[last, d_1 .. d_k]`` at positions ``length .. length + k``, keeping every GDN
   layer's carry and the window's conv outputs and gates (``GDNSteps``);
2. accept: the target's token ``t_i`` at each position (greedy or seeded Gumbel-max, see :mod:`jaxmtp.sampling`);
   ``a`` = number of leading drafts equal to ``t``; the step emits ``t_0 .. t_a``, cut at a stop id or the slot's
   token budget;
3. rollback: each GDN layer commits the tokens the step emits, ``a + 1`` or fewer where a stop or the budget ends
   the request inside the window (the rule runs again over them from the old state,
   :func:`jaxmtp.model.commit_window`, every layer in one kernel launch); KV caches just advance
   ``length`` (rows past it are stale and overwritten later);
4. draft: the MTP head runs over the window with ``t`` as next tokens and the target's hidden states (every row
   enters its KV cache; o_proj, the MLP and the head run on row ``a`` alone), row ``a`` gives ``d'_1``; ``k - 1``
   recursive single steps (MTP's own hidden, position + 1) give the rest.

With ``k = 0`` the same function is plain decoding (T = 1, no stack, no MTP).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxmtp.config import Qwen35Config
from jaxmtp.model import commit_window, forward, init_carry, lm_head, reset_slots
from jaxmtp.mtp import chosen_ids, draft_pass_input, init_mtp_carry, mtp_forward
from jaxmtp.pallas import Backend
from jaxmtp.pallas.collectives import gather_vocab, vocab_argmax
from jaxmtp.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_IDS, process_logits, sample_tokens, token_logprobs

UNUSED_ID = jnp.iinfo(jnp.int32).max  # a logit-bias entry that names no id (scatters drop it)

NONE, STOP, LENGTH = 0, 1, 2  # finish reasons on the device


@struct.dataclass
class SlotState:
    """Everything the device keeps per slot (leading axis = slot)."""

    carry: tuple  # target carry
    mtp_carry: tuple  # MTP KV caches (empty with k = 0)
    length: jax.Array  # [S] int32: tokens consumed by the target = position of `last`
    last: jax.Array  # [S] int32: newest emitted token, not yet fed to the target
    # [S, max(k, 1)] int32: MTP drafts for positions length+1 .. length+k. With k = 0 one unused column: a
    # zero-size array in a sharded model's state crashed XLA's GPU compiler (segfault compiling the k = 0 prefill
    # inside the shard_map, jax 0.11.2 on 2 x H100), so no state array is empty.
    drafts: jax.Array
    generated: jax.Array  # [S] int32: output tokens emitted so far
    max_gen: jax.Array  # [S] int32: token budget (min of max_new_tokens and the context room)
    active: jax.Array  # [S] bool
    temperature: jax.Array  # [S] f32
    top_k: jax.Array  # [S] int32
    top_p: jax.Array  # [S] f32
    seed_lo: jax.Array  # [S] uint32
    seed_hi: jax.Array  # [S] uint32
    stop_ids: jax.Array  # [S, MAX_STOP_IDS] int32, -1 padded
    # logits processing (jaxmtp.sampling.process_logits; run by the step loops with ``features``)
    min_p: jax.Array  # [S] f32
    repetition_penalty: jax.Array  # [S] f32, 1: off
    frequency_penalty: jax.Array  # [S] f32
    presence_penalty: jax.Array  # [S] f32
    min_tokens: jax.Array  # [S] int32
    bias_ids: jax.Array  # [S, MAX_LOGIT_BIAS] int32, UNUSED_ID padded
    bias_vals: jax.Array  # [S, MAX_LOGIT_BIAS] f32
    counts: jax.Array  # [S, V] int32: each id's count in the output so far (kept by the feature loops)
    seen: jax.Array  # [S, V] bool: the prompt's ids (marked for requests with a repetition penalty)
    oracle: "Oracle | None" = None  # controlled drafts for tests and benchmarks (None: MTP drafts only)


@struct.dataclass
class Oracle:
    """Replaces MTP drafts by a known continuation, corrupted at one drawn index per step.

    The MTP head still runs (so step costs are real); its drafts are then overwritten where the reference is known.
    ``seq [S, capacity]``: reference token at each position (-1 unknown); ``probs [k+1]``: distribution of the index
    that is corrupted (index k = no corruption), which fixes the distribution of acceptance lengths.
    """

    seq: jax.Array
    probs: jax.Array
    seed: jax.Array


def apply_oracle(oracle: Oracle | None, drafts, new_length, generated, vocab: int):
    if oracle is None:
        return drafts
    s, k = drafts.shape
    pos = new_length[:, None] + 1 + jnp.arange(k)
    true = jnp.take_along_axis(oracle.seq, jnp.clip(pos, 0, oracle.seq.shape[1] - 1), axis=1)
    true = jnp.where(pos < oracle.seq.shape[1], true, -1)
    keys = jax.vmap(lambda i, g: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(oracle.seed), i), g))(
        jnp.arange(s), generated)
    bad = jax.vmap(lambda key: jax.random.categorical(key, jnp.log(oracle.probs)))(keys)
    corrupted = jnp.where(jnp.arange(k)[None] == bad[:, None], (true + 1) % vocab, true)
    return jnp.where(true >= 0, corrupted, drafts).astype(jnp.int32)


def set_oracle_row(state: SlotState, slot, seq_row) -> SlotState:
    return state.replace(oracle=state.oracle.replace(seq=state.oracle.seq.at[slot].set(seq_row)))


def init_state(cfg: Qwen35Config, slots: int, capacity: int, k: int, dtype, oracle_probs=None) -> SlotState:
    """Empty state; ``capacity`` = KV rows per slot (max context + k of headroom for the verify window)."""
    z = lambda dt: jnp.zeros((slots,), dt)  # noqa: E731
    return SlotState(
        carry=init_carry(cfg, slots, capacity, dtype),
        mtp_carry=init_mtp_carry(cfg, slots, capacity, dtype) if k > 0 else (),
        length=z(jnp.int32), last=z(jnp.int32), drafts=jnp.zeros((slots, max(k, 1)), jnp.int32),
        generated=z(jnp.int32),
        max_gen=z(jnp.int32), active=z(bool), temperature=z(jnp.float32), top_k=z(jnp.int32),
        top_p=jnp.ones((slots,), jnp.float32), seed_lo=z(jnp.uint32), seed_hi=z(jnp.uint32),
        stop_ids=jnp.full((slots, MAX_STOP_IDS), -1, jnp.int32),
        min_p=z(jnp.float32), repetition_penalty=jnp.ones((slots,), jnp.float32), frequency_penalty=z(jnp.float32),
        presence_penalty=z(jnp.float32), min_tokens=z(jnp.int32),
        bias_ids=jnp.full((slots, MAX_LOGIT_BIAS), UNUSED_ID, jnp.int32),
        bias_vals=jnp.zeros((slots, MAX_LOGIT_BIAS), jnp.float32),
        counts=jnp.zeros((slots, cfg.vocab_size), jnp.int32), seen=jnp.zeros((slots, cfg.vocab_size), bool),
        oracle=None if oracle_probs is None else Oracle(
            seq=jnp.full((slots, capacity), -1, jnp.int32), probs=jnp.asarray(oracle_probs, jnp.float32),
            seed=jnp.uint32(0)),
    )


def admit(state: SlotState, slots, max_gen, temperature, top_k, top_p, seed_lo, seed_hi, stop_ids,
          processing: dict) -> SlotState:
    """Write a new request's settings into ``slots`` [Bp] (out-of-range slot ids are ignored) and zero the slots'
    GDN carries (KV rows need no reset: a query never reads rows past its own position). ``processing``: the
    logits-processing fields of :class:`SlotState` by name ([Bp] or [Bp, MAX_LOGIT_BIAS]); their output counts
    and prompt marks start empty."""
    put = lambda a, v: a.at[slots].set(v, mode="drop")  # noqa: E731
    state = state.replace(counts=put(state.counts, 0), seen=put(state.seen, False),
                          **{name: put(getattr(state, name), v) for name, v in processing.items()})
    return state.replace(
        carry=reset_slots(state.carry, slots),
        max_gen=put(state.max_gen, max_gen), temperature=put(state.temperature, temperature),
        top_k=put(state.top_k, top_k), top_p=put(state.top_p, top_p), seed_lo=put(state.seed_lo, seed_lo),
        seed_hi=put(state.seed_hi, seed_hi), stop_ids=put(state.stop_ids, stop_ids),
        active=put(state.active, False), generated=put(state.generated, 0),
    )


def mark_prompt(state: SlotState, slot, ids) -> SlotState:
    """Mark prompt ids [C] (negative: padding) as seen by ``slot`` (the repetition penalty's prompt half)."""
    ids = jnp.where(ids >= 0, ids, UNUSED_ID)
    return state.replace(seen=state.seen.at[slot, ids].set(True, mode="drop"))


def copy_carries(state: SlotState, src, dst) -> SlotState:
    """Copy slot ``src``'s carries (target and MTP: KV rows, GDN states, conv rings) into slots ``dst`` [M]
    (out-of-range ids ignored): the samples of one prompt start from the prefill of one."""
    srcs = jnp.full_like(dst, src)
    return state.replace(carry=_put(state.carry, dst, _take(state.carry, srcs)),
                         mtp_carry=_put(state.mtp_carry, dst, _take(state.mtp_carry, srcs)))


def deactivate(state: SlotState, slots) -> SlotState:
    return state.replace(active=state.active.at[slots].set(False, mode="drop"))


def _take(tree, slots):
    return jax.tree.map(lambda a: a.at[slots].get(mode="fill", fill_value=0), tree)


def _put(tree, slots, sub):
    return jax.tree.map(lambda a, s: a.at[slots].set(s, mode="drop"), tree, sub)


def _finish(tokens, n, generated, max_gen, stop_ids):
    """Cut each row's first ``n`` candidate tokens at a stop id or the token budget.

    tokens: [B, T]; n, generated, max_gen: [B]; stop_ids: [B, MAX_STOP_IDS].
    Returns (n_emit [B], finished [B] bool, reason [B] int32).
    """
    t = tokens.shape[1]
    idx = jnp.arange(t)[None]
    is_stop = jnp.any(tokens[..., None] == stop_ids[:, None, :], axis=-1) & (tokens >= 0)
    over = generated[:, None] + idx + 1 >= max_gen[:, None]
    cut = (idx < n[:, None]) & (is_stop | over)
    first = jnp.argmax(cut, axis=1)
    finished = jnp.any(cut, axis=1)
    stop_hit = jnp.take_along_axis(is_stop, first[:, None], axis=1)[:, 0]
    reason = jnp.where(finished, jnp.where(stop_hit, STOP, LENGTH), NONE).astype(jnp.int32)
    return jnp.where(finished, first + 1, n).astype(jnp.int32), finished, reason


def choose_tokens(logits, temperature, top_k, top_p, seed_lo, seed_hi, index, backend: Backend,
                  sampling: bool = True):
    """The target's token at each (row, position) from logits [B, T, V] (:func:`jaxmtp.sampling.sample_tokens`;
    ``sampling=False``: greedy only). A vocabulary-parallel head's logits are this rank's [B, T, V / tp]: greedy ids
    come from the ranks' (max, id) pairs, sampling gathers the logits first (:mod:`jaxmtp.pallas.collectives`)."""
    tp = backend.parallel
    if sampling:
        return sample_tokens(gather_vocab(logits, tp), temperature, top_k, top_p, seed_lo, seed_hi, index)
    return vocab_argmax(logits, tp)


LOGPROB_COLUMNS = 1 + 2 * MAX_LOGPROBS  # per position: the token's logprob, the top ids, their logprobs


def neutral_processing(b: int) -> dict:
    """Logits-processing settings that change nothing, for ``b`` admission rows: the :class:`SlotState` fields
    min_p, the three penalties, min_tokens and the logit bias by name (numpy)."""
    import numpy as np

    return {"min_p": np.zeros((b,), np.float32), "repetition_penalty": np.ones((b,), np.float32),
            "frequency_penalty": np.zeros((b,), np.float32), "presence_penalty": np.zeros((b,), np.float32),
            "min_tokens": np.zeros((b,), np.int32),
            "bias_ids": np.full((b, MAX_LOGIT_BIAS), np.iinfo(np.int32).max, np.int32),
            "bias_vals": np.zeros((b, MAX_LOGIT_BIAS), np.float32)}


def choose_processed(logits, field, window, index, generated, backend: Backend):
    """:func:`choose_tokens` with the logits processing (:func:`jaxmtp.sampling.process_logits`) and the raw
    log-probabilities. logits: [B, T, V / tp]; ``field(name)``: that :class:`SlotState` field of these rows;
    window: [B, T - 1] drafts; index: [B, T] output positions; generated: [B]. Returns (tokens [B, T], packed
    logprobs [B, T * LOGPROB_COLUMNS] int32: :func:`unpack_logprobs`)."""
    full = gather_vocab(logits, backend.parallel).astype(jnp.float32)
    x = process_logits(full, window, field("counts"), field("seen"), field("bias_ids"), field("bias_vals"),
                       field("repetition_penalty"), field("frequency_penalty"), field("presence_penalty"),
                       field("min_tokens"), generated, field("stop_ids"))
    t = sample_tokens(x, field("temperature"), field("top_k"), field("top_p"), field("seed_lo"), field("seed_hi"),
                      index, field("min_p"))
    return t, _pack_logprobs(*token_logprobs(full, t)).reshape(t.shape[0], -1)


def _pack_logprobs(lp, top_ids, top_lp):
    """:func:`jaxmtp.sampling.token_logprobs`' outputs [..., T], [..., T, N] as one int32 array [..., T,
    LOGPROB_COLUMNS] (the floats' bits: :func:`unpack_logprobs`)."""
    f2i = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    return jnp.concatenate([f2i(lp)[..., None], top_ids, f2i(top_lp)], axis=-1)


def unpack_logprobs(packed):
    """[..., T * LOGPROB_COLUMNS] int32 (numpy) -> (logprob [..., T], top ids [..., T, N], top logprobs)."""
    import numpy as np

    a = np.asarray(packed).reshape(packed.shape[:-1] + (-1, LOGPROB_COLUMNS))
    n = MAX_LOGPROBS
    return a[..., 0].view(np.float32), a[..., 1 : 1 + n], a[..., 1 + n :].view(np.float32)


def _count_emitted(counts, tokens, n_emit):
    """Add each row's first ``n_emit`` [B] of ``tokens`` [B, T] to its output counts [B, V]."""
    keep = jnp.arange(tokens.shape[1])[None] < n_emit[:, None]
    return counts.at[jnp.arange(tokens.shape[0])[:, None], jnp.where(keep, tokens, UNUSED_ID)].add(1, mode="drop")


def _draft_rest(params, cfg, k, h1, choice, new_length, active, mtp_carry, backend):
    """Draft 1 from the first pass's hidden h1 [B, H] and its head's ``choice`` (``mtp_forward(logits="choice")``),
    then recursive MTP steps 2..k (token d_{i}, MTP hidden, position new_length + i - 1; each pass's input formed
    from the previous head's choice: :func:`jaxmtp.mtp.draft_pass_input`). Returns ([B, k], carry)."""
    drafts, h = [], h1
    for i in range(1, k):
        # the pass's positions come from the input kernel too (no XLA kernel for them)
        d, x, pos = draft_pass_input(params, cfg, choice, h, backend, position=(new_length, active, i - 1))
        drafts.append(d)
        choice, hm, mtp_carry = mtp_forward(params, None, None, pos, mtp_carry, cfg=cfg, step=i, logits="choice",
                                            backend=backend, fc_input=x)
        h = hm[:, 0]
    drafts.append(chosen_ids(choice))
    return jnp.stack(drafts, axis=1), mtp_carry


PROMPT_LOGPROB_ROWS = 16  # chunk positions whose logits a prompt-logprobs prefill holds at a time


def _prompt_logprobs(params, hidden, next_tokens, backend: Backend):
    """Packed raw log-probabilities [Bp, C * LOGPROB_COLUMNS] of ``next_tokens`` [Bp, C] after each position of
    ``hidden`` [Bp, C, H], computed PROMPT_LOGPROB_ROWS positions at a time (the logits of a whole chunk would be
    C x V floats per row)."""
    b, c, h = hidden.shape
    r = min(PROMPT_LOGPROB_ROWS, c)

    def part(args):
        hid, nxt = args  # [Bp, r, H], [Bp, r]
        full = gather_vocab(lm_head(params, hid, backend), backend.parallel)
        return _pack_logprobs(*token_logprobs(full, nxt))  # [Bp, r, COLUMNS]

    parts = jax.lax.map(part, (hidden.reshape(b, c // r, r, h).swapaxes(0, 1),
                               next_tokens.reshape(b, c // r, r).swapaxes(0, 1)))  # [C / r, Bp, r, COLUMNS]
    return parts.swapaxes(0, 1).reshape(b, -1)


def prefill_chunk(params, state: SlotState, slots, tokens, positions, next_tokens, final, *, cfg: Qwen35Config,
                  k: int, backend: Backend, prompt_logprobs: bool = False, ends_prompts: bool = True):
    """Run one prompt chunk for rows ``slots`` [Bp] (ids >= num_slots are dummies).

    tokens/positions: [Bp, C] right-padded (positions -1 on padding); next_tokens: [Bp, C], the token after each
    position (the MTP's input; ignored at a final row's last position, which takes the sampled first token);
    final: [Bp] bool, the chunk ends the prompt. For final rows the first token is sampled, drafts are made and the
    slot becomes active. Returns (state, first_token [Bp], finished [Bp], reason [Bp], the first token's packed
    log-probabilities [Bp, LOGPROB_COLUMNS]); with ``prompt_logprobs`` also those of ``next_tokens`` after every
    position [Bp, C * LOGPROB_COLUMNS] (C a multiple of PROMPT_LOGPROB_ROWS, or less than it).

    ``ends_prompts=False``: a call in which no row is final (the host knows; ``final`` is then ignored) runs the
    carries' part alone, the same state as the full call: no LM head, no sampling, no drafts, and so no sampling
    conditional, whose predicate would hold the host (on GPUs) until the chunk is done instead of letting it queue
    the next one. The other outputs are zeros.
    """
    carry = _take(state.carry, slots)
    _, hidden, carry = forward(params, tokens, positions, carry, cfg=cfg, logits="none", backend=backend)
    n_valid = jnp.sum(positions >= 0, axis=1)
    last_idx = jnp.maximum(n_valid - 1, 0)
    if not ends_prompts and not prompt_logprobs:
        new_state = state.replace(carry=_put(state.carry, slots, carry))
        if k > 0:  # the MTP layer's keys and values of the chunk (its input: each position's next prompt token)
            _, _, mtp = mtp_forward(params, next_tokens, hidden, positions, _take(state.mtp_carry, slots), cfg=cfg,
                                    logits="none", backend=backend, out_rows=last_idx)
            new_state = new_state.replace(mtp_carry=_put(state.mtp_carry, slots, mtp))
        zeros = jnp.zeros(slots.shape, jnp.int32)
        return new_state, zeros, zeros > 0, zeros, jnp.zeros((slots.shape[0], LOGPROB_COLUMNS), jnp.int32)
    prompt_lps = _prompt_logprobs(params, hidden, next_tokens, backend) if prompt_logprobs else None
    h_last = jnp.take_along_axis(hidden, last_idx[:, None, None], axis=1)[:, 0]
    row = lambda a: a.at[slots].get(mode="fill", fill_value=0)  # noqa: E731
    generated0 = jnp.zeros_like(n_valid)
    # the first token always goes through the processing (an identity for requests that set none of it)
    first, logprobs = choose_processed(lm_head(params, h_last, backend)[:, None], lambda n: row(getattr(state, n)),
                                       jnp.zeros((slots.shape[0], 0), jnp.int32), generated0[:, None], generated0,
                                       backend)
    first = first[:, 0]
    prompt_len = jnp.max(positions, axis=1) + 1
    new_state = state.replace(carry=_put(state.carry, slots, carry))

    drafts = jnp.zeros((slots.shape[0], k), jnp.int32)
    if k > 0:
        is_last = (jnp.arange(tokens.shape[1])[None] == last_idx[:, None]) & final[:, None]
        nxt = jnp.where(is_last, first[:, None], next_tokens)
        mtp = _take(state.mtp_carry, slots)
        choice, hm, mtp = mtp_forward(params, nxt, hidden, positions, mtp, cfg=cfg, logits="choice",
                                      backend=backend, out_rows=last_idx)
        drafts, mtp = _draft_rest(params, cfg, k, hm[:, 0], choice, prompt_len, final, mtp, backend)
        if state.oracle is not None:
            oracle = state.oracle.replace(seq=_take(state.oracle.seq, slots))
            drafts = apply_oracle(oracle, drafts, prompt_len, jnp.ones_like(prompt_len), cfg.vocab_size)
        new_state = new_state.replace(mtp_carry=_put(state.mtp_carry, slots, mtp))

    n_emit, finished, reason = _finish(first[:, None], jnp.ones_like(n_valid), generated0, row(state.max_gen),
                                       row(state.stop_ids))
    fslots = jnp.where(final, slots, jnp.iinfo(jnp.int32).max)  # only final rows touch the slot fields
    put = lambda a, v: a.at[fslots].set(v, mode="drop")  # noqa: E731
    new_state = new_state.replace(
        length=put(state.length, prompt_len), last=put(state.last, first),
        drafts=put(state.drafts, drafts) if k > 0 else state.drafts,
        generated=put(state.generated, n_emit), active=put(state.active, ~finished),
        counts=state.counts.at[fslots, first].add(1, mode="drop"),
    )
    if prompt_logprobs:
        return new_state, first, finished & final, reason, logprobs, prompt_lps
    return new_state, first, finished & final, reason, logprobs


def spec_step(params, state: SlotState, *, cfg: Qwen35Config, k: int, backend: Backend, sampling: bool = True,
              features: bool = False):
    """One verify/accept/rollback/draft step for every slot. Returns (state, StepOut dict).

    ``sampling=False`` compiles greedy choice only: right when no slot that counts has temperature > 0, and without
    the sampling conditional, whose predicate costs a host round trip inside the step on GPUs (docs/engine.md).
    ``features``: with the logits processing and log-probabilities (:func:`choose_processed`; implies sampling),
    each position's history holding the drafts before it; the output counts advance by the emitted tokens."""
    act = state.active
    tokens = jnp.concatenate([state.last[:, None], state.drafts[:, :k]], axis=1) if k else state.last[:, None]
    pos = jnp.where(act[:, None], state.length[:, None] + jnp.arange(k + 1), -1)
    logits, hidden, carry = forward(params, tokens, pos, state.carry, cfg=cfg, logits="all", step_states=k > 0,
                                    backend=backend)
    index = state.generated[:, None] + jnp.arange(k + 1)
    if features:
        window = state.drafts[:, :k] if k else jnp.zeros((tokens.shape[0], 0), jnp.int32)
        t, logprobs = choose_processed(logits, lambda n: getattr(state, n), window, index, state.generated, backend)
    else:
        t = choose_tokens(logits, state.temperature, state.top_k, state.top_p, state.seed_lo, state.seed_hi, index,
                          backend, sampling)
    a = (jnp.sum(jnp.cumprod(state.drafts == t[:, :k], axis=1), axis=1).astype(jnp.int32) if k > 0
         else jnp.zeros_like(state.length))
    n = a + 1
    n_emit, finished, reason = _finish(t, n, state.generated, state.max_gen, state.stop_ids)
    n_emit = jnp.where(act, n_emit, 0)
    finished, reason = finished & act, jnp.where(act, reason, NONE)
    # A row commits what it emits: all n tokens, or up to its stop / budget when it finishes, so that a finished
    # slot's state is exactly its prompt and output but the last token (``last``): a prefix-cache snapshot.
    if k > 0:
        carry = commit_window(carry, n_emit, backend)  # inactive rows commit nothing: their carry stays as it was
    new_length = jnp.where(act, state.length + n_emit, state.length)
    new_last = jnp.take_along_axis(t, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]
    new = state.replace(carry=carry, length=new_length, last=jnp.where(act, new_last, state.last),
                        generated=state.generated + n_emit, active=act & ~finished)
    if features:
        new = new.replace(counts=_count_emitted(state.counts, t, n_emit))
    if k > 0:
        choice, hm, mtp = mtp_forward(params, t, hidden, pos, state.mtp_carry, cfg=cfg, logits="choice",
                                      backend=backend, out_rows=a)
        drafts, mtp = _draft_rest(params, cfg, k, hm[:, 0], choice, new_length, new.active, mtp, backend)
        drafts = apply_oracle(state.oracle, drafts, new_length, new.generated, cfg.vocab_size)
        new = new.replace(mtp_carry=mtp, drafts=drafts)
    out = {"tokens": t, "n_emit": n_emit, "accepted": jnp.where(act, a, 0), "finished": finished,
           "reason": reason, "was_active": act}
    if features:
        out["logprobs"] = logprobs
    return new, out


def _map_slot_arrays(fn, state: SlotState, *others: SlotState) -> SlotState:
    """``fn`` over every per-slot array of ``state`` (and the matching arrays of ``others``). The oracle's
    reference rows are per slot; its corruption distribution and seed are shared and kept from ``state``."""
    rows = lambda s: s.replace(oracle=None if s.oracle is None else s.oracle.seq)  # noqa: E731
    out = jax.tree.map(fn, rows(state), *map(rows, others))
    return out.replace(oracle=None if state.oracle is None else state.oracle.replace(seq=out.oracle))


def move_slots(state: SlotState, src, dst) -> SlotState:
    """Move slots ``src[i]`` to ``dst[i]`` (every per-slot field, carries included) and leave ``src`` inactive.

    src/dst: [M] int32, disjoint, padded with out-of-range ids (ignored). Lets the host pack busy slots low, so that
    steps can run over a small prefix of the slots.
    """
    new = _map_slot_arrays(lambda a: _put(a, dst, _take(a, src)), state)
    return new.replace(active=new.active.at[src].set(False, mode="drop"))


def slot_prefix(state: SlotState, n: int) -> SlotState:
    """The state of slots ``0 .. n-1``."""
    return _map_slot_arrays(lambda a: a[:n], state)


def set_slot_prefix(state: SlotState, sub: SlotState) -> SlotState:
    """``state`` with slots ``0 .. n-1`` replaced by ``sub`` (n = sub's slot count)."""
    n = sub.length.shape[0]
    return _map_slot_arrays(lambda a, b: a.at[:n].set(b), state, sub)


def run_steps_on_prefix(params, state: SlotState, *, n: int, **kw):
    """:func:`run_steps` over slots ``0 .. n-1`` only (the others must be inactive): a step then costs what n slots
    cost, at the price of copying those slots' state out and back once per call. Outputs have n slot columns."""
    sub, out = run_steps(params, slot_prefix(state, n), **kw)
    return set_slot_prefix(state, sub), out


def run_steps(params, state: SlotState, *, cfg: Qwen35Config, k: int, num_steps: int, backend: Backend,
              skip_idle: bool = True, unroll: int = 1, sampling: bool = True, features: bool = False):
    """``num_steps`` speculative steps in one device loop (with ``skip_idle``, steps with no active slot are skipped
    by a conditional; else they run masked). ``unroll``: steps per loop iteration (``lax.scan``'s). ``sampling``,
    ``features``: as :func:`spec_step` (sampling False: every active slot is greedy).

    Returns (state, outputs stacked over steps: tokens [N, S, k+1], n_emit/accepted/finished/reason [N, S]; with
    ``features`` also logprobs [N, S, (k+1) * LOGPROB_COLUMNS], :func:`unpack_logprobs`).
    """
    step = functools.partial(spec_step, cfg=cfg, k=k, backend=backend, sampling=sampling, features=features)
    s = state.length.shape[0]
    width = k + 1 + len(_ROW_OUTPUTS) + ((k + 1) * LOGPROB_COLUMNS if features else 0)

    def body(st, _):
        if not skip_idle:
            return _pack(step(params, st))
        return jax.lax.cond(jnp.any(st.active), lambda x: _pack(step(params, x)),
                            lambda x: (x, jnp.zeros((s, width), jnp.int32)), st)

    state, packed = jax.lax.scan(body, state, None, length=num_steps, unroll=unroll)
    return state, _unpack_outputs(packed, k)


# A step's outputs travel as one int32 array [S, k + 1 + 5] (tokens, then one column per row output; the feature
# loops append the packed logprobs): the loop then writes one output buffer per step instead of six, each write a
# kernel of its own (docs/engine.md).
_ROW_OUTPUTS = ("n_emit", "accepted", "finished", "reason", "was_active")
_BOOL_OUTPUTS = ("finished", "was_active")


def _pack(step_result):
    """(state, outputs dict) -> (state, [S, k + 1 + 5] int32)."""
    st, out = step_result
    cols = [out[name].astype(jnp.int32)[:, None] for name in _ROW_OUTPUTS]
    extra = [out["logprobs"]] if "logprobs" in out else []
    return st, jnp.concatenate([out["tokens"].astype(jnp.int32)] + cols + extra, axis=1)


def _unpack_outputs(packed: jax.Array, k: int) -> dict:
    """[N, S, k + 1 + 5] -> tokens [N, S, k+1] and n_emit/accepted/finished/reason/was_active [N, S]."""
    out = {"tokens": packed[..., : k + 1]}
    for i, name in enumerate(_ROW_OUTPUTS):
        col = packed[..., k + 1 + i]
        out[name] = col.astype(bool) if name in _BOOL_OUTPUTS else col
    if packed.shape[-1] > k + 1 + len(_ROW_OUTPUTS):
        out["logprobs"] = packed[..., k + 1 + len(_ROW_OUTPUTS):]
    return out
