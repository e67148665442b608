"""jaxmtp.benchmarking.hlo_sources (scripts/profile_step.py's HLO-to-source map): a compiled function's kernels point
back to the lines that wrote them (the reference is this file's own line numbers)."""

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxmtp.benchmarking import hlo_sources


def _inner(x):
    return jnp.sin(x) * 3.0  # the fused elementwise op


def _outer(x, y):
    return _inner(x) @ y  # the product


def test_hlo_sources_name_the_writing_lines():
    x, y = (jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32) for _ in range(2))
    text = jax.jit(_outer).lower(x, y).compile().as_text()
    src = hlo_sources(text)
    base = os.path.basename(__file__)
    inner_line = inspect.getsourcelines(_inner)[1] + 1
    outer_line = inspect.getsourcelines(_outer)[1] + 1
    sin_ops = [v for k, v in src.items() if "sine" in k or "sin" in k.split(".")[0]]
    dot_ops = [v for k, v in src.items() if "dot" in k]
    assert dot_ops and all(v.startswith(f"{base}:{outer_line} _outer") for v in dot_ops), dot_ops
    assert any(v.startswith(f"{base}:{inner_line} _inner < {base}:{outer_line} _outer") for v in sin_ops), src
