"""Chat templates rendered the way ``transformers``' ``tokenizer.apply_chat_template(..., tokenize=False)`` renders
them, without transformers.

What the template sees is what transformers passes: ``messages`` (keys whose value is None dropped; a message's
``reasoning_content`` also under ``thinking``, and ``thinking`` / ``reasoning`` copied to ``reasoning_content``),
``tools`` (JSON schemas, or None), ``documents`` (None), ``add_generation_prompt``, the tokenizer's special tokens
that are set (``bos_token``, ``eos_token``, ``pad_token``, ... from ``tokenizer_config.json``) and any extra keyword
(``chat_template_kwargs`` such as ``enable_thinking``, ``tool_choice``), which override the special tokens. The
Jinja environment is transformers' too: an ``ImmutableSandboxedEnvironment`` with ``trim_blocks``,
``lstrip_blocks`` and ``loopcontrols``; a ``tojson`` filter that is ``json.dumps`` (no HTML escaping, non-ASCII kept,
``indent`` / ``separators`` / ``sort_keys`` honoured); ``raise_exception``, ``strftime_now``, ``namespace`` (no
underscore names) and ``dict``; and the ``{% generation %}`` block (rendered as its body).

    tpl = ChatTemplate.from_model(model)          # None if the checkpoint has no chat template
    text = tpl.render(messages, tools=tools, add_generation_prompt=True, enable_thinking=False)
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Mapping

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template failed on these inputs (``raise_exception`` in the template, or a Jinja error)."""


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Jinja's ``namespace`` without underscore-prefixed attributes (no reach into Python internals)."""

        def __init__(*args, **kwargs):  # noqa: N805 - Jinja's own signature trick, so that namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")

    class DictFactory:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=DictFactory(),
                       namespace=Namespace)
    return env.from_string(source), env


def _plain(value: Any) -> Any:
    """JSON-typed copy of template input (strings, numbers, bools, None, dicts, lists); pydantic models are dumped,
    anything else becomes an inert ``<TypeName>`` string, as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages) -> list[dict]:
    """Messages as transformers hands them to the template: plain dicts, None-valued keys dropped, reasoning under
    ``reasoning_content`` and ``thinking``."""
    out = []
    for m in messages:
        if callable(getattr(m, "model_dump", None)):
            m = m.model_dump()
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"chat messages must be objects, got {type(m).__name__}")
        m = {k: v for k, v in _plain(dict(m)).items() if v is not None}
        reasoning = next((m[k] for k in REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def special_tokens(model_dir: str | None) -> dict[str, str]:
    """The special tokens set in ``tokenizer_config.json`` (string or ``{"content": ...}`` entries), as
    ``tokenizer.special_tokens_map`` holds them."""
    if not model_dir:
        return {}
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        cfg = json.load(f)
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        v = cfg.get(key)
        if isinstance(v, Mapping):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with.

    Args:
        source: the Jinja source.
        special: ``{"bos_token": ..., "eos_token": ...}`` (only those that are set).
    """

    def __init__(self, source: str, special: Mapping[str, str] | None = None):
        self.source = source
        self.special = dict(special or {})
        try:
            self._template, env = _compile(source)
        except Exception as e:  # noqa: BLE001 - a syntax error in the checkpoint's template
            raise ChatTemplateError(f"the chat template does not compile: {e}") from None
        from jinja2 import meta

        self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))

    @classmethod
    def from_model(cls, model) -> "ChatTemplate | None":
        """The template of a loaded :class:`jaxmtp.Model` (None if its checkpoint has none)."""
        if not model.chat_template:
            return None
        return cls(model.chat_template, special_tokens(model.path))

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads ``tools`` (otherwise a request's tools would be dropped silently)."""
        return "tools" in self.variables

    def render(self, messages, tools=None, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text. ``kwargs`` are extra template variables (they override the special tokens). Raises
        :class:`ChatTemplateError` when the template fails on the inputs."""
        import jinja2

        if not messages:
            raise ChatTemplateError("the chat has no messages")
        variables = {**self.special, **_plain(kwargs)}
        try:
            return self._template.render(messages=normalize_messages(messages), tools=_plain(tools), documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e!r}") from None
