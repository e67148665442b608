"""Qwen3.5 chat output -> OpenAI message parts: ``reasoning_content``, ``content`` and ``tool_calls``.

Qwen3.5 (like Qwen3-Coder) writes its reasoning in a ``<think>...</think>`` block (the generation prompt usually
opens it, so the output starts inside it) and calls tools in an XML-style format, one ``<tool_call>`` block per
call::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value loses one leading and one trailing newline and is converted by the type its tool's JSON schema
gives it (integer, number, boolean, object / array as JSON; strings stay strings; ``null`` is None), as vLLM's
``qwen3_coder`` parser does; the arguments become a JSON object string.

:class:`ChatOutputParser` is incremental: ``feed(delta_text)`` returns the parts that are certain so far, holding back
text that may be the start of a tag (``</thi``, ``<tool_c``...) and whitespace that may precede ``</think>`` or a
call (it is dropped there);
``finish()`` flushes the rest (an unterminated tool call is closed with the parameters read so far). The
non-streamed result is the same parser run over the whole text (:func:`parse_chat_output`), so streamed and
non-streamed outputs always agree.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import uuid
from typing import Any, Sequence

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAM_START, PARAM_END = "<parameter=", "</parameter>"

REASONING, CONTENT, TOOL_CALL, FUNCTION, PARAM = "reasoning", "content", "tool_call", "function", "parameter"


@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object


@dataclasses.dataclass
class Part:
    """One piece of parsed output: ``kind`` is "reasoning" or "content" (``text``), "tool_call" (a call begins:
    ``index``, ``id``, ``name``) or "tool_arguments" (its complete ``arguments`` JSON, for call ``index``)."""

    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


@dataclasses.dataclass
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def _partial_tag_suffix(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def _tool_schemas(tools) -> dict[str, dict]:
    """{function name: its parameters' JSON-schema properties} from OpenAI ``tools``."""
    out = {}
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def convert_parameter(value: str, schema: Any) -> Any:
    """A parameter's text -> the JSON value its schema's ``type`` asks for (the text itself if it does not parse)."""
    if value.lower() == "null":
        return None
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):  # e.g. ["integer", "null"]
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float", "double")):
        try:
            f = float(value)
        except ValueError:
            return value
        return int(f) if f.is_integer() and "." not in value and "e" not in value.lower() else f
    if kind in ("boolean", "bool", "binary"):
        low = value.strip().lower()
        return low == "true" if low in ("true", "false") else value
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


class ChatOutputParser:
    """Incremental parser of one chat completion's text.

    Args:
        reasoning: parse a ``<think>`` block (the template uses one).
        in_reasoning: the prompt ended inside an open ``<think>`` block, so the output starts in the reasoning.
        tools: the request's OpenAI ``tools`` (their schemas type the parameters), or None not to parse tool calls.
    """

    def __init__(self, reasoning: bool = False, in_reasoning: bool = False, tools: Sequence[dict] | None = None):
        self.reasoning = reasoning
        self.parse_tools = tools is not None
        self._schemas = _tool_schemas(tools)
        self._state = REASONING if (reasoning and in_reasoning) else CONTENT
        self._buf = ""
        self._at_start = True  # nothing but whitespace seen yet (a leading <think> may open the reasoning)
        self._strip = "\n" if self._state == REASONING else ""  # leading characters to drop in the current part
        self._calls: list[ToolCall] = []
        self._params: dict[str, Any] = {}
        self._param_name = ""
        self._param_value = ""
        self._block_has_function = False
        self._raw_arguments: str | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    # ---- public ---------------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Part]:
        self._buf += text
        out: list[Part] = []
        while self._step(out, final=False):
            pass
        return _merge(out)

    def finish(self) -> list[Part]:
        out: list[Part] = []
        while self._step(out, final=True):
            pass
        if self._state in (FUNCTION, PARAM):  # cut off inside a call: close it with what was read
            if self._state == PARAM:
                self._end_param(self._param_value + self._buf)
            self._buf = ""
            self._end_function(out)
        elif self._state in (REASONING, CONTENT) and self._buf:
            self._emit(out, self._state, self._buf)
        self._buf = ""
        return _merge(out)

    # ---- the state machine ----------------------------------------------------------------------------------------
    def _step(self, out: list[Part], final: bool) -> bool:
        """Consume what can be decided from the buffer; True if the state changed (call again)."""
        buf = self._buf
        if self._strip:
            kept = buf.lstrip(self._strip)
            if not kept:
                self._buf = ""
                return False
            self._buf = buf = kept
            self._strip = ""
        st = self._state
        if st == REASONING:
            if self._at_start and buf.startswith(THINK_START):  # an explicit opening tag: not reasoning text
                self._buf, self._strip = buf[len(THINK_START):], "\n"
                self._at_start = False
                return True
            if self._at_start and THINK_START.startswith(buf) and not final:
                return False
            self._at_start = False
            i = buf.find(THINK_END)
            if i >= 0:
                self._emit(out, REASONING, buf[:i].rstrip("\n"))
                self._buf, self._state, self._strip = buf[i + len(THINK_END):], CONTENT, "\n"
                return True
            hold = 0 if final else _partial_tag_suffix(buf, (THINK_END,))
            body = buf[: len(buf) - hold]
            keep = body.rstrip("\n")  # newlines right before </think> (or the end) are dropped
            self._emit(out, REASONING, keep)
            self._buf = "" if final else buf[len(keep):]
            return False
        if st == CONTENT:
            tags = []
            if self.parse_tools:
                tags.append(TOOL_START)
            if self.reasoning and self._at_start:
                stripped = buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._buf, self._state, self._strip = stripped[len(THINK_START):], REASONING, "\n"
                    self._at_start = False
                    return True
                if THINK_START.startswith(stripped) and not final:  # whitespace or the start of <think>
                    return False
            if buf.strip():
                self._at_start = False
            i = buf.find(TOOL_START) if self.parse_tools else -1
            if i >= 0:  # whitespace between the content and a call is dropped
                self._emit(out, CONTENT, buf[:i].rstrip())
                self._buf, self._state = buf[i + len(TOOL_START):], TOOL_CALL
                self._block_has_function = False
                return True
            end = len(buf) if final else len(buf) - _partial_tag_suffix(buf, tags)
            if self.parse_tools and not final:  # whitespace may precede a call: held until text follows
                end = len(buf[:end].rstrip())
            self._emit(out, CONTENT, buf[:end])
            self._buf = buf[end:]
            return False
        if st == TOOL_CALL:
            i, j = buf.find(FUNCTION_START), buf.find(TOOL_END)
            if j >= 0 and (i < 0 or j < i):  # the block ends: back to content (whitespace after it dropped)
                called = self._block_has_function or self._json_call(out, buf[:j])
                self._buf, self._state = buf[j + len(TOOL_END):], CONTENT
                self._strip = " \t\r\n" if called else ""
                return True
            if i >= 0:
                k = buf.find(">", i)
                if k < 0:
                    return False
                name = buf[i + len(FUNCTION_START):k].strip()
                self._start_call(out, name)
                self._block_has_function = True
                self._params = {}
                self._buf, self._state = buf[k + 1:], FUNCTION
                return True
            if final:
                if not self._block_has_function and buf.strip():
                    self._emit(out, CONTENT, TOOL_START + buf)  # an unterminated block that is no call
                self._buf = ""
            return False
        if st == FUNCTION:
            i, j = buf.find(PARAM_START), buf.find(FUNCTION_END)
            if j >= 0 and (i < 0 or j < i):
                self._buf = buf[j + len(FUNCTION_END):]
                self._end_function(out)
                self._state = TOOL_CALL
                return True
            if i >= 0:
                k = buf.find(">", i)
                if k < 0:
                    return False
                self._param_name = buf[i + len(PARAM_START):k].strip()
                self._param_value = ""
                self._buf, self._state = buf[k + 1:], PARAM
                return True
            return False
        if st == PARAM:  # a value ends at </parameter> (or, leniently, where the next parameter or the call begins)
            ends = [(buf.find(t), t) for t in (PARAM_END, PARAM_START, FUNCTION_END)]
            ends = [(i, t) for i, t in ends if i >= 0]
            if not ends:
                return False
            i, tag = min(ends)
            self._end_param(buf[:i])
            self._buf = buf[i + len(PARAM_END):] if tag == PARAM_END else buf[i:]
            self._state = FUNCTION
            return True
        raise AssertionError(st)

    def _emit(self, out: list[Part], kind: str, text: str) -> None:
        if text:
            out.append(Part(kind, text=text))

    def _start_call(self, out: list[Part], name: str) -> None:
        call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments="")
        self._calls.append(call)
        out.append(Part("tool_call", index=len(self._calls) - 1, id=call.id, name=name))

    def _json_call(self, out: list[Part], block: str) -> bool:
        """A block in the JSON form (``{"name": ..., "arguments": {...}}``, Qwen3's): a call; anything else is
        content, tags included."""
        try:
            obj = json.loads(block)
            ok = isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(
                obj.get("arguments", {}), (dict, str))
        except ValueError:
            ok = False
        if not ok:
            self._emit(out, CONTENT, TOOL_START + block + TOOL_END)
            return False
        args = obj.get("arguments", {})
        self._start_call(out, obj["name"])
        self._params = args if isinstance(args, dict) else None
        self._raw_arguments = args if isinstance(args, str) else None
        self._end_function(out)
        return True

    def _end_param(self, value: str) -> None:
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        call = self._calls[-1]
        schema = self._schemas.get(call.name, {}).get(self._param_name)
        self._params[self._param_name] = convert_parameter(value, schema)

    def _end_function(self, out: list[Part]) -> None:
        call = self._calls[-1]
        call.arguments = (json.dumps(self._params, ensure_ascii=False) if self._params is not None
                          else self._raw_arguments)
        out.append(Part("tool_arguments", index=len(self._calls) - 1, id=call.id, name=call.name,
                        text=call.arguments))
        self._params = {}


def _merge(parts: list[Part]) -> list[Part]:
    """Adjacent text parts of one kind joined."""
    out: list[Part] = []
    for p in parts:
        if out and p.kind in (REASONING, CONTENT) and out[-1].kind == p.kind:
            out[-1] = Part(p.kind, text=out[-1].text + p.text)
        else:
            out.append(p)
    return out


def parse_chat_output(text: str, reasoning: bool = False, in_reasoning: bool = False,
                      tools: Sequence[dict] | None = None) -> ParsedOutput:
    """A whole completion's text parsed at once (the same parser as streaming)."""
    p = ChatOutputParser(reasoning=reasoning, in_reasoning=in_reasoning, tools=tools)
    parts = p.feed(text) + p.finish()
    reasoning_text = "".join(x.text for x in parts if x.kind == REASONING)
    content = "".join(x.text for x in parts if x.kind == CONTENT)
    return ParsedOutput(reasoning=reasoning_text or None, content=content or None, tool_calls=p.tool_calls)


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block (its generation prompt opened it)."""
    i = prompt.rfind(THINK_START)
    return i >= 0 and prompt.find(THINK_END, i) < 0
