"""Running tests/bitwise_worker.py, the bit-equality checks on a CPU whose XLA codegen does not depend on shapes."""

import json
import os
import subprocess
import sys

import pytest


def run_worker(*args: str, timeout: float = 1200) -> dict:
    """The worker's JSON result for ``args``, from a subprocess (its XLA flags must be set before the backend starts);
    skips where this XLA does not know the flags."""
    worker = os.path.join(os.path.dirname(__file__), "bitwise_worker.py")
    env = {key: v for key, v in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, worker, *args], capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode and "Unknown flag in XLA_FLAGS" in proc.stderr:
        pytest.skip("this XLA lacks a flag of jaxmtp.pallas.collectives.SHAPE_STABLE_CPU_XLA_FLAGS")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
