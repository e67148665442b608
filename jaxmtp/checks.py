"""Correctness checks that compare two of the engine's paths on the device they run on (tests/test_gpu_checks.py runs
them on a GPU, where the kernels' arithmetic differs from the CPU's):

* :func:`speculative_vs_plain`: greedy tokens of the speculative engine (oracle drafts, every acceptance length
  exercised) against plain greedy decoding;
* :func:`verify_vs_decode`: one verify forward's logits and committed GDN states against one-token decode steps;
* :func:`kernels_vs_xla`: prefill, decode and verify of a small model with every kernel against the XLA path.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.config import FULL, LINEAR, Qwen35Config
from jaxmtp.engine import Engine
from jaxmtp.model import GDNCarry, commit_window, forward, init_carry, init_params
from jaxmtp.pallas import XLA, Backend
from jaxmtp.param_layout import fuse_projections, set_output_layout, transposes_outputs
from jaxmtp.sampling import SamplingParams


# ---------------------------------------------------------------------------------------------------------------
# speculative against plain decoding
# ---------------------------------------------------------------------------------------------------------------
def greedy_outputs(engine: Engine, prompts, tokens: int, continuations=None):
    """Greedy ``tokens`` tokens for each prompt through ``engine`` (oracle drafts from ``continuations`` where given):
    ``(token lists, per-request SpecStats)`` in prompt order."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params, oracle_continuation=None if continuations is None else continuations[i])
            for i, p in enumerate(prompts)]
    out, final = collections.defaultdict(list), {}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
            if o.finished:
                final[o.request_id] = o
    return [out[r] for r in rids], [final[r].stats for r in rids]


def speculative_vs_plain(model, k: int, prompts, tokens: int) -> dict:
    """Plain greedy decoding of ``prompts`` (token-id lists), then the speculative engine with k = ``k`` and oracle
    drafts: the plain output, corrupted at a uniformly drawn index per step, so that every acceptance length 0..k
    occurs and every commit length is exercised. Greedy speculative decoding must reproduce the plain tokens
    (except where bf16 near-ties let the two paths' summation orders choose differently: docs/engine.md).

    Returns ``identical`` (all prompts), ``identical_per_prompt``, ``first_difference`` (index or None per prompt),
    ``top2_gap_at_difference`` (per prompt: the plain model's top-two logit gap where the outputs first differ, None
    where they do not: a near-tie explains a difference, a wide gap is a bug), ``acceptance_per_position`` and
    ``mean_acceptance_length`` per prompt, and both outputs."""
    longest = max(len(p) for p in prompts)
    common = dict(num_slots=len(prompts), max_context=longest + tokens + 8, check_memory=False)
    plain, _ = greedy_outputs(Engine(model, num_draft_tokens=0, **common), prompts, tokens)
    spec_engine = Engine(model, num_draft_tokens=k, oracle_probs=[1 / (k + 1)] * (k + 1), **common)
    spec, stats = greedy_outputs(spec_engine, prompts, tokens, continuations=plain)
    same = [a == b for a, b in zip(plain, spec)]
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(plain, spec)]
    gaps = top2_gaps(model, [None if d is None else list(p) + o[:d] for p, o, d in zip(prompts, plain, first)])
    return {"k": k, "identical": all(same), "identical_per_prompt": same, "first_difference": first,
            "top2_gap_at_difference": gaps, "acceptance_per_position": [s.acceptance_per_position for s in stats],
            "mean_acceptance_length": [s.mean_acceptance_length for s in stats], "plain": plain, "spec": spec}


def top2_gaps(model, seqs) -> list:
    """For each token list of ``seqs`` (None: skipped), the gap between the two largest next-token logits after it,
    from one full forward (:meth:`Model.logits`) over the lists right-padded to one length (causal: the padding does
    not reach the rows read)."""
    rows = [s for s in seqs if s is not None]
    if not rows:
        return [None] * len(seqs)
    width = max(len(s) for s in rows)
    logits = model.logits([s + [0] * (width - len(s)) for s in rows])
    top2 = [np.sort(logits[i, len(s) - 1].astype(np.float64))[-2:] for i, s in enumerate(rows)]
    gaps = iter(float(t[1] - t[0]) for t in top2)
    return [None if s is None else next(gaps) for s in seqs]


# ---------------------------------------------------------------------------------------------------------------
# verify forward against decode steps
# ---------------------------------------------------------------------------------------------------------------
def verify_vs_decode(model, t: int, windows: int, prompt_len: int, margin: float, seed: int = 0) -> dict:
    """After one random prompt of ``prompt_len`` tokens, for ``windows`` random windows of ``t`` tokens: the
    target's logits from one verify forward (``step_states=True``, the k = t-1 step's path) against those of t
    one-token decode steps (the plain step's path), and the GDN states that committing each prefix n = 1..t leaves
    against the decode steps' states after n tokens.

    Returns ``logit_max_abs_diff`` / ``logit_median_max_abs_diff`` (per position, max over the vocabulary),
    ``logit_std`` (median over positions of the decode logits' std), ``decided_positions`` (where the decode step's
    top two logits are more than ``margin`` apart) and ``decided_agree`` (of those, where both paths pick the same
    token), ``undecided_flips_top2_gaps`` (the top-2 gaps where an undecided choice differs) and
    ``committed_state_max_rel_diff`` (max abs difference over the state's max abs value)."""
    cfg, params, backend = model.config, model.params, model.backend
    fwd = jax.jit(functools.partial(forward, cfg=cfg, backend=backend), static_argnames="step_states")
    commit = jax.jit(lambda steps, n: commit_window(steps, n, backend))
    rng = np.random.default_rng(seed)
    ids = lambda n: jnp.asarray(rng.integers(0, cfg.vocab_size, (1, n)), jnp.int32)  # noqa: E731
    _, _, carry = fwd(params, ids(prompt_len), jnp.arange(prompt_len, dtype=jnp.int32)[None],
                      init_carry(cfg, 1, prompt_len + t + 8, model.dtype))
    pos = prompt_len + jnp.arange(t, dtype=jnp.int32)[None]
    diffs, scales, agree, decided, flips, state_err = [], [], 0, 0, [], 0.0
    for _ in range(windows):
        toks = ids(t)
        verify, _, steps = fwd(params, toks, pos, carry, step_states=True)
        c, plain, plain_states = carry, [], []
        for i in range(t):
            logits, _, c = fwd(params, toks[:, i : i + 1], pos[:, i : i + 1], c)
            plain.append(np.asarray(logits[0, 0], np.float64))
            plain_states.append([np.asarray(x.state, np.float64) for x in c if isinstance(x, GDNCarry)])
        verify = np.asarray(verify[0], np.float64)
        for i in range(t):
            diffs.append(float(np.abs(verify[i] - plain[i]).max()))
            scales.append(float(plain[i].std()))
            top2 = np.sort(plain[i])[-2:]
            same = int(np.argmax(verify[i])) == int(np.argmax(plain[i]))
            if top2[1] - top2[0] > margin:
                decided += 1
                agree += same
            elif not same:
                flips.append(float(top2[1] - top2[0]))
        for n in range(1, t + 1):
            got = [np.asarray(x.state, np.float64) for x in commit(steps, jnp.asarray([n], jnp.int32))
                   if isinstance(x, GDNCarry)]
            for g, w in zip(got, plain_states[n - 1]):
                state_err = max(state_err, float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)))
    return {"logit_max_abs_diff": max(diffs), "logit_median_max_abs_diff": float(np.median(diffs)),
            "logit_std": float(np.median(scales)), "decided_positions": decided, "decided_agree": agree,
            "undecided_flips_top2_gaps": flips, "committed_state_max_rel_diff": state_err}


# ---------------------------------------------------------------------------------------------------------------
# every kernel against the XLA path, in a model
# ---------------------------------------------------------------------------------------------------------------
def kernel_check_configs(small: bool = False) -> dict[str, Qwen35Config]:
    """``{"dense": ..., "moe": ...}``: four-layer random Qwen3.5 models with real head sizes (``small``: tiny ones,
    for interpret mode on a CPU)."""
    dense = Qwen35Config(
        family="qwen3_5", vocab_size=64 if small else 2048, hidden_size=64 if small else 1024, num_hidden_layers=4,
        num_attention_heads=4 if small else 16, num_key_value_heads=2, head_dim=32 if small else 256,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL), linear_num_key_heads=2 if small else 16,
        linear_num_value_heads=4 if small else 32, linear_key_head_dim=16 if small else 128,
        linear_value_head_dim=16 if small else 128, intermediate_size=64 if small else 2048)
    moe = dataclasses.replace(dense, family="qwen3_5_moe", intermediate_size=0, num_experts=8 if small else 64,
                              num_experts_per_tok=2 if small else 8, moe_intermediate_size=32 if small else 256,
                              shared_expert_intermediate_size=32 if small else 256, moe_layers=(True,) * 4)
    return {"dense": dense, "moe": moe}


def all_kernels(kind: str = "triton") -> Backend:
    """A backend that runs every op's kernel (``kind``: "triton" or "triton_interpret")."""
    return Backend(attention=kind, gdn_chunk=kind, gdn_recurrent=kind, moe=kind, matmul=kind, norm=kind,
                   gdn_mixer=kind, attention_prelude=kind, out_matmul=kind)


def _rel_err(got, want, mask=None) -> tuple[float, bool]:
    """(||got - want|| / ||want|| in float64 over ``mask``, whether ``got`` is finite)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if mask is not None:
        got, want = np.where(mask, got, 0), np.where(mask, want, 0)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)), bool(np.isfinite(got).all())


def kernels_vs_xla(cfg: Qwen35Config, kernels: Backend, seed: int = 0) -> list[dict]:
    """Prefill (two rows, one padded), a decode step and a 4-token verify (``step_states=True``, prefixes of 4 and 2
    committed with the backend's recurrent rule) of random ``cfg`` weights in the serving layout, with ``kernels``
    against the XLA path, bf16, and both against a float32 truth (the same bf16 weights, float32 activations, XLA at
    full precision).

    Returns a list of checks ``{"check", "value", "tol", "finite", "pass", ...}``. Logits pass if the kernels are
    within 2e-2 of XLA, or (MoE: bf16 noise flips top-k routing, which moves both paths far from float32) no further
    from float32 than XLA's bf16 path (x 1.25): ``value`` is the smaller of the two ratios to their bound. The
    verify's GDN step states: within 2e-2 of XLA's."""
    params = fuse_projections(init_params(cfg, jax.random.key(seed), jnp.bfloat16))  # serving layout: fused mixer
    transposed = set_output_layout(jax.tree.map(lambda a: a, params), True)  # what the output kernel reads
    b, t0, cap = 2, 200, 256
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t0 + 5)), jnp.int32)
    pre = np.broadcast_to(np.arange(t0, dtype=np.int32), (b, t0)).copy()
    pre[1, 150:] = -1
    lens = np.array([t0, 150])

    def run(backend, dtype=jnp.bfloat16):
        fwd = jax.jit(functools.partial(forward, cfg=cfg, backend=backend), static_argnames="step_states")
        src = transposed if transposes_outputs(backend) else params
        p = jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.bfloat16 else a, src)
        logits_p, _, carry = fwd(p, ids[:, :t0], jnp.asarray(pre), init_carry(cfg, b, cap, dtype))
        logits_d, _, carry = fwd(p, ids[:, t0 : t0 + 1], jnp.asarray(lens[:, None], jnp.int32), carry)
        vpos = jnp.asarray(lens[:, None] + 1 + np.arange(4)[None], jnp.int32)
        logits_v, _, steps = fwd(p, ids[:, t0 + 1 : t0 + 5], vpos, carry, step_states=True)
        n = jnp.asarray([4, 2], jnp.int32)
        states = [c.state for c in commit_window(steps, n, backend) if isinstance(c, GDNCarry)]
        return [logits_p, logits_d, logits_v], states

    checks = []

    def add(name, value, finite, tol, **extra):
        checks.append({"check": name, "value": value, "tol": tol, "finite": finite, "pass": finite and value < tol,
                       **extra})

    got, got_s = run(kernels)
    want, want_s = run(XLA)
    with jax.default_matmul_precision("highest"):  # XLA:GPU would otherwise use TF32 for float32 products
        truth, truth_s = run(XLA, jnp.float32)
    mask = (pre >= 0)[:, :, None]
    for name, g_, w_, t_, m in zip(["prefill", "decode", "verify"], got, want, truth, [mask, None, None]):
        err, fin = _rel_err(g_, w_, m)
        k_f32, x_f32 = _rel_err(g_, t_, m)[0], _rel_err(w_, t_, m)[0]
        agree = float(np.mean(np.argmax(np.asarray(g_), -1) == np.argmax(np.asarray(w_), -1)))
        add(f"{name} logits bf16", min(err / 2e-2, k_f32 / max(1.25 * x_f32, 1e-30)), fin, 1.0,
            kernels_vs_xla=err, argmax_agreement=agree, kernels_vs_f32=k_f32, xla_bf16_vs_f32=x_f32)
    add("verify GDN step states bf16", max(_rel_err(g_, w_)[0] for g_, w_ in zip(got_s, want_s)),
        all(bool(np.isfinite(np.asarray(g_)).all()) for g_ in got_s), 2e-2,
        kernels_vs_f32=max(_rel_err(g_, t_)[0] for g_, t_ in zip(got_s, truth_s)),
        xla_bf16_vs_f32=max(_rel_err(w_, t_)[0] for w_, t_ in zip(want_s, truth_s)))
    return checks
