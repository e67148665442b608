"""scripts/check_verify_logits.py on a small Qwen3.5 layout (XLA): the verify forward's logits and committed GDN states
against one-token decode steps, which on one backend agree to float rounding; and the statistics notice a wrong
commit (a state from one token too many)."""

import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import check_verify_logits  # noqa: E402
from bench_decode import random_model, tiny_config  # noqa: E402
from jaxmtp import shapes  # noqa: E402


def test_verify_and_plain_paths_agree_and_a_wrong_commit_shows(monkeypatch):
    model = random_model(tiny_config(shapes.config("qwen3.5-0.8b")), jnp.bfloat16, "xla")
    out = check_verify_logits.compare(model, t=3, windows=2, prompt_len=12, margin=0.05)
    assert out["decided_positions"] > 0 and out["decided_agree"] == out["decided_positions"]
    assert out["logit_max_abs_diff"] < 1e-2 * out["logit_std"]
    assert out["committed_state_max_rel_diff"] < 1e-3

    real = check_verify_logits.select_steps
    monkeypatch.setattr(check_verify_logits, "select_steps",
                        lambda steps, n, impl: real(steps, jnp.minimum(n + 1, 3), impl))  # commits one more token
    wrong = check_verify_logits.compare(model, t=3, windows=1, prompt_len=12, margin=0.05)
    assert wrong["committed_state_max_rel_diff"] > 1e-2
