import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import hf_builders  # noqa: E402


def pytest_configure(config):
    """Pin JAX to the CPU (before any backend starts), except for ``pytest -m gpu`` (tests/test_gpu_checks.py), which
    keeps JAX's default device, allocating GPU memory as needed so that xdist workers (``-n 4``) can share it."""
    if re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or ""):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if os.environ["JAX_PLATFORMS"] == "cpu":
        # The CPU suite runs tiny models whose run time is negligible next to XLA compilation: compile fast.
        # 8 CPU devices for the tensor-parallel tests (tests/test_parallel.py); the rest run on the first.
        os.environ.setdefault("XLA_FLAGS",
                              "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                              "--xla_force_host_platform_device_count=8")
    import jax

    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """``checkpoint_factory(kind, **options) -> (path, torch_model)``, cached per option set for the session."""
    cache = {}

    def make(kind, **options):
        key = (kind, tuple(sorted(options.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(f"ckpt_{kind}"))
            model = hf_builders.build_checkpoint(kind, path, **options)
            cache[key] = (path, model)
        return cache[key]

    return make


@pytest.fixture(autouse=True)
def _no_executable_store(request, monkeypatch):
    """In-process engines compile their own executables unless a test is marked ``executable_store``: a test that
    patches what a device function computes would otherwise load one stored by an earlier test (the store's key
    sees the package's source, not a patched function). Servers started in subprocesses use the store."""
    if "executable_store" not in request.keywords:
        monkeypatch.setattr("jaxmtp.engine.aot.default_store", lambda: None)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A JAX persistent compilation cache of the module's own (every executable cached; the previous settings
    restored afterwards): servers started twice in a module compile once. Returns its directory."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    path = str(tmp_path_factory.mktemp("jax_cache"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cc.reset_cache()
    yield path
    for k, v in old.items():
        jax.config.update(k, v)
    cc.reset_cache()


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    """A tiny dense checkpoint (GDN value heads twice the key heads) for the serving and start-up tests."""
    return checkpoint_factory("dense", hv_ratio=2)[0]


@pytest.fixture(scope="module")
def model(ckpt):
    """:func:`ckpt` loaded in float32 (a module that needs another model defines its own ``model``)."""
    import jaxmtp

    return jaxmtp.load(ckpt, dtype="float32", progress=False)
