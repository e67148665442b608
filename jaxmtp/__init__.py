"""jaxmtp: a JAX/Pallas inference engine for Qwen3.5 models with their MTP head as a speculative drafter.

The public names are imported lazily, so ``import jaxmtp`` (and ``python -m jaxmtp.client``) does not load JAX.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "jaxmtp.config",
    "Qwen35Config": "jaxmtp.config",
    "Engine": "jaxmtp.engine",
    "EngineConfigError": "jaxmtp.engine",
    "memory_plan": "jaxmtp.engine",
    "TokenLogprob": "jaxmtp.engine",
    "GenerationResult": "jaxmtp.generation",
    "StreamChunk": "jaxmtp.generation",
    "generate": "jaxmtp.generation",
    "generate_stream": "jaxmtp.generation",
    "Model": "jaxmtp.loaded_model",
    "load": "jaxmtp.loaded_model",
    "SamplingParams": "jaxmtp.sampling",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxmtp' has no attribute {name!r}")


def __dir__():
    return __all__
