"""jaxmtp.checks.verify_vs_decode on a small Qwen3.5 layout (XLA): the verify forward's logits and committed GDN states
against one-token decode steps, which on one backend agree to float rounding; and the statistics notice a wrong
commit (a state from one token too many)."""

import jax.numpy as jnp

from jaxmtp import checks
from jaxmtp.benchmarking import random_model, tiny_config


def test_verify_and_plain_paths_agree_and_a_wrong_commit_shows(monkeypatch):
    model = random_model(tiny_config("qwen3.5-0.8b"), jnp.bfloat16, "xla")
    out = checks.verify_vs_decode(model, t=3, windows=2, prompt_len=12, margin=0.05)
    assert out["decided_positions"] > 0 and out["decided_agree"] == out["decided_positions"]
    assert out["logit_max_abs_diff"] < 1e-2 * out["logit_std"]
    assert out["committed_state_max_rel_diff"] < 1e-3

    real = checks.commit_window
    monkeypatch.setattr(checks, "commit_window",
                        lambda steps, n, backend: real(steps, jnp.minimum(n + 1, 3), backend))  # one token too many
    wrong = checks.verify_vs_decode(model, t=3, windows=1, prompt_len=12, margin=0.05)
    assert wrong["committed_state_max_rel_diff"] > 1e-2
