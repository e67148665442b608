"""The speculative decoding engine: device step functions, host scheduling, memory accounting."""

from jaxmtp.engine.engine import Engine, RequestOutput, SpecStats, TokenLogprob
from jaxmtp.engine.memory import EngineConfigError, MemoryPlan, memory_plan

__all__ = ["Engine", "EngineConfigError", "MemoryPlan", "RequestOutput", "SpecStats", "TokenLogprob", "memory_plan"]
