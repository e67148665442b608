"""gRPC serving for jaxmtp: the protocol (:mod:`~jaxmtp.serving.protocol`), the continuous-batching scheduler
(:mod:`~jaxmtp.serving.scheduler`), the server (:mod:`~jaxmtp.serving.server`, ``python -m jaxmtp.serve``), a
client (:mod:`~jaxmtp.serving.client`, ``python -m jaxmtp.client``), and the OpenAI-compatible HTTP API beside it
(:mod:`~jaxmtp.serving.http_api`, with :mod:`~jaxmtp.serving.chat_template`, :mod:`~jaxmtp.serving.tool_parser`
and :mod:`~jaxmtp.serving.metrics`). See docs/serving.md.
"""

from jaxmtp.serving.client import Client, Completion, GenerationError

__all__ = ["Client", "Completion", "GenerationError"]
