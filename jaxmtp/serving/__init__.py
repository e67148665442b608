"""gRPC serving for jaxmtp: the protocol (:mod:`~jaxmtp.serving.protocol`), the continuous-batching scheduler
(:mod:`~jaxmtp.serving.scheduler`), the server (:mod:`~jaxmtp.serving.server`, ``python -m jaxmtp.serve``) and a
client (:mod:`~jaxmtp.serving.client`, ``python -m jaxmtp.client``). See docs/serving.md.
"""

from jaxmtp.serving.client import Client, Completion, GenerationError

__all__ = ["Client", "Completion", "GenerationError"]
