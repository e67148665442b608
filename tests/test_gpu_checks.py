"""The engine's paths against each other on a CUDA GPU, with the kernels' arithmetic (jaxmtp.checks):

* speculative greedy decoding (oracle drafts, every acceptance length) reproduces plain greedy decoding on the
  shipped default model, and at a released shape with random weights parts from it only at near-tied logits;
* the verify forward's logits and committed GDN states match one-token decode steps at a released shape;
* prefill, decode and verify of small dense and MoE models with every kernel match the XLA path.

Run on the GPU machine with ``python -m pytest -m gpu tests/test_gpu_checks.py`` (about 9 minutes on an H100, mostly
compiling; ``-n 5`` runs the five tests side by side); elsewhere they skip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp import checks, shapes
from jaxmtp.benchmarking import random_model

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _cuda():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a CUDA GPU: JAX's default backend here is {jax.default_backend()!r}")


@pytest.fixture(scope="module")
def model_08b():
    """Random bf16 weights of the Qwen3.5-0.8B shape, the serving layout and backend ``auto``."""
    return random_model(shapes.config("qwen3.5-0.8b"), jnp.bfloat16, "auto")


PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    def __init__(self):\n", "for i, line in enumerate(f"]


def test_speculative_greedy_reproduces_plain_greedy_on_the_default_model():
    import jaxmtp
    from jaxmtp.pallas import XLA

    model = jaxmtp.load(progress=False)
    assert model.backend != XLA  # the GPU kernels run, not the references
    prompts = [model.tokenizer.encode(p).ids for p in PROMPTS]
    out = checks.speculative_vs_plain(model, 3, prompts, tokens=64)
    assert out["identical"], {"first_difference": out["first_difference"],
                              "top2_gap_at_difference": out["top2_gap_at_difference"]}
    # uniform oracle corruption over the k + 1 draft indices: drafts were accepted and rejected, every commit length
    assert all(len(a) == 3 and 0 < a[0] < 1 for a in out["acceptance_per_position"]), out
    assert all(1.0 < al < 4.0 for al in out["mean_acceptance_length"]), out


def test_speculative_greedy_parts_from_plain_only_at_near_ties_at_a_released_shape(model_08b):
    """Random bf16 weights have nearly flat logits (std ~0.6 over 248k tokens), so the verify's and the plain step's
    summation orders flip near-tied choices (docs/engine.md); a wrong draft acceptance or commit would part the
    outputs where the plain step's choice was clear."""
    model = model_08b
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, 64).tolist() for _ in range(4)]
    out = checks.speculative_vs_plain(model, 3, prompts, tokens=32)
    gaps = [g for g in out["top2_gap_at_difference"] if g is not None]
    assert all(g < 0.05 for g in gaps), out["top2_gap_at_difference"]


def test_verify_logits_and_committed_states_match_decode_steps_at_a_released_shape(model_08b, monkeypatch):
    model = model_08b
    out = checks.verify_vs_decode(model, t=4, windows=4, prompt_len=100, margin=0.05)
    # The two paths sum bf16 products in different orders: logits and states differ by rounding only.
    assert out["decided_positions"] >= 8 and out["decided_agree"] == out["decided_positions"], out
    assert out["logit_max_abs_diff"] < 0.25 * out["logit_std"], out
    assert out["committed_state_max_rel_diff"] < 0.1, out

    real = checks.commit_window  # a commit of one token too many is far outside that rounding
    monkeypatch.setattr(checks, "commit_window",
                        lambda steps, n, backend: real(steps, jnp.minimum(n + 1, 4), backend))
    wrong = checks.verify_vs_decode(model, t=4, windows=1, prompt_len=100, margin=0.05)
    assert wrong["committed_state_max_rel_diff"] > 0.5, wrong


@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_kernels_match_xla_in_a_model(layout):
    from jaxmtp.pallas import override_backend

    cfg = checks.kernel_check_configs()[layout]
    # The few-row kernels for every product of up to 64 rows and the output kernel for up to 4 (the defaults use
    # them for single rows only), so that decode and verify exercise them.
    kernels = override_backend(checks.all_kernels(), "kernel_max_rows=64,output_gemv_max_rows=4")
    results = checks.kernels_vs_xla(cfg, kernels)
    assert len(results) == 4 and all(c["pass"] for c in results), results
