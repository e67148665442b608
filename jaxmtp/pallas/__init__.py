"""Pallas kernels for the hot paths, each beside a pure-jnp reference with the same signature.

:mod:`jaxmtp.pallas.ops` is the API the model's layers call; :class:`Backend` names the implementation per op and
carries the :class:`KernelPolicy` (every dispatch threshold and tile default); ``resolve_backend("auto")`` picks
per platform, ``"xla"`` forces the references everywhere. Implementation names: ``"xla"``, ``"triton"`` (GPU),
``"mosaic_tpu"`` (TPU), and ``"triton_interpret"`` / ``"mosaic_tpu_interpret"`` (the same kernels in the Pallas
interpreter, for CPU tests). docs/kernels.md describes the kernels and the measurements behind the choices.
"""

from jaxmtp.pallas._common import KERNELS, MOSAIC_TPU, MOSAIC_TPU_INTERPRET, TRITON, TRITON_INTERPRET
from jaxmtp.pallas.backend import XLA, Backend, auto_backend, override_backend, resolve_backend
from jaxmtp.pallas.policy import DEFAULT_POLICY, KernelPolicy

__all__ = ["DEFAULT_POLICY", "KERNELS", "MOSAIC_TPU", "MOSAIC_TPU_INTERPRET", "TRITON", "TRITON_INTERPRET", "XLA",
           "Backend", "KernelPolicy", "auto_backend", "override_backend", "resolve_backend"]
