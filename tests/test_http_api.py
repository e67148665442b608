"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client against one server (the default model on
CPU, gRPC and HTTP on the same engine), with the gRPC API and ``jaxmtp.generate`` as references; plus unit tests of
the chat output parser (reasoning and Qwen3.5 tool calls) on text the Qwen3.5-style template of
``test_chat_template.py`` renders.

The server's engine shapes equal those of the reference ``jaxmtp.generate`` calls, and a persistent compilation
cache (set for this module only) lets them share one compile.
"""

import asyncio
import http.client
import json
import logging
import random
import select
import socket
import urllib.parse

import numpy as np
import pytest
from polling import idle, wait_until
from test_chat_template import QWEN_LIKE

import jaxmtp
from jaxmtp.serving.chat_template import ChatTemplate
from jaxmtp.serving.client import Client
from jaxmtp.serving.server import ServerConfig, ServerThread
from jaxmtp.serving.tool_parser import ChatOutputParser, convert_parameter, parse_chat_output

openai = pytest.importorskip("openai")

ENGINE_KW = dict(num_slots=4, max_context=256, num_draft_tokens=2, prefill_chunk=16, steps_per_sync=4)
REF_KW = dict(num_slots=4, max_context=256, num_draft_tokens=2, steps_per_sync=4)  # the same compiled shapes
MAX_QUEUE = 28  # 4 slots + 28 queued = 32 requests in flight at most
MODEL = "jaxmtp-default"


# ---- output parser (no server) ---------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "filters": {"type": "object"}, "ids": {"type": "array"}}}}}
TOOLS = [WEATHER, SEARCH]


def scripted_output(reasoning, content, calls, thinking=True):
    """What Qwen3.5 generates for this turn: the assistant text the Qwen3.5-style template renders for it, after the
    generation prompt (``<|im_start|>assistant\\n<think>\\n`` with thinking on, else ``...</think>\\n\\n``)."""
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": content, "reasoning_content": reasoning,
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    tpl = ChatTemplate(QWEN_LIKE)
    full = tpl.render(messages, tools=TOOLS, add_generation_prompt=False)
    prompt = tpl.render(messages[:1], tools=TOOLS, add_generation_prompt=True, enable_thinking=thinking)
    turn = full[full.rindex("<|im_start|>assistant\n"):]
    gen_prompt = prompt[prompt.rindex("<|im_start|>assistant\n"):]
    if not thinking:  # the history form of this turn carries the reasoning; a thinking-off model writes none
        turn = gen_prompt + turn[turn.index("</think>\n\n") + len("</think>\n\n"):]
    assert turn.startswith(gen_prompt) and turn.endswith("<|im_end|>\n")
    return prompt, turn[len(gen_prompt): -len("<|im_end|>\n")]


CALLS = [("get_weather", {"city": "São Paulo", "days": 3, "metric": True, "ratio": 0.25}),
         ("search", {"query": "line one\n  line <two> & 'three'", "filters": {"lang": "pt", "n": [1, 2]},
                     "ids": [3, 1, 2]})]


@pytest.mark.parametrize("reasoning, content, calls, thinking", [
    ("Two tools are needed.\nFirst the weather.", "Checking both.", CALLS, True),
    ("Just one.", "", CALLS[:1], True),
    ("No tool needed.", "The answer is 4.", [], True),
    (None, "Direct answer, no thinking.", CALLS[1:], False),
])
def test_parser_inverts_the_template(reasoning, content, calls, thinking):
    """reasoning_content, content and tool calls (arguments typed by the tools' schemas) come back from the text
    the template renders for them, whole and fed in random pieces, and the streamed OpenAI deltas, accumulated as a
    client does, give the same message."""
    from jaxmtp.serving.http_api import _Job

    prompt, text = scripted_output(reasoning or "", content, calls, thinking)
    whole = parse_chat_output(text, reasoning=True, in_reasoning=thinking and prompt.endswith("<think>\n"),
                              tools=TOOLS)
    assert whole.reasoning == (reasoning if thinking else None)
    assert whole.content == (content or None)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert len({c.id for c in whole.tool_calls}) == len(calls)
    rng = random.Random(len(text))
    for _ in range(20):
        p = ChatOutputParser(reasoning=True, in_reasoning=thinking, tools=TOOLS)
        deltas, i = [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            deltas += _Job._chat_deltas(p.feed(text[i:i + n]))
            i += n
        deltas += _Job._chat_deltas(p.finish())
        got = {"content": "", "reasoning_content": "", "calls": {}}
        for d in deltas:
            for key in ("content", "reasoning_content"):
                got[key] += d.get(key, "")
            for tc in d.get("tool_calls", []):
                call = got["calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                call["name"] += tc["function"].get("name", "")
                call["arguments"] += tc["function"]["arguments"]
        assert got["content"] == content and got["reasoning_content"] == ((reasoning or "") if thinking else "")
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(got["calls"].items())] == calls


def test_parser_edge_cases():
    # Reasoning opened by the model itself, tags split across pieces, text after a call, a truncated call.
    p = ChatOutputParser(reasoning=True, in_reasoning=False, tools=TOOLS)
    parts = []
    for piece in ["<th", "ink>\nhm", "m\n</th", "ink>\n\nok <tool", "_call>\n<function=get_", "weather>\n<parameter=da",
                  "ys>\n7\n</parameter>\n<parameter=city>\nRo"]:
        parts += p.feed(piece)
    parts += p.finish()
    assert "".join(x.text for x in parts if x.kind == "reasoning") == "hmm"
    assert "".join(x.text for x in parts if x.kind == "content") == "ok"
    assert [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [("get_weather", {"days": 7, "city": "Ro"})]
    # Qwen3's JSON form inside <tool_call>, and a block that is no call (kept as content).
    out = parse_chat_output('x <tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call>',
                            tools=TOOLS)
    assert out.content == "x" and [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("search", {"query": "q"})]
    assert parse_chat_output("a <tool_call>not a call</tool_call>", tools=TOOLS).content == \
        "a<tool_call>not a call</tool_call>"
    # Without tools (or reasoning) the tags are plain text.
    assert parse_chat_output("<think>x</think><tool_call>y").content == "<think>x</think><tool_call>y"
    # Parameter conversion by schema type; text that does not parse stays text.
    assert convert_parameter("12", {"type": "integer"}) == 12 and convert_parameter("1.5", {"type": "number"}) == 1.5
    assert convert_parameter("x1", {"type": "integer"}) == "x1" and convert_parameter("null", {"type": "string"}) is None
    assert convert_parameter("False", {"type": "boolean"}) is False
    assert convert_parameter("[1, 2]", {"type": ["array", "null"]}) == [1, 2]
    assert convert_parameter("007", {"type": "string"}) == "007"


# ---- the server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return jaxmtp.load(None, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def served(model, compile_cache):
    """The server with its HTTP API, started cold: what /health and a completion said before the warm-up is
    recorded."""
    from jaxmtp.serving.http_api import start_in_thread, stop_in_thread

    srv = ServerThread(model, ServerConfig(port=0, max_queue=MAX_QUEUE, default_max_tokens=16, **ENGINE_KW),
                       warmup=False)
    srv.start(timeout=120)
    api = None
    try:
        api = start_in_thread(srv)
        base = f"http://127.0.0.1:{api.port}"
        record = {"health_before": request(base, "GET", "/health"),
                  "tokenize_before": request(base, "POST", "/tokenize", {"model": MODEL, "prompt": "def f(x):"})}
        try:
            openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0).completions.create(
                model=MODEL, prompt="x", max_tokens=2)
        except openai.APIStatusError as e:
            record["completion_before"] = e
        srv.warmup(timeout=900)
        yield srv, api, base, record
    finally:
        if api is not None:
            stop_in_thread(srv, api)
        srv.stop()


@pytest.fixture(scope="module")
def base(served):
    return served[2]


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def grpc_client(served):
    with Client(served[0].address, timeout=300) as c:
        yield c


def reference(model, prompt, **kw):
    return jaxmtp.generate(model, prompt, **REF_KW, **kw)


def metrics(base) -> dict:
    """/metrics parsed with prometheus_client's text parser: {(sample name, frozenset(labels)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, text = request(base, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in ("model_name", "le")))] = s.value
    return out


def request(base, method, path, body=None, timeout=60.0, raw=None):
    """A plain HTTP request (stdlib): (status, headers, parsed JSON body or text)."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode()
        try:
            return r.status, r.headers, json.loads(text)
        except ValueError:
            return r.status, r.headers, text
    finally:
        conn.close()


class OpenStream:
    """A streamed completion whose response has started; ``close()`` hangs up mid-stream."""

    def __init__(self, base, body):
        url = urllib.parse.urlsplit(base)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        self.conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                          headers={"content-type": "application/json"})
        self.response = self.conn.getresponse()

    def next_event(self) -> dict:
        while True:
            line = self.response.fp.readline().decode().strip()
            if line.startswith("data: "):
                return json.loads(line[6:])

    def close(self):
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


def sample(m, name, **labels):
    return m.get((name, frozenset(labels.items())), 0.0)


# ---- tests -----------------------------------------------------------------------------------------------------
def test_warming_up_is_503_then_health_turns_ok(served, base, model):
    record = served[3]
    status, _, body = record["health_before"]
    assert status == 503 and "warming up" in body["error"]["message"]
    e = record["completion_before"]
    assert e.status_code == 503 and "warming up" in e.message
    status, _, body = record["tokenize_before"]  # the tokenizer endpoints need no engine
    assert status == 200 and body["tokens"] == model.tokenizer.encode("def f(x):").ids
    assert request(base, "GET", "/health")[::2] == (200, {"status": "ok"})


def test_models(oai, served):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].owned_by == "jaxmtp"
    assert models[0].max_model_len == served[0].server.engine.max_context
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=11)])
def test_completion_equals_grpc_and_generate(oai, grpc_client, model, sampling):
    prompt = "def fibonacci(n):"
    lib = {k: v for k, v in sampling.items()}
    want = reference(model, prompt, max_new_tokens=14, ignore_eos=True, **lib)
    got = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=14, extra_body={"ignore_eos": True},
                                 **sampling)
    over_grpc = grpc_client.generate(prompt, max_tokens=14, ignore_eos=True, **sampling)
    assert got.choices[0].text == want.text == over_grpc.text
    assert got.choices[0].finish_reason == "length" == want.finish_reason
    assert got.usage.completion_tokens == 14 == len(want.token_ids)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) == over_grpc.prompt_tokens
    assert got.usage.total_tokens == got.usage.prompt_tokens + 14
    assert got.object == "text_completion" and got.model == MODEL and got.id.startswith("cmpl-")
    # Token ids as the prompt, and a streamed request, give the same text.
    by_ids = oai.completions.create(model=MODEL, prompt=want.prompt_token_ids, max_tokens=14,
                                    extra_body={"ignore_eos": True}, **sampling)
    assert by_ids.choices[0].text == want.text
    chunks = list(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=14, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                         **sampling))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # it streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_strings_and_stop_token_ids(oai, model):
    prompt = "import os\n"
    full = reference(model, prompt, max_new_tokens=24, ignore_eos=True)
    stop = full.text[10:13]
    want = reference(model, prompt, max_new_tokens=24, ignore_eos=True, stop=[stop])
    got = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                 extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text == full.text[:full.text.index(stop)]
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == len(want.token_ids)
    streamed = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                      stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == want.text
    stop_id = full.token_ids[5]
    got = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    first = full.token_ids.index(stop_id)
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == first + 1


def test_an_assistant_turn_that_called_tools_may_have_no_content(oai, model):
    """An agent loop's history: the assistant message that called a tool has ``content: None`` (as the openai package
    writes it back). It is the empty string to the template, as in vLLM: the prompt is transformers' rendering of
    the chat with ``""`` there (the default model's template refuses a message without content) and the greedy
    output is jaxmtp.generate's on those ids."""
    transformers = pytest.importorskip("transformers")
    from jaxmtp.default_model import default_model_path

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    rendered = [dict(m, content="") if m["content"] is None else m for m in messages]
    ids = tok.apply_chat_template([{k: m[k] for k in ("role", "content")} for m in rendered],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    want = reference(model, list(ids), max_new_tokens=6, temperature=0.0, ignore_eos=True)
    got = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens == len(ids) and got.choices[0].message.content == want.text


def test_chat_with_the_default_models_template(oai, grpc_client, model):
    """End to end: the prompt is the default model's template rendered by transformers; the output (seeded
    sampling) equals jaxmtp.generate's on those ids, streamed and not; max_completion_tokens bounds it."""
    transformers = pytest.importorskip("transformers")
    from jaxmtp.default_model import default_model_path

    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Reverse a list."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = reference(model, list(ids), max_new_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
    kw = dict(model=MODEL, messages=messages, temperature=0.7, seed=5, extra_body={"ignore_eos": True})
    got = oai.chat.completions.create(max_completion_tokens=12, **kw)
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text and not msg.tool_calls
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 12
    assert got.choices[0].finish_reason == "length" and got.object == "chat.completion"
    chunks = list(oai.chat.completions.create(max_tokens=12, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # The same chat over gRPC renders the same prompt.
    over_grpc = grpc_client.generate(messages=messages, max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
    assert over_grpc.prompt_tokens == len(ids) and over_grpc.text == want.text


def test_tokenize_and_detokenize(base, oai):
    """vLLM's /tokenize gives the ids a request feeds the engine: a prompt's as transformers' tokenizer encodes it
    (and as a completion's usage counts them), a chat's as transformers renders and encodes the template, with and
    without the generation prompt; /detokenize gives random text back from its ids; bad input is a 400."""
    transformers = pytest.importorskip("transformers")
    from jaxmtp.default_model import default_model_path

    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    rng = random.Random(7)
    alphabet = "abcxyz XYZ019_(){}[]:.,=\n\t'\"éàüß中文😀"
    for _ in range(6):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        status, _, got = request(base, "POST", "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
        want = tok(text)["input_ids"]
        assert status == 200 and got["tokens"] == want and got["count"] == len(want)
        assert got["max_model_len"] == ENGINE_KW["max_context"]
        assert got["token_strs"] == tok.convert_ids_to_tokens(want)
        assert request(base, "POST", "/detokenize", {"model": MODEL, "tokens": want})[::2] == (200, {"prompt": text})
    assert oai.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens == len(want)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a dict."},
                {"role": "assistant", "content": "sorted(d.items())"}, {"role": "user", "content": "By value?"}]
    for gen in (True, False):
        want = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True, return_dict=False)
        status, _, got = request(base, "POST", "/tokenize", {"messages": messages, "add_generation_prompt": gen})
        assert status == 200 and got["tokens"] == list(want) and got["token_strs"] is None
    usage = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens == len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
    vocab = tok.vocab_size
    for path, body, param in [("/detokenize", {"tokens": [1, -1]}, "tokens"),
                              ("/detokenize", {"tokens": [vocab + 5]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/detokenize", {"tokens": [1], "skip": True}, "skip"),
                              ("/tokenize", {"prompt": [1, 2]}, "prompt"),
                              ("/tokenize", {"prompt": "x", "max_tokens": 3}, "max_tokens"),
                              ("/tokenize", {"messages": []}, "messages"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt")]:
        status, _, got = request(base, "POST", path, body)
        assert status == 400 and got["error"]["param"] == param, (path, body, got)
    assert request(base, "POST", "/tokenize", {"model": "other", "prompt": "x"})[0] == 404


def test_32_concurrent_streams_get_their_own_outputs(base, oai, grpc_client):
    """32 streams at once (4 slots, 28 queued): each equals the same request made alone."""
    n = 32
    reqs = [dict(model=MODEL, prompt=f"# task {i}\ndef f{i}(x):", max_tokens=8, temperature=0.9, seed=100 + i,
                 extra_body={"ignore_eos": True}) for i in range(n)]
    alone = [oai.completions.create(**r).choices[0].text for r in reqs[:8]]  # a sample made one at a time
    idle(grpc_client)
    before = grpc_client.stats()

    async def run():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=600)

        async def one(r):
            text = []
            async for c in await client.completions.create(stream=True, **r):
                text.append(c.choices[0].text)
            return "".join(text)

        try:
            return await asyncio.gather(*(one(r) for r in reqs))
        finally:
            await client.close()

    together = asyncio.run(run())
    assert together[:8] == alone
    for i in range(8, n, 6):  # and a few more, made alone afterwards
        assert together[i] == oai.completions.create(**reqs[i]).choices[0].text
    after = grpc_client.stats()
    assert after["requests_total"] - before["requests_total"] >= n
    assert after["generated_tokens_total"] - before["generated_tokens_total"] >= 8 * n


def test_disconnect_frees_the_slot_and_a_full_queue_is_429(base, oai, grpc_client):
    """Clients that hang up (streamed, or not streamed and queued) have their requests aborted; with every slot and
    the whole queue taken, one more request is a RateLimitError."""
    idle(grpc_client)
    before = grpc_client.stats()["requests_finished"].get("cancelled", 0)
    body = {"model": MODEL, "prompt": "def long():", "max_tokens": 200, "ignore_eos": True, "stream": True}
    capacity = 4 + MAX_QUEUE
    streams = []
    try:
        for _ in range(capacity - 1):
            streams.append(OpenStream(base, body))
            assert streams[-1].response.status == 200
        wait_until(lambda: grpc_client.stats()["requests_active"] == capacity - 1, what="31 requests")
        with pytest.raises((TimeoutError, socket.timeout)):  # queued behind the others: still waiting at 1 s
            request(base, "POST", "/v1/completions", {**body, "stream": False}, timeout=1.0)
        wait_until(lambda: grpc_client.stats()["requests_finished"].get("cancelled", 0) == before + 1,
                   what="its abort")
        assert grpc_client.stats()["requests_active"] == capacity - 1
        streams.append(OpenStream(base, body))
        wait_until(lambda: grpc_client.stats()["requests_active"] == capacity, what="a full server")
        with pytest.raises(openai.RateLimitError) as e:
            oai.completions.create(model=MODEL, prompt="one more", max_tokens=2)
        assert "capacity" in e.value.message
        assert streams[0].next_event()["choices"][0]["text"]  # the first stream is producing tokens
    finally:
        for s in streams:  # hang up mid-stream
            s.close()
    wait_until(lambda: grpc_client.stats()["requests_active"] == 0, what="the hung-up requests to be aborted")
    assert grpc_client.stats()["requests_finished"].get("cancelled", 0) - before == 1 + capacity
    assert oai.completions.create(model=MODEL, prompt="after", max_tokens=3).usage.completion_tokens == 3


CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = {
    "n above the slots": (dict(n=5), "'n' is 5: 5 samples need as many slots, and the server has 4"),
    "n zero": (dict(n=0), "'n' must be in [1, 128], got 0"),
    "n above 128": (dict(n=129), "'n' must be in [1, 128], got 129"),
    "top_logprobs without logprobs": (dict(top_logprobs=2), "'top_logprobs' needs"),
    "top_logprobs": (dict(logprobs=True, top_logprobs=30), "'top_logprobs' must be in [0, 20]"),
    "penalty": (dict(presence_penalty=3), "presence_penalty must be in [-2, 2]"),
    "min_p": (dict(extra_body={"min_p": 2}), "min_p must be in [0, 1]"),
    "logit_bias value": (dict(logit_bias={"5": 500}), "logit_bias values must be in [-100, 100]"),
    "logit_bias id": (dict(logit_bias={"4096": 1}), "token id 4096 is outside the vocabulary"),
    "response_format": (dict(response_format={"type": "json_object"}), "'response_format'"),
    "unknown field": (dict(extra_body={"guided_json": {}}), "'guided_json'"),
    "tools without a tool template": (dict(tools=[WEATHER]), "no tool support"),
    "forced tool": (dict(tool_choice="required"), "tool_choice"),
    "temperature": (dict(temperature=-1), "temperature"),
    "top_p": (dict(top_p=0), "top_p"),
    "max_tokens": (dict(max_tokens=100000), "above the server's limit"),
    "max_tokens zero": (dict(max_tokens=0), "'max_tokens' must be in [1, 2147483647], got 0"),
    "max_tokens past int32": (dict(max_tokens=2**31), "'max_tokens' must be in [1, 2147483647], got 2147483648"),
    "max_completion_tokens": (dict(max_completion_tokens=-1), "'max_completion_tokens' must be in [1, "),
    "seed": (dict(seed=-1), "'seed'"),
    "stop id": (dict(extra_body={"stop_token_ids": [10**6]}), "outside the vocabulary"),
    "image part": (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                   "only text parts"),
    "text part without text": (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": 5}]}]),
                               "messages[0].content[1] is a text part without a string 'text'"),
    "role": (dict(messages=[{"role": "wizard", "content": "x"}]), "role"),
    "stream_options without stream": (dict(stream_options={"include_usage": True}), "stream_options"),
    "temperature past float32": (dict(temperature=1e300), "temperature must be a finite number >= 0 (at most"),
    "content None on a user message": (dict(messages=[{"role": "user", "content": None}]),
                                       "messages[0].content is required on a user message"),
    "name not a string": (dict(messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "y",
                                                                             "name": 0}]),
                          "messages[1].name must be a string"),
    "template kwargs that set the messages": (dict(extra_body={"chat_template_kwargs": {"messages": [],
                                                                                        "tools": []}}),
                                              "'chat_template_kwargs' may not set 'messages', 'tools'"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_are_400_and_the_server_keeps_serving(oai, case):
    kw, needle = BAD_REQUESTS[case]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 2, **kw})
    assert needle in e.value.message and e.value.body["type"] == "invalid_request_error"


def test_logprobs_formats():
    """OpenAI's two logprobs forms, checked against the openai package's types: tokens as their decoded strings
    (bytes: the UTF-8 of those); a legacy completion's top_logprobs add the chosen token; text offsets."""
    from openai.types.chat.chat_completion import ChoiceLogprobs
    from openai.types.completion_choice import Logprobs

    from jaxmtp.engine import TokenLogprob
    from jaxmtp.serving.http_api import chat_logprobs, completion_logprobs

    texts = {1: "a", 2: "é", 3: "a", 4: "<|eos|>"}.__getitem__  # 3 decodes as 1 does
    entries = [TokenLogprob(2, -1.5, [(1, -0.1), (3, -0.3)]), TokenLogprob(4, float("-inf"), [])]
    chat = chat_logprobs(entries, texts)
    ChoiceLogprobs.model_validate({"content": chat})
    a = {"token": "a", "bytes": [97]}
    assert chat == [
        {"token": "é", "logprob": -1.5, "bytes": [195, 169], "top_logprobs": [{**a, "logprob": -0.1},
                                                                             {**a, "logprob": -0.3}]},
        {"token": "<|eos|>", "logprob": -9999.0, "bytes": list(b"<|eos|>"), "top_logprobs": []}]
    legacy = completion_logprobs(entries, texts, offset=3)
    Logprobs.model_validate(legacy)
    assert legacy == {"tokens": ["é", "<|eos|>"], "token_logprobs": [-1.5, -9999.0],
                      "top_logprobs": [{"a": -0.1, "é": -1.5}, {"<|eos|>": -9999.0}], "text_offset": [3, 4]}


def test_logprobs_equal_generate(oai, model):
    """Greedy logprobs over HTTP (completions and chat, streamed and not) are jaxmtp.generate's, as OpenAI's forms."""
    from openai.types.completion_choice import Logprobs

    text = lambda t: model.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    prompt, messages = "def fibonacci(n):", [{"role": "user", "content": "Reverse a list."}]
    want = reference(model, prompt, max_new_tokens=6, ignore_eos=True, logprobs=3)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    whole = oai.completions.create(**kw).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in oai.completions.create(stream=True, **kw) if c.choices[0].logprobs]
    assert len(parts) > 1  # each chunk carries its own tokens' logprobs
    for got in (whole, Logprobs(**{k: sum((getattr(p, k) for p in parts), []) for k in (
            "tokens", "token_logprobs", "top_logprobs", "text_offset")})):
        assert got.tokens == [text(w.token_id) for w in want.logprobs] == [text(t) for t in want.token_ids]
        assert got.token_logprobs == pytest.approx([w.logprob for w in want.logprobs], abs=1e-5)
        assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(6)]
        for top, w in zip(got.top_logprobs, want.logprobs):
            expected = {}
            for t, v in w.top:
                expected.setdefault(text(t), v)
            assert top == pytest.approx(expected, abs=1e-5)  # the greedy token is among them
    want = reference(model, messages, max_new_tokens=6, ignore_eos=True, logprobs=3)
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    whole = oai.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for c in oai.chat.completions.create(stream=True, **kw) if c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    for got in (whole, streamed):
        assert [e.token for e in got] == [text(t) for t in want.token_ids]
        for e, w in zip(got, want.logprobs):
            assert e.logprob == pytest.approx(w.logprob, abs=1e-5) and e.bytes == list(e.token.encode())
            assert [x.token for x in e.top_logprobs] == [text(t) for t, _ in w.top]
            values = [x.logprob for x in e.top_logprobs]
            assert values == sorted(values, reverse=True) and values == pytest.approx([v for _, v in w.top], abs=1e-5)
            assert e.top_logprobs[0].token == e.token
    no = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=False)
    assert no.choices[0].logprobs is None


def test_prompt_logprobs_format():
    """vLLM's prompt_logprobs: None for the first prompt token, then {id: {logprob, rank, decoded_token}} with the
    prompt token first; its rank where it is among the top N, else null; -inf sent as -9999."""
    from jaxmtp.engine import TokenLogprob
    from jaxmtp.serving.http_api import prompt_logprobs

    texts = {1: "a", 2: "é", 3: "a", 4: "<|eos|>"}.__getitem__
    entries = [None, TokenLogprob(2, -0.3, [(1, -0.1), (2, -0.3)]), TokenLogprob(4, float("-inf"), [(3, -0.2)]),
               TokenLogprob(1, -0.5, [])]
    assert json.loads(json.dumps(prompt_logprobs(entries, texts))) == [
        None,
        {"2": {"logprob": -0.3, "rank": 2, "decoded_token": "é"},
         "1": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}},
        {"4": {"logprob": -9999.0, "rank": None, "decoded_token": "<|eos|>"},
         "3": {"logprob": -0.2, "rank": 1, "decoded_token": "a"}},
        {"1": {"logprob": -0.5, "rank": None, "decoded_token": "a"}}]
    assert list(prompt_logprobs(entries, texts)[1]) == ["2", "1"]  # the prompt token first, as vLLM orders them


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def check_prompt_logprobs(got, ids, ref, n, text):
    """``got`` (vLLM's prompt_logprobs) against ``ref`` (a full forward's log_softmax, row p predicting token p + 1).
    Returns how many prompt tokens were outside the top ``n``."""
    # The server runs the float32 model (the ``model`` fixture) in chunked prefill, the reference one full forward of
    # the same float32 weights: they differ by summation order only (the engine tests hold 1e-5); 1e-4 leaves margin.
    tol = 1e-4
    assert len(got) == len(ids) and got[0] is None
    outside = 0
    for p in range(1, len(ids)):
        entry, row, tok = got[p], ref[p - 1], ids[p]
        assert next(iter(entry)) == str(tok)  # the prompt token, first
        mine = entry[str(tok)]
        assert mine["logprob"] == pytest.approx(row[tok], abs=tol) and mine["decoded_token"] == text(tok)
        ranked = sorted((v["rank"], int(k), v["logprob"], v["decoded_token"]) for k, v in entry.items()
                        if v["rank"] is not None)
        assert [r for r, *_ in ranked] == list(range(1, n + 1))  # the top n, ranks 1..n
        values = [v for _, _, v, _ in ranked]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(np.sort(row)[::-1][:n], abs=tol)
        for _, t, v, decoded in ranked:
            assert v == pytest.approx(row[t], abs=tol) and decoded == text(t)  # the right ids
        # its rank in the reference (a range: tokens within the tolerance of it may fall on either side)
        lo, hi = 1 + int((row > row[tok] + tol).sum()), 1 + int((row > row[tok] - tol).sum())
        if mine["rank"] is None:  # outside the top n: the engine gives no rank beyond n
            assert hi > n and len(entry) == n + 1
            outside += 1
        else:
            assert lo <= mine["rank"] <= hi and len(entry) == n
    return outside


def test_prompt_logprobs_equal_a_full_forward(oai, model):
    """vLLM's prompt_logprobs over HTTP against a full forward of the model: a completion's on every choice (n = 2
    too) and in a stream's first chunk, a chat's at the top level."""
    from jaxmtp.generation import encode_prompt

    text = lambda t: model.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    prompt, messages = "def fibonacci(n):", [{"role": "user", "content": "Reverse a list."}]
    ids, chat_ids = encode_prompt(model, prompt), encode_prompt(model, messages)
    # One forward for both prompts: the shorter padded at its end (causal: its positions see only what precedes them).
    width = max(len(ids), len(chat_ids))
    ref = log_softmax(model.logits(np.asarray([p + [0] * (width - len(p)) for p in (ids, chat_ids)])))
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3})

    got = oai.completions.create(**kw)
    lps = got.choices[0].prompt_logprobs
    outside = check_prompt_logprobs(lps, ids, ref[0], 3, text)
    assert 0 < outside < len(ids) - 1  # the prompt token both among the top 3 and outside them
    assert got.usage.prompt_tokens == len(ids)
    two = oai.completions.create(n=2, **kw)  # computed once, on every choice (as vLLM)
    assert [c.prompt_logprobs for c in two.choices] == [lps, lps]
    chunks = list(oai.completions.create(stream=True, **kw))
    with_lps = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks]
    assert with_lps[0] == lps and not any(with_lps[1:])  # in the first chunk only
    assert oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2).choices[0].prompt_logprobs is None

    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    assert chat.usage.prompt_tokens == len(chat_ids) and "prompt_logprobs" not in chat.choices[0].model_extra
    assert check_prompt_logprobs(chat.prompt_logprobs, chat_ids, ref[1], 2, text) > 0


def test_echo_gives_the_prompt_and_its_logprobs(oai, model):
    """``echo`` (the legacy completions API's scoring request, as lm-eval sends it: echo, logprobs, max_tokens 1,
    temperature 0): the text is the prompt's and the output's; the logprobs cover the prompt's tokens (the first
    None), equal to a full forward's, then the output's, equal to the request without echo, with offsets into the
    echoed text; with max_tokens 0 the prompt alone; a token-id prompt echoes its decoded text; echo with "stream"
    is a 400."""
    from jaxmtp.generation import encode_prompt

    text = lambda t: model.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    prompt = "def fibonacci(n):"
    ids = encode_prompt(model, prompt)
    p = len(ids)
    ref = log_softmax(model.logits(np.asarray([ids])))[0]
    kw = dict(model=MODEL, max_tokens=2, temperature=0, logprobs=2)
    plain = oai.completions.create(prompt=prompt, **kw).choices[0]
    got = oai.completions.create(prompt=prompt, echo=True, **kw).choices[0]
    assert got.text == prompt + plain.text and got.model_extra.get("prompt_logprobs") is None
    lp = got.logprobs
    assert lp.tokens == [text(t) for t in ids] + plain.logprobs.tokens
    assert lp.token_logprobs[p:] == plain.logprobs.token_logprobs and lp.top_logprobs[p:] == plain.logprobs.top_logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:p], [ref[i - 1, ids[i]] for i in range(1, p)], atol=1e-4)
    for i in range(1, p):  # the prompt token and the 2 most likely, as a full forward ranks them
        best = np.argsort(-ref[i - 1])[:2]
        assert set(lp.top_logprobs[i]) == {text(ids[i])} | {text(int(t)) for t in best}
    offsets = np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]).tolist()
    assert lp.text_offset == offsets and lp.text_offset[p] == len(prompt)
    zero = oai.completions.create(prompt=prompt, echo=True, **{**kw, "max_tokens": 0})  # the prompt scored alone
    assert zero.choices[0].text == prompt and zero.choices[0].finish_reason == "length"
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == p
    assert zero.choices[0].logprobs.model_dump() == {key: v[:p] for key, v in lp.model_dump().items()}
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be in \\[1, "):
        oai.completions.create(prompt=prompt, **{**kw, "max_tokens": 0})
    by_ids = oai.completions.create(prompt=ids, echo=True, model=MODEL, max_tokens=2, temperature=0).choices[0]
    assert by_ids.text == model.tokenizer.decode(ids, skip_special_tokens=False) + plain.text
    assert by_ids.logprobs is None
    with pytest.raises(openai.BadRequestError, match="'echo' is supported on non-streamed completions only"):
        oai.completions.create(prompt=prompt, echo=True, stream=True, **kw)


@pytest.mark.parametrize("value, needle", [(21, "must be in [0, 20], got 21"), (-1, "must be in [0, 20], got -1"),
                                           ("x", 'must be an integer, got "x"'), (True, "must be an integer, got true"),
                                           (2.5, "must be an integer, got 2.5")])
def test_bad_prompt_logprobs_are_400(oai, value, needle):
    for create, kw in ((oai.completions.create, dict(prompt="x")),
                       (oai.chat.completions.create, dict(messages=CHAT))):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=2, extra_body={"prompt_logprobs": value}, **kw)
        assert f"'prompt_logprobs' {needle}" in e.value.message and e.value.body["param"] == "prompt_logprobs"


def test_chat_stream_refuses_prompt_logprobs(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True,
                                    extra_body={"prompt_logprobs": 0})
    assert "not available" in e.value.message and e.value.body["param"] == "prompt_logprobs"


def _streamed_choices(events, chat):
    """Streamed chunks of n choices -> ({index: text}, {index: finish_reason}, [usage])."""
    texts, reasons, usage = {}, {}, []
    for ev in events:
        if not ev.choices:
            usage.append(ev.usage)
            continue
        (c,) = ev.choices
        assert c.index not in reasons  # nothing of a sample after its finish_reason chunk
        texts[c.index] = texts.get(c.index, "") + ((c.delta.content or "") if chat else c.text)
        if c.finish_reason is not None:
            reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_n_choices_equal_seeded_single_requests(oai):
    """n=2: choice i equals the n=1 request with seed + i (text, finish_reason), streamed and not; the usage counts
    the prompt once and both samples' tokens; greedy n=2 gives two identical choices. (No logprobs here: a feature
    loop over two slots would compile for this test alone.)"""
    for chat in (False, True):
        create = oai.chat.completions.create if chat else oai.completions.create
        kw = dict(model=MODEL, max_tokens=8, temperature=1.0, **(dict(messages=CHAT) if chat else
                                                                  dict(prompt="def add(a, b):")))
        singles = [create(seed=30 + i, **kw) for i in range(2)]
        want_text = [s.choices[0].message.content if chat else s.choices[0].text for s in singles]
        got = create(seed=30, n=2, **kw)
        assert [c.index for c in got.choices] == [0, 1]
        for c, s, text in zip(got.choices, singles, want_text):
            assert (c.message.content if chat else c.text) == text and c.finish_reason == s.choices[0].finish_reason
        assert got.usage.prompt_tokens == singles[0].usage.prompt_tokens
        assert got.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        texts, reasons, usage = _streamed_choices(
            create(seed=30, n=2, stream=True, stream_options={"include_usage": True}, **kw), chat)
        assert texts == dict(enumerate(want_text)) and len(usage) == 1
        assert reasons == {i: s.choices[0].finish_reason for i, s in enumerate(singles)}
        assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (got.usage.prompt_tokens,
                                                                        got.usage.completion_tokens)
    greedy = oai.completions.create(model=MODEL, prompt="import os\n", max_tokens=6, temperature=0, n=2, best_of=2,
                                    extra_body={"ignore_eos": True})
    assert greedy.choices[0].text == greedy.choices[1].text and greedy.usage.completion_tokens == 12
    assert want_text[0] != want_text[1]  # (chat's) two seeds gave two different samples


def test_a_batch_of_prompts_is_a_request_per_prompt(oai, grpc_client):
    """A list of prompts (strings and token-id lists) with n = 2 and seeded sampling: choice k * n + j is sample j of
    prompt k asked alone, streamed or not, under one id; the usage adds up every prompt's. A bad element is a 400
    naming it, so is a batch larger than the server could ever hold; one larger than the queue's room now is a 429
    that leaves nothing running."""
    prompts = ["def add(a, b):", [12, 7, 99, 3], "import os\n"]
    kw = dict(model=MODEL, max_tokens=6, temperature=0.8, seed=11, n=2, logprobs=1, extra_body={"ignore_eos": True})
    alone = [oai.completions.create(prompt=p, **kw) for p in prompts]
    got = oai.completions.create(prompt=prompts, **kw)
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == [c.text for a in alone for c in a.choices]
    # the same tokens and offsets; log-probabilities to float32's sums over another batch (prefilled together)
    for g, w in zip([c.logprobs for c in got.choices], [c.logprobs for a in alone for c in a.choices]):
        assert (g.tokens, g.text_offset) == (w.tokens, w.text_offset)
        assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4)
        assert [sorted(t) for t in g.top_logprobs] == [sorted(t) for t in w.top_logprobs]
    assert got.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and got.usage.completion_tokens == 36
    texts, finish, usage, ids = {}, {}, None, set()
    for chunk in oai.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw):
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in got.choices} and finish == {i: "length" for i in range(6)}
    assert len(ids) == 1 and (usage.prompt_tokens, usage.completion_tokens) == (got.usage.prompt_tokens, 36)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\] is empty"):
        oai.completions.create(model=MODEL, prompt=["a", ""], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[0\] must be a string or a non-empty list"):
        oai.completions.create(model=MODEL, prompt=[[1, "x"], "b"], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="the batch needs 33 samples in flight at once and the server "
                                                      "holds at most 32"):
        oai.completions.create(model=MODEL, prompt=["x"] * 33, max_tokens=2)
    idle(grpc_client)
    held = oai.completions.create(model=MODEL, prompt="y", max_tokens=200, stream=True,  # one slot taken meanwhile
                                  extra_body={"ignore_eos": True})
    next(iter(held))
    before = grpc_client.stats()["requests_finished"].get("cancelled", 0)
    with pytest.raises(openai.RateLimitError):
        oai.completions.create(model=MODEL, prompt=["x"] * 32, max_tokens=2)
    cancelled = lambda: grpc_client.stats()["requests_finished"].get("cancelled", 0) - before  # noqa: E731
    wait_until(lambda: cancelled() == 3 + MAX_QUEUE, what="the 31 taken prompts to be aborted")
    assert grpc_client.stats()["requests_active"] <= 1  # the held stream at most
    held.close()
    idle(grpc_client)
    assert oai.completions.create(model=MODEL, prompt=["ok", "fine"], max_tokens=2).usage.completion_tokens == 4


def test_logit_bias_reaches_the_engine(oai, model):
    t = model.tokenizer.encode("x", add_special_tokens=False).ids
    assert len(t) == 1
    got = oai.completions.create(model=MODEL, prompt="import os\n", max_tokens=5, temperature=0,
                                 logit_bias={str(t[0]): 100}, extra_body={"ignore_eos": True})
    assert got.choices[0].text == "x" * 5


def test_other_errors(oai, base):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert "does not exist" in e.value.message and e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="empty"):
        oai.completions.create(model=MODEL, prompt="", max_tokens=2)
    status, _, body = request(base, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, _, body = request(base, "GET", "/v1/nothing-here")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    assert request(base, "GET", "/v1/completions")[0] == 405
    assert oai.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens == 2


MALFORMED_BODIES = {  # raw request bodies that Python's json module alone would take, or crash on
    "NaN": (b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', "NaN is not a JSON value"),
    "Infinity": (b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}', "Infinity is not a JSON value"),
    "a number beyond float64": (b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e999}', "out of range"),
    "nesting too deep": (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
    "an escaped lone surrogate": (b'{"prompt": "hi \\ud800", "max_tokens": 2}', "lone UTF-16 surrogate"),
    "a surrogate in UTF-8 bytes": (b'{"prompt": "hi \xed\xa0\x80", "max_tokens": 2}', "not UTF-8"),
    "Latin-1 bytes": (b'{"prompt": "caf\xe9", "max_tokens": 2}', "not UTF-8"),
}


def test_malformed_bodies_are_400_and_a_client_gone_mid_body_logs_no_error(base, oai, caplog):
    """Bodies that are not RFC 8259 UTF-8 JSON are 400s naming what is wrong (NaN and infinities never reach the
    sampling checks; a lone surrogate never reaches the tokenizer; deep nesting is not a 500), a surrogate pair is
    still text, and a client that hangs up halfway through its body leaves no error in the server's log."""
    caplog.set_level(logging.DEBUG, logger="jaxmtp")
    for case, (raw, needle) in MALFORMED_BODIES.items():
        status, _, body = request(base, "POST", "/v1/completions", raw=raw)
        assert status == 400 and "not valid JSON" in body["error"]["message"], (case, status, body)
        assert needle in body["error"]["message"], (case, body)
    status, _, body = request(base, "POST", "/v1/completions",
                              raw=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')  # an emoji as a pair
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    status, _, body = request(base, "POST", "/v1/completions", raw=b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}')
    assert status == 200, body  # a byte order mark is ignored
    url = urllib.parse.urlsplit(base)
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hel")
    wait_until(lambda: any("disconnected before it sent" in r.getMessage() for r in caplog.records),
               what="the server to see the hang-up")
    assert not [r for r in caplog.records if r.name.startswith("jaxmtp") and r.levelno >= logging.WARNING], \
        caplog.text[-2000:]
    assert oai.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_a_body_over_the_limit_is_413_with_or_without_a_length(base, served):
    """A declared length over ``--max-message-bytes`` is refused before the body is read; a chunked body without a
    length is refused once it passes the limit, not read to its end (the server would hold it all in memory)."""
    limit = served[0].server.config.max_message_bytes
    status, _, body = request(base, "POST", "/v1/completions", raw=b" " * (limit + 1))
    assert status == 413 and "more than the server's limit" in body["error"]["message"]
    url = urllib.parse.urlsplit(base)
    piece = b" " * (1 << 20)
    sent, answer = 0, b""
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        while sent < 16 * limit and not answer:  # a body that would never end
            try:
                s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
            if select.select([s], [], [], 0.01)[0]:
                answer = s.recv(4096)
        answer = answer or s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent <= 4 * limit, sent  # answered once the limit was passed
    assert request(base, "GET", "/health")[0] == 200


def test_metrics_parse_and_move_with_traffic(base, oai, grpc_client):
    idle(grpc_client)
    m0 = metrics(base)
    got = oai.completions.create(model=MODEL, prompt="class Stack:", max_tokens=9, temperature=0,
                                 extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, n=5)  # more samples than slots
    over_grpc = grpc_client.generate("x", max_tokens=3, ignore_eos=True)  # one scheduler, one set of metrics
    m1 = metrics(base)

    def delta(name, **labels):
        return sample(m1, name, **labels) - sample(m0, name, **labels)

    assert delta("jaxmtp_requests_finished_total", finish_reason="length") == 2
    assert delta("jaxmtp_requests_rejected_total", code="INVALID_ARGUMENT") == 1
    assert delta("jaxmtp_generation_tokens_total") == 9 + 3
    assert delta("jaxmtp_prompt_tokens_total") == got.usage.prompt_tokens + over_grpc.prompt_tokens
    for h in ("jaxmtp_time_to_first_token_seconds", "jaxmtp_e2e_request_latency_seconds",
              "jaxmtp_time_per_output_token_seconds", "jaxmtp_request_generation_tokens"):
        assert delta(h + "_count") == 2
    assert delta("jaxmtp_request_generation_tokens_sum") == 12
    assert delta("jaxmtp_e2e_request_latency_seconds_sum") > 0
    assert delta("jaxmtp_spec_decode_num_drafts_total") > 0
    drafts = delta("jaxmtp_spec_decode_num_drafts_total")
    assert delta("jaxmtp_spec_decode_num_draft_tokens_total") == 2 * drafts  # k = 2
    per_pos = [sample(m1, "jaxmtp_spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in (1, 2)]
    assert per_pos[0] >= per_pos[1] and sum(per_pos) == sample(m1, "jaxmtp_spec_decode_num_accepted_tokens_total")
    assert sample(m1, "jaxmtp_num_slots") == 4 and sample(m1, "jaxmtp_server_ready") == 1
    assert sample(m1, "jaxmtp_num_requests_running") == 0 == sample(m1, "jaxmtp_num_requests_waiting")


def test_api_key(served, base):
    """With an API key (``--api-key``), /v1 and the tokenizer endpoints need ``Authorization: Bearer KEY``; /health
    and /metrics stay open."""
    api = served[1]
    old, api._auth = api._auth, b"Bearer sesame"  # what HttpApi derives from ServerConfig.api_key
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        assert request(base, "GET", "/v1/models")[0] == 401
        assert request(base, "POST", "/tokenize", {"prompt": "x"})[0] == 401
        assert request(base, "POST", "/detokenize", {"tokens": [1]})[0] == 401
        good = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        assert request(base, "GET", "/health")[0] == 200 and request(base, "GET", "/metrics")[0] == 200
    finally:
        api._auth = old
