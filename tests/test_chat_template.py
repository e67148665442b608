"""Chat templates: :mod:`jaxmtp.serving.chat_template` renders exactly what ``transformers``' ``apply_chat_template``
renders, on a template with Qwen3.5's features (system / user / assistant / tool roles, a tools list through
``tojson``, tool calls in the XML form, ``<think>`` history handling, ``enable_thinking``) and on one that exercises
the rest of the environment (``bos_token`` / ``eos_token``, ``loopcontrols``, ``namespace``, ``{% generation %}``,
``raise_exception``); plus the shipped default model's own template."""

import json
import os
import shutil

import pytest

from jaxmtp.default_model import default_model_path
from jaxmtp.serving.chat_template import ChatTemplate, ChatTemplateError, special_tokens

transformers = pytest.importorskip("transformers")

QWEN_LIKE = r"""{%- set image_count = namespace(value=0) %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n" }}
    {{- "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n" }}
    {{- "</function>\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- set is_query = message.role == "user" and message.content is string %}
    {%- if is_query and message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>') %}
        {%- set is_query = false %}
    {%- endif %}
    {%- if ns.multi_step_tool and is_query %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n') %}
            {%- set reasoning_content = reasoning_content.split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') }}
            {{- '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first and content.strip() %}
                    {{- '\n\n' }}
                {%- elif not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- if args_value is mapping or (args_value is sequence and args_value is not string) %}
                            {%- set args_value = args_value | tojson | safe %}
                        {%- else %}
                            {%- set args_value = args_value | string %}
                        {%- endif %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""

ENV_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(n=0) %}
{%- for m in messages %}
{%- if m.role == 'stop' %}{% break %}{% endif %}
{%- if m.role == 'skip' %}{% continue %}{% endif %}
{%- set ns.n = ns.n + 1 %}
{%- if m.role == 'assistant' %}
{% generation %}[{{ ns.n }}] A: {{ m.content }}{{ eos_token }}{% endgeneration %}
{%- elif m.role == 'bad' %}
{{- raise_exception('role bad is not allowed') }}
{%- else %}
[{{ ns.n }}] {{ m.role | upper }}: {{ m.content }}
{%- endif %}
{%- endfor %}
{%- if extra is defined %}{{ extra | tojson(indent=2, sort_keys=True) }}{% endif %}
{%- if add_generation_prompt %}
A:{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & \"later\" for a city (Zürich, 東京)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                                      "filters": {"type": "object"}}}}}

CASES = {
    "user only": dict(messages=[{"role": "user", "content": "Hello"}]),
    "system and user": dict(messages=[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi <b>there</b> & ünïcode"}]),
    "thinking off": dict(messages=[{"role": "user", "content": "2+2?"}], enable_thinking=False),
    "thinking on": dict(messages=[{"role": "user", "content": "2+2?"}], enable_thinking=True),
    "no generation prompt": dict(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                 add_generation_prompt=False),
    "history with reasoning": dict(messages=[
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nold answer"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "new answer", "reasoning_content": "new thoughts"},
        {"role": "user", "content": "third"}]),
    "tools and calls": dict(
        messages=[{"role": "system", "content": "You can call tools."},
                  {"role": "user", "content": "Weather in Paris, and search?"},
                  {"role": "assistant", "content": "Let me check.", "reasoning_content": "need tools",
                   "tool_calls": [
                       {"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3,
                                                                          "metric": True}}},
                       {"id": "call_2", "type": "function",
                        "function": {"name": "search", "arguments": {"query": "a\nb",
                                                                     "filters": {"lang": "fr", "n": [1, 2]}}}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
                  {"role": "tool", "tool_call_id": "call_2", "content": "no results"},
                  {"role": "assistant", "content": "It is 21 degrees."},
                  {"role": "user", "content": "Thanks"}],
        tools=[WEATHER, SEARCH], tool_choice="auto"),
    "tools, content None": dict(
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": {"city": "Oslo"}}}]},
                  {"role": "tool", "tool_call_id": "c", "content": "cold"}],
        tools=[WEATHER], enable_thinking=False),
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """The default model's tokenizer, with a BOS token added to its config so that ``bos_token`` is set too."""
    d = tmp_path_factory.mktemp("tok")
    src = default_model_path()
    shutil.copy(os.path.join(src, "tokenizer.json"), d / "tokenizer.json")
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["bos_token"] = "<|endoftext|>"
    cfg.pop("chat_template", None)
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump(cfg, f)
    return str(d), transformers.AutoTokenizer.from_pretrained(str(d))


def hf_render(tok, template, messages, tools=None, add_generation_prompt=True, **kwargs):
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_qwen_like_template_renders_as_transformers(hf_tokenizer, case):
    path, tok = hf_tokenizer
    kw = dict(CASES[case])
    messages = kw.pop("messages")
    tpl = ChatTemplate(QWEN_LIKE, special_tokens(path))
    ours = tpl.render(messages, **kw)
    assert ours == hf_render(tok, QWEN_LIKE, messages, **kw)
    assert tpl.supports_tools
    if "tools" in kw:  # tojson: transformers' (no HTML escaping, non-ASCII kept)
        assert json.dumps(WEATHER, ensure_ascii=False) in ours and "\\u" not in ours


def test_environment_features_render_as_transformers(hf_tokenizer):
    path, tok = hf_tokenizer
    tpl = ChatTemplate(ENV_TEMPLATE, special_tokens(path))
    assert tpl.special == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    assert not tpl.supports_tools
    messages = [{"role": "system", "content": "s"}, {"role": "skip", "content": "x"},
                {"role": "user", "content": "u <&>"}, {"role": "assistant", "content": "a"},
                {"role": "stop", "content": ""}, {"role": "user", "content": "never"}]
    extra = {"b": [1, 2.5, None, True], "a": "é"}
    for agp in (True, False):
        ours = tpl.render(messages, add_generation_prompt=agp, extra=extra)
        assert ours == hf_render(tok, ENV_TEMPLATE, messages, add_generation_prompt=agp, extra=extra)
        assert ours.startswith("<|endoftext|>") and "never" not in ours and "x" not in ours.split("\n")[1]
    # A template variable given by the caller overrides a special token, as in transformers.
    assert tpl.render(messages, bos_token="<BOS>") == hf_render(tok, ENV_TEMPLATE, messages, bos_token="<BOS>")
    with pytest.raises(ChatTemplateError, match="role bad is not allowed"):
        tpl.render([{"role": "bad", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no messages"):
        tpl.render([])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_default_model_template_renders_as_transformers():
    import jaxmtp

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = jaxmtp.Model(config=None, params=None, path=path,
                         chat_template=jaxmtp.loaded_model._chat_template(path))
    tpl = ChatTemplate.from_model(model)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."},
                {"role": "assistant", "content": "sorted(xs)"}, {"role": "user", "content": "In place?"}]
    for agp in (True, False):
        ours = tpl.render(messages, add_generation_prompt=agp)
        assert ours == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
    assert ours.endswith("<|im_start|>user\nIn place?<|im_end|>\n")
    assert not tpl.supports_tools
