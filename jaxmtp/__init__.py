"""jaxmtp: a JAX/Pallas inference engine for Qwen3.5 models with their MTP head as a speculative drafter."""

from jaxmtp.config import ConfigError, Qwen35Config
from jaxmtp.engine import Engine, EngineConfigError, memory_plan
from jaxmtp.generation import GenerationResult, StreamChunk, generate, generate_stream
from jaxmtp.loading import Model, load
from jaxmtp.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "Engine", "EngineConfigError", "GenerationResult", "Model", "Qwen35Config", "SamplingParams",
    "StreamChunk", "generate", "generate_stream", "load", "memory_plan", "__version__",
]
