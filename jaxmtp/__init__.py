"""jaxmtp: a JAX/Pallas inference engine for Qwen3.5 models with their MTP head as a speculative drafter."""

from jaxmtp.config import ConfigError, Qwen35Config
from jaxmtp.loading import Model, load

__version__ = "0.1.0"

__all__ = ["ConfigError", "Model", "Qwen35Config", "load", "__version__"]
