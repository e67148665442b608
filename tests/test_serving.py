"""The gRPC server, end to end: a real server on loopback, real gRPC clients, ``jaxmtp.generate`` as the reference.

One server (4 slots, k=2) serves most tests; its engine shapes equal those of the reference ``jaxmtp.generate`` calls
and of the SIGTERM subprocess, and a persistent compilation cache (set for this module only) lets them all reuse one
compile.
"""

import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from polling import idle, wait_until
from hf_builders import EOS, VOCAB

import jaxmtp
from jaxmtp.serving import protocol as pb
from jaxmtp.serving.client import Client, GenerationError, build_request
from jaxmtp.serving.server import ServerConfig, ServerThread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_KW = dict(num_slots=4, max_context=256, num_draft_tokens=2, prefill_chunk=16, steps_per_sync=4)
REF_KW = dict(num_slots=4, max_context=256, num_draft_tokens=2, steps_per_sync=4)  # same compiled shapes
LONG = 240  # tokens: a request that holds its slot for many engine iterations


# ---- fixtures --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(model, compile_cache):
    """The main server, started cold: what health and Generate said before the warm-up is recorded."""
    srv = ServerThread(model, ServerConfig(port=0, max_queue=64, default_max_tokens=32, **ENGINE_KW), warmup=False)
    srv.start(timeout=120)
    record = {}
    try:
        with Client(srv.address, timeout=60) as c:
            record["health_before"] = c.health()
            try:
                c.generate("abc", max_tokens=2)
            except GenerationError as e:
                record["generate_before"] = e
            watched, first = [], threading.Event()
            call = pb.HealthStub(c.channel).Watch(pb.HealthCheckRequest(service=""), timeout=600)

            def watch():
                for r in call:
                    watched.append(r.status)
                    first.set()
                    if r.status == pb.SERVING:
                        return

            t = threading.Thread(target=watch)
            t.start()
            assert first.wait(60)  # the watch saw the cold status before the warm-up starts
            srv.warmup(timeout=900)
            t.join(60)
            call.cancel()
            record["watched"] = watched
            record["health_after"] = c.health()
            record["health_service_after"] = c.health(pb.GENERATION_SERVICE)
        yield srv, record
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


@pytest.fixture
def make_server(model, compile_cache):
    """Extra servers with the main server's engine shapes (compiled from the cache) and other limits."""
    started = []

    def make(**overrides):
        srv = ServerThread(model, ServerConfig(port=0, **{**ENGINE_KW, **overrides})).start(timeout=300)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


def reference(model, prompt, **kw):
    """``jaxmtp.generate`` (the library call) for one prompt or a batch (prompt i of a batch uses seed + i)."""
    return jaxmtp.generate(model, prompt, **REF_KW, **kw)


def collect(stream):
    chunks = list(stream)
    return chunks, stream.completion


def check_spec(spec, k=2):
    assert spec["k"] == k and len(spec["acceptance_per_position"]) == k == len(spec["accepted_per_position"])
    assert spec["steps"] > 0 and spec["drafted"] == k * spec["steps"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted"] / spec["steps"])
    assert all(0 <= a <= 1 for a in spec["acceptance_per_position"])


# ---- protocol --------------------------------------------------------------------------------------------------
def test_generated_descriptors_match_the_proto_sources():
    """_descriptors.py is regenerated from the .proto files (hashes always; protoc output when grpcio-tools is
    installed)."""
    from jaxmtp.serving import _descriptors

    for rel, digest in _descriptors.SOURCES_SHA256.items():
        with open(os.path.join(ROOT, rel), "rb") as f:
            assert hashlib.sha256(f.read().replace(b"\r\n", b"\n")).hexdigest() == digest, \
                f"{rel} changed: run python scripts/gen_proto.py"
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("gen_proto", os.path.join(ROOT, "scripts", "gen_proto.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.check() == []


def test_health_protocol_is_the_standard_wire_format():
    """Field numbers, enum values and method paths that standard health probes rely on."""
    assert pb.HealthCheckRequest(service="x").SerializeToString() == b"\n\x01x"
    assert pb.HealthCheckResponse(status=pb.SERVING).SerializeToString() == b"\x08\x01"
    assert (pb.UNKNOWN, pb.SERVING, pb.NOT_SERVING, pb.SERVICE_UNKNOWN) == (0, 1, 2, 3)
    assert pb.method_path(pb.HEALTH_SERVICE, "Check") == "/grpc.health.v1.Health/Check"
    assert pb.method_path(pb.HEALTH_SERVICE, "Watch") == "/grpc.health.v1.Health/Watch"
    req = build_request("hi", max_tokens=3, temperature=0.5, seed=9, stop=["x"], num_draft_tokens=2)
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back.text == "hi" and back.sampling.max_tokens == 3 and back.sampling.seed == 9
    assert back.HasField("num_draft_tokens") and not back.sampling.HasField("top_p")


def test_logits_processing_fields_map_into_sampling_params(server):
    """The client's keywords survive the wire and become the engine's SamplingParams; unset means off."""
    req = build_request("ab", max_tokens=8, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.25,
                        repetition_penalty=1.3, logit_bias={"7": 2.5, 3: -100}, min_tokens=2, logprobs=4)
    p = server.server._params(pb.GenerateRequest.FromString(req.SerializeToString()))
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.5, -0.25, 1.3)
    assert p.logit_bias == ((3, -100.0), (7, 2.5)) and p.min_tokens == 2 and p.logprobs == 4
    off = server.server._params(build_request("ab", logprobs=0))
    assert off.logprobs == 0 and (off.min_p, off.repetition_penalty, off.logit_bias, off.min_tokens) == (0, 1, (), 0)
    assert server.server._params(build_request("ab")).logprobs is None


# ---- health and info -------------------------------------------------------------------------------------------
def test_health_goes_serving_only_after_warmup(served, client):
    _, record = served
    assert record["health_before"] == "NOT_SERVING"
    err = record["generate_before"]
    assert err.code == grpc.StatusCode.UNAVAILABLE and "warming up" in err.message
    assert record["watched"] == [pb.NOT_SERVING, pb.SERVING]
    assert record["health_after"] == record["health_service_after"] == "SERVING"
    with pytest.raises(GenerationError) as e:
        client.health("no.such.Service")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    call = pb.HealthStub(client.channel).Watch(pb.HealthCheckRequest(service="no.such.Service"), timeout=30)
    assert next(iter(call)).status == pb.SERVICE_UNKNOWN
    call.cancel()


def test_model_info(client, model):
    info = client.model_info()
    assert info["num_draft_tokens"] == 2 and info["num_slots"] == 4 and info["max_context"] == 256
    assert info["vocab_size"] == VOCAB and info["eos_token_ids"] == [EOS] and info["has_tokenizer"]
    assert info["max_prompt_tokens"] == 255 and info["max_new_tokens_limit"] == 256 and info["max_queue"] == 64
    assert info["family"] == "qwen3_5" and info["version"] == jaxmtp.__version__ and info["model_path"] == model.path


# ---- outputs equal the library call ----------------------------------------------------------------------------
CASES = {
    "text-greedy": ("def add(a, b):", dict(max_tokens=40)),
    "text-sampled": ("import os\n", dict(max_tokens=40, temperature=0.8, top_p=0.9, top_k=30, seed=7)),
    "ids-sampled": ([5, 17, 42, 99, 3], dict(max_tokens=30, temperature=1.0, seed=123)),
    "chat-greedy": ([{"role": "user", "content": "hello"}], dict(max_tokens=20)),
    "long-prompt": ("The quick brown fox jumps over.", dict(max_tokens=24, ignore_eos=True)),
}


def _library_kw(kw):
    kw = dict(kw)
    kw["max_new_tokens"] = kw.pop("max_tokens")
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_output_equals_generate(client, model, case):
    prompt, kw = CASES[case]
    want = reference(model, prompt, **_library_kw(kw))
    if case == "chat-greedy":
        stream = client.stream(messages=prompt, **kw)
    else:
        stream = client.stream(prompt, **kw)
    chunks, done = collect(stream)
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == want.token_ids
    assert "".join(c.text for c in chunks) == want.text == done.text
    assert done.finish_reason == want.finish_reason
    assert done.prompt_tokens == len(want.prompt_token_ids) and done.completion_tokens == len(ids)
    if "seed" in kw:
        assert done.seed == kw["seed"]
    if len(ids) >= 5:  # one engine iteration emits several tokens: chunks carry several ids
        assert max(len(c.token_ids) for c in chunks) > 1
    check_spec(done.spec)
    assert done.time_to_first_token > 0 and done.elapsed >= done.time_to_first_token


def test_stop_string_spanning_engine_outputs(client, model):
    """A stop string longer than any one engine output (1 + steps_per_sync * (k + 1) = 13 tokens) is found across
    output boundaries; the text ends before it and nothing after it streams."""
    prompt = "class Foo:"
    full = reference(model, prompt, max_new_tokens=48, ignore_eos=True)
    tok = model.tokenizer
    start, end = 6, 6 + 15
    stop = tok.decode(full.token_ids[start:end])
    text_before = tok.decode(full.token_ids[:start])
    assert full.text.find(stop) == len(text_before), "pick another window: the stop string occurs earlier"
    want = reference(model, prompt, max_new_tokens=48, ignore_eos=True, stop=[stop])
    chunks, done = collect(client.stream(prompt, max_tokens=48, ignore_eos=True, stop=[stop]))
    text = "".join(c.text for c in chunks)
    assert text == want.text == text_before
    assert [t for c in chunks for t in c.token_ids] == want.token_ids == full.token_ids[:end]
    assert done.finish_reason == "stop" == want.finish_reason


def test_stop_token_ids(client, model):
    full = reference(model, [7, 8, 9], max_new_tokens=30, ignore_eos=True)
    stop_id = full.token_ids[9]
    first = full.token_ids.index(stop_id)
    done = client.generate([7, 8, 9], max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    assert done.token_ids == full.token_ids[: first + 1] and done.finish_reason == "stop"


def check_logprobs(got, want, ids, n):
    """Per-token logprobs: parallel to ``ids``, equal to the library's (1e-5), ``n`` alternatives, most likely
    first, the chosen (greedy) token first among them."""
    assert [g.token_id for g in got] == ids == [w.token_id for w in want]
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5) and g.logprob <= 0
        assert len(g.top) == n and [t for t, _ in g.top] == [t for t, _ in w.top]
        values = [v for _, v in g.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx([v for _, v in w.top], abs=1e-5)
        if n:
            assert g.top[0][0] == g.token_id and g.top[0][1] == pytest.approx(g.logprob, abs=1e-6)


def test_logprobs_equal_generate(client, model):
    want = reference(model, "def add(a, b):", max_new_tokens=8, ignore_eos=True, logprobs=3)
    chunks, done = collect(client.stream("def add(a, b):", max_tokens=8, ignore_eos=True, logprobs=3))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    check_logprobs(done.logprobs, want.logprobs, want.token_ids, 3)
    assert [lp for c in chunks for lp in c.logprobs] == done.logprobs
    assert client.generate("def add(a, b):", max_tokens=2).logprobs is None


def test_prompt_logprobs_equal_a_full_forward(client, model):
    prompt = [11, 42, 7, 42, 99, 3, 18, 5, 60]
    done = client.generate(prompt, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    lp = model.logits(np.asarray([prompt]))[0].astype(np.float64)
    lp = lp - lp.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    assert [x.token_id for x in done.prompt_logprobs] == prompt[1:]
    np.testing.assert_allclose([x.logprob for x in done.prompt_logprobs], lp[np.arange(8), prompt[1:]], atol=1e-5)
    assert all(len(x.top) == 2 for x in done.prompt_logprobs)
    assert client.generate(prompt, max_tokens=2).prompt_logprobs is None


def test_logit_bias_and_penalties_reach_the_engine(client, model):
    prompt = [5, 5, 5, 5]  # its plain greedy output repeats a token within 8
    plain = client.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
    t = next(i for i in range(40, VOCAB) if i not in plain)
    assert client.generate(prompt, max_tokens=8, ignore_eos=True, logit_bias={t: 100}).token_ids == [t] * 8
    banned = client.generate(prompt, max_tokens=8, ignore_eos=True, logit_bias={plain[0]: -100}).token_ids
    assert len(banned) == 8 and plain[0] not in banned
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=2.0)
    want = reference(model, prompt, max_new_tokens=8, ignore_eos=True, **penalties)
    assert want.token_ids != plain
    assert client.generate(prompt, max_tokens=8, ignore_eos=True, **penalties).token_ids == want.token_ids


def test_n_samples_equal_separate_seeded_requests(client):
    """n=3 in one call: sample i equals an n=1 request with seed + i (mod 2**63), each sample ends with its own
    Complete (nothing of it after that), the stream ends after all three; stats count one request, every token."""
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.95)
    seed = 2**63 - 2  # the third sample's seed wraps to 0
    singles = [client.generate("def f(x):", seed=s, **kw) for s in (seed, seed + 1, 0)]
    idle(client)
    before = client.stats()
    stub = pb.GenerationStub(client.channel)
    msgs = list(stub.Generate(build_request("def f(x):", seed=seed, n=3, **kw), timeout=120))
    after = client.stats()
    kinds = [m.WhichOneof("response") for m in msgs]
    assert kinds.count("complete") == 3 and kinds[-1] == "complete" and "error" not in kinds
    ended = set()
    for m in msgs:
        part = m.chunk if m.HasField("chunk") else m.complete
        assert part.index not in ended  # nothing of a sample after its Complete
        if m.HasField("complete"):
            ended.add(part.index)
    assert ended == {0, 1, 2}
    for i, want in enumerate(singles):
        ids = [t for m in msgs if m.HasField("chunk") and m.chunk.index == i for t in m.chunk.token_ids]
        done = next(m.complete for m in msgs if m.HasField("complete") and m.complete.index == i)
        assert ids == want.token_ids, i
        assert pb.finish_reason_name(done.finish_reason) == want.finish_reason and done.seed == want.seed
        assert done.usage.completion_tokens == len(ids) and done.usage.prompt_tokens == want.prompt_tokens
        assert done.usage.total_tokens == want.prompt_tokens + len(ids)
    assert len({tuple(s.token_ids) for s in singles}) > 1  # the seeds differ, and so do the samples
    assert after["requests_total"] - before["requests_total"] == 1
    assert after["generated_tokens_total"] - before["generated_tokens_total"] == sum(
        len(s.token_ids) for s in singles)
    assert sum(after["requests_finished"].values()) - sum(before["requests_finished"].values()) == 1
    # The client: a list of Completions, index order; chunks name their sample.
    stream = client.stream("def f(x):", seed=seed, n=3, **kw)
    chunks = list(stream)
    assert stream.completion is None and [c.index for c in stream.completions] == [0, 1, 2]
    for i, want in enumerate(singles):
        assert [t for c in chunks if c.index == i for t in c.token_ids] == want.token_ids
        assert stream.completions[i].token_ids == want.token_ids and stream.completions[i].text == want.text
    outs = client.generate("def f(x):", seed=seed, n=2, **kw)
    assert [o.token_ids for o in outs] == [s.token_ids for s in singles[:2]]


def test_32_concurrent_clients_get_their_own_outputs(server, client, model):
    """32 clients with 3 requests each (greedy text, seeded sampling on token ids, stop strings), all at once through
    4 slots and the queue: every output equals its own reference; the counters add up."""
    n = 32
    rng = np.random.default_rng(5)
    texts = [f"c{i} def f(x):" for i in range(n)]
    id_prompts = [rng.integers(0, EOS, int(rng.integers(3, 15))).tolist() for _ in range(n)]
    greedy = dict(max_tokens=20)
    sampled = dict(max_tokens=16, temperature=0.9, top_p=0.95, top_k=40)
    stops = dict(max_tokens=24, stop=["a", "b", "c", "d"])
    want = {
        "greedy": reference(model, texts, **_library_kw(greedy)),
        "sampled": reference(model, id_prompts, seed=1000, **_library_kw(sampled)),  # prompt i: seed 1000 + i
        "stops": reference(model, texts, **_library_kw(stops)),
    }
    requests = {"greedy": lambda i: (texts[i], greedy), "sampled": lambda i: (id_prompts[i], {**sampled,
                                                                                               "seed": 1000 + i}),
                "stops": lambda i: (texts[i], stops)}
    idle(client)
    before = client.stats()
    results, errors = {}, []

    def run_client(i):
        kinds = list(requests)
        kinds = kinds[i % 3:] + kinds[: i % 3]
        try:
            with Client(server.address, timeout=300) as c:
                for kind in kinds:
                    prompt, kw = requests[kind](i)
                    chunks, done = collect(c.stream(prompt, request_id=f"client{i}-{kind}", **kw))
                    results[(i, kind)] = (chunks, done)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=run_client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[:3]
    assert len(results) == 3 * n
    reasons = {"stop": 0, "length": 0}
    for (i, kind), (chunks, done) in results.items():
        w = want[kind][i]
        assert done.request_id == f"client{i}-{kind}"
        assert [t for c in chunks for t in c.token_ids] == w.token_ids, (i, kind)
        assert "".join(c.text for c in chunks) == w.text, (i, kind)
        assert done.finish_reason == w.finish_reason and done.completion_tokens == len(w.token_ids)
        reasons[done.finish_reason] += 1
    assert reasons["stop"] > 0 and reasons["length"] > 0  # both endings were exercised
    after = client.stats()
    assert after["requests_total"] - before["requests_total"] == 3 * n
    assert after["generated_tokens_total"] - before["generated_tokens_total"] == sum(
        d.completion_tokens for _, d in results.values())
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == sum(
        d.prompt_tokens for _, d in results.values())
    for reason, count in reasons.items():
        assert after["requests_finished"].get(reason, 0) - before["requests_finished"].get(reason, 0) == count
    assert after["engine_steps"] > before["engine_steps"] and after["engine_iterations"] > before["engine_iterations"]
    assert after["requests_active"] == after["requests_running"] == after["requests_queued"] == 0
    check_spec(after["spec"])
    assert after["uptime_s"] > 0 and after["ready"] and not after["draining"]


# ---- slots: abort, disconnect, deadline ------------------------------------------------------------------------
class StepGate:
    """Makes the engine thread wait for the test before each ``Engine.step()``: slot occupancy becomes independent of
    timing (a 240-token request otherwise finishes in a fraction of a second on this tiny model)."""

    def __init__(self, server: ServerThread):
        self.scheduler = server.server.scheduler
        self.engine = server.server.engine
        self._sem = threading.Semaphore(0)
        self._cond = threading.Condition()
        self._open = False
        self.steps = 0
        self.engine.step = self._step  # the engine thread looks the method up at every iteration

    def _step(self):
        if not self._open:
            self._sem.acquire()
        out = type(self.engine).step(self.engine)
        with self._cond:
            self.steps += 1
            self._cond.notify_all()
        return out

    def step(self, n=1, timeout=60.0):
        """Let the engine run ``n`` iterations and wait for them."""
        with self._cond:
            target = self.steps + n
            self._sem.release(n)
            assert self._cond.wait_for(lambda: self.steps >= target, timeout), "the engine did not step"

    def open(self):
        self._open = True
        self._sem.release(10_000)

    def close(self):
        self.open()
        self.engine.__dict__.pop("step", None)


def wait_for_abort(srv, rid, reason):
    wait_until(lambda: srv.server.scheduler.abort_reason(rid) == reason, what=f"{rid} to be aborted ({reason})")


def test_abort_and_disconnect_free_their_slots(server, client, model):
    idle(client)
    gate = StepGate(server)
    try:
        _abort_and_disconnect(server, client, model, gate)
    finally:
        gate.close()


def _abort_and_disconnect(server, client, model, gate):
    before = client.stats()
    longs = [client.stream([10 + i, 20, 30], max_tokens=LONG, ignore_eos=True, request_id=f"long{i}")
             for i in range(4)]
    wait_until(lambda: client.stats()["requests_active"] == 4, what="4 requests in flight")
    gate.step()  # admit and prefill all four, a few decode steps
    iters = [iter(s) for s in longs]
    for it in iters:
        next(it)
    assert client.stats()["requests_running"] == 4
    want = reference(model, "queued", max_new_tokens=6, ignore_eos=True)
    short = client.stream("queued", max_tokens=6, ignore_eos=True, request_id="short1")
    wait_until(lambda: client.stats()["requests_queued"] == 1, what="the short request to queue")

    # Abort: the aborted stream ends with finish_reason abort, and the queued request takes its slot at once.
    assert client.abort("long0", "no-such-request") == ["long0"]
    # Frees long0's slot and admits the short request; an iteration that completes a prompt returns its first token
    # at once, so the short request needs that iteration plus two decode iterations for its 6 tokens (1 + 4 + 4).
    gate.step(3)
    for _ in iters[0]:
        pass
    assert longs[0].completion.finish_reason == "abort" and longs[0].completion.completion_tokens < LONG
    chunks = list(short)
    assert [t for c in chunks for t in c.token_ids] == want.token_ids and short.completion.finish_reason == "length"
    assert client.stats()["requests_running"] == 3  # long1..3 still decoding: the freed slot served it

    # Disconnect: the client hangs up mid-stream; the server aborts the request and frees the slot.
    longs[1].cancel()
    with pytest.raises(GenerationError) as e:
        for _ in iters[1]:
            pass
    assert e.value.code == grpc.StatusCode.CANCELLED
    wait_for_abort(server, "long1", "cancelled")
    gate.step()
    stats = client.stats()
    assert stats["requests_running"] == 2
    assert stats["requests_finished"].get("cancelled", 0) == before["requests_finished"].get("cancelled", 0) + 1
    later = client.stream("later", max_tokens=5, ignore_eos=True, request_id="later")
    wait_until(lambda: client.stats()["requests_active"] == 3, what="the later request")
    gate.step(2)
    assert [t for c in later for t in c.token_ids] == reference(model, "later", max_new_tokens=5,
                                                                ignore_eos=True).token_ids

    assert sorted(client.abort("long2", "long3")) == ["long2", "long3"]
    gate.step()
    for s, it in zip(longs[2:], iters[2:]):
        for _ in it:
            pass
        assert s.completion.finish_reason == "abort"
    after = client.stats()
    assert after["requests_running"] == after["requests_active"] == 0
    assert after["requests_finished"].get("abort", 0) - before["requests_finished"].get("abort", 0) == 3


def test_cancelling_an_n_request_frees_every_slot(server, client):
    idle(client)
    before = client.stats()["requests_finished"].get("cancelled", 0)
    gate = StepGate(server)
    try:
        stream = client.stream([4, 5, 6], max_tokens=LONG, ignore_eos=True, temperature=1.0, n=3,
                               request_id="three")
        wait_until(lambda: client.stats()["requests_active"] == 1, what="the request")
        gate.step(2)  # admitted, prefilled once, the samples decoding
        assert client.stats()["requests_running"] == 3
        stream.cancel()
        wait_for_abort(server, "three", "cancelled")
        gate.step()
        stats = client.stats()
        assert stats["requests_running"] == stats["requests_active"] == 0
        assert stats["requests_finished"].get("cancelled", 0) == before + 1  # one request
    finally:
        gate.close()


def test_client_deadline_aborts_the_request(server, client, model):
    idle(client)
    before = client.stats()["requests_finished"].get("deadline", 0)
    gate = StepGate(server)
    try:
        with pytest.raises(GenerationError) as e:
            client.generate([1, 2, 3], max_tokens=LONG, ignore_eos=True, timeout=0.3, request_id="late")
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for_abort(server, "late", "deadline")
    finally:
        gate.close()
    wait_until(lambda: client.stats()["requests_finished"].get("deadline", 0) == before + 1,
               what="the server to abort the expired request")
    idle(client)
    assert client.generate([1, 2, 3], max_tokens=4).token_ids == reference(model, [1, 2, 3],
                                                                          max_new_tokens=4).token_ids


def test_a_call_ending_at_its_deadline_counts_as_expired_whichever_side_notices_first():
    """The client cancels at its deadline, a moment before the server's own (which starts when the request arrives):
    a call that ends within DEADLINE_SLACK_S of its deadline is aborted as "deadline", one that ends earlier as
    "cancelled", one without a deadline as "cancelled" (the flake this fixes: the client's cancellation won the race
    and the expired request counted as cancelled)."""
    from jaxmtp.serving.server import DEADLINE_SLACK_S, GenerationServer

    class Ctx:
        def __init__(self, remaining):
            self.remaining = remaining

        def time_remaining(self):
            return self.remaining

    assert GenerationServer._why_gone(Ctx(DEADLINE_SLACK_S / 2)) == "deadline"
    assert GenerationServer._why_gone(Ctx(-0.01)) == "deadline"
    assert GenerationServer._why_gone(Ctx(DEADLINE_SLACK_S * 4)) == "cancelled"
    assert GenerationServer._why_gone(Ctx(None)) == "cancelled"


# ---- bad input -------------------------------------------------------------------------------------------------
BAD = {
    "empty text": (dict(prompt=""), "the prompt is empty"),
    "empty token ids": (dict(token_ids=[]), "the prompt is empty"),
    "no input": (None, "has no input"),
    "empty chat": (dict(messages=[]), "no messages"),
    "out-of-vocabulary id": (dict(token_ids=[1, 2, 500]), "token id 500 is outside the vocabulary [0, 113)"),
    "negative temperature": (dict(prompt="ab", temperature=-0.5), "temperature must be a finite number >= 0"),
    "infinite temperature": (dict(prompt="ab", temperature=float("inf")), "temperature must be a finite number"),
    "NaN temperature": (dict(prompt="ab", temperature=float("nan")), "temperature must be a finite number"),
    "top_p zero": (dict(prompt="ab", top_p=0.0), "top_p must be in (0, 1]"),
    "top_p above one": (dict(prompt="ab", top_p=1.5), "top_p must be in (0, 1]"),
    "negative top_k": (dict(prompt="ab", top_k=-1), "top_k must be a non-negative integer"),
    "max tokens zero": (dict(prompt="ab", max_tokens=0), "max_tokens must be a positive integer, got 0"),
    "max tokens negative": (dict(prompt="ab", max_tokens=-3), "max_tokens must be a positive integer, got -3"),
    "max tokens above limit": (dict(prompt="ab", max_tokens=257), "above the server's limit of 256"),
    "prompt longer than context": (dict(token_ids=[1] * 300), "300 tokens, more than the server's limit of 255"),
    "prompt filling the context": (dict(token_ids=[1] * 256), "256 tokens, more than the server's limit of 255"),
    "unknown model": (dict(prompt="ab", model="gpt-17"), "unknown model 'gpt-17'"),
    "other k": (dict(prompt="ab", num_draft_tokens=3), "verifies 2 draft tokens per step"),
    "empty stop string": (dict(prompt="ab", stop=["x", ""]), "stop strings must be non-empty"),
    "stop id out of vocabulary": (dict(prompt="ab", stop_token_ids=[113]), "stop token id 113 is outside"),
    "too many stop ids": (dict(prompt="ab", stop_token_ids=list(range(8))), "at most 7 stop_token_ids"),
    "seed too large": (dict(prompt="ab", seed=2**63), "seed must be an integer in [0, 2**63)"),
    "min_p above one": (dict(prompt="ab", min_p=2.0), "min_p must be in [0, 1]"),
    "logit_bias value": (dict(prompt="ab", logit_bias={5: 500}), "logit_bias values must be in [-100, 100]"),
    "logit_bias id out of vocabulary": (dict(prompt="ab", logit_bias={113: 1}), "logit_bias id 113 is outside"),
    "logprobs above 20": (dict(prompt="ab", logprobs=21), "logprobs must be an integer in [0, 20]"),
    "min_tokens above max_tokens": (dict(prompt="ab", max_tokens=4, min_tokens=5), "min_tokens 5 is above"),
    "n zero": (dict(prompt="ab", n=0), "n must be an integer in [1, 128], got 0"),
    "n above 128": (dict(prompt="ab", n=129), "n must be an integer in [1, 128], got 129"),
    "n above the slots": (dict(prompt="ab", n=5), "n=5 samples need as many slots, and the engine has 4"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(client, case):
    kw, message = BAD[case]
    req = build_request(**kw) if kw is not None else pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4))
    if kw is not None and kw.get("token_ids") == []:
        req.token_ids.SetInParent()  # an empty (but present) token-id input
    if kw is not None and kw.get("messages") == []:
        req.chat.SetInParent()
    stub = pb.GenerationStub(client.channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()
    assert client.generate("ok", max_tokens=2).completion_tokens == 2


# ---- limits, server deadline, drain ----------------------------------------------------------------------------
def test_queue_bound_message_size_duplicates_and_server_deadline(make_server, model):
    srv = make_server(max_queue=1, max_message_bytes=2048, max_request_seconds=3.0)
    gate = StepGate(srv)  # nothing is admitted until the test says so
    try:
        with Client(srv.address, timeout=60) as c:
            stub = pb.GenerationStub(c.channel)
            calls = [stub.Generate(build_request([3, 4, 5 + i], max_tokens=LONG, ignore_eos=True,
                                                 request_id=f"r{i}"), timeout=60) for i in range(4)]
            for i, call in enumerate(calls):  # initial metadata: accepted (capacity 4 slots + 1 queued)
                assert dict(call.initial_metadata())["x-request-id"] == f"r{i}"
            with pytest.raises(GenerationError) as e:  # two samples need two places; one is left
                c.generate([1, 2], max_tokens=2, n=2)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "4 samples in flight" in e.value.message
            calls.append(stub.Generate(build_request([3, 4, 9], max_tokens=LONG, ignore_eos=True, request_id="r4"),
                                       timeout=60))
            assert dict(calls[-1].initial_metadata())["x-request-id"] == "r4"
            with pytest.raises(GenerationError) as e:
                c.generate([1, 2], max_tokens=2)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at capacity" in e.value.message
            with pytest.raises(GenerationError) as e:
                c.generate([1, 2], max_tokens=2, request_id="r0")
            assert e.value.code == grpc.StatusCode.ALREADY_EXISTS and "r0" in e.value.message
            with pytest.raises(GenerationError) as e:
                c.generate("x" * 4000, max_tokens=2)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            gate.step()  # four of them start decoding; the last to arrive stays queued
            # The server-side limit (3 s) ends every one: an Error message with the usage, then DEADLINE_EXCEEDED.
            started = 0
            for call in calls:
                msgs = []
                with pytest.raises(grpc.RpcError) as e:
                    for m in call:
                        msgs.append(m)
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                last = msgs[-1]
                assert last.WhichOneof("response") == "error" and last.error.code_name == "DEADLINE_EXCEEDED"
                streamed = sum(len(m.chunk.token_ids) for m in msgs[:-1])
                assert last.error.usage.completion_tokens == streamed
                started += streamed > 0
            assert started == 4  # the one that arrived last was still queued
            gate.open()
            wait_until(lambda: c.stats()["requests_active"] == 0, what="the aborts")
            stats = c.stats()
            assert stats["requests_finished"] == {"deadline": 5}
            # at capacity twice (the n = 2 request, then the full queue); the large message never reached the server
            assert stats["requests_rejected"] == {"RESOURCE_EXHAUSTED": 2, "ALREADY_EXISTS": 1}
            assert c.generate([1, 2], max_tokens=4).token_ids == reference(model, [1, 2],
                                                                          max_new_tokens=4).token_ids
    finally:
        gate.close()


def test_drain_finishes_in_flight_requests_then_cuts_the_rest(make_server, model):
    srv = make_server(max_queue=4)
    gate = StepGate(srv)
    try:
        with Client(srv.address, timeout=120) as c:
            long = c.stream([9, 9, 9], max_tokens=LONG, ignore_eos=True, request_id="long")
            want = reference(model, [4, 4], max_new_tokens=8, ignore_eos=True)
            short = c.stream([4, 4], max_tokens=8, ignore_eos=True)
            wait_until(lambda: c.stats()["requests_active"] == 2, what="both requests")
            result = {}
            drainer = threading.Thread(target=lambda: result.setdefault("cut", srv.drain(grace=1.0)))
            drainer.start()
            wait_until(lambda: c.health() == "NOT_SERVING", what="NOT_SERVING")
            with pytest.raises(GenerationError) as e:
                c.generate([1], max_tokens=2)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.message
            gate.step(3)  # within the grace period the short request runs to its end (prefill, then 2 x 4 steps)
            assert [t for ch in short for t in ch.token_ids] == want.token_ids
            assert short.completion.finish_reason == "length"
            wait_for_abort(srv, "long", "shutdown")  # the grace period is over
            gate.open()
            with pytest.raises(GenerationError) as e:
                for _ in long:
                    pass
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "shut down" in e.value.message
            drainer.join(60)
            assert result["cut"] == 1
            assert c.stats()["requests_finished"] == {"length": 1, "shutdown": 1}
    finally:
        gate.close()


def test_engine_failure_fails_in_flight_requests_and_turns_not_serving(make_server):
    srv = make_server()

    def broken_step():
        raise RuntimeError("device lost")

    srv.server.engine.step = broken_step
    with Client(srv.address, timeout=60) as c:
        msgs = []
        with pytest.raises(grpc.RpcError) as e:
            for m in pb.GenerationStub(c.channel).Generate(build_request([1, 2, 3], max_tokens=8), timeout=60):
                msgs.append(m)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "device lost" in e.value.details()
        assert [m.WhichOneof("response") for m in msgs] == ["error"] and msgs[0].error.code_name == "INTERNAL"
        wait_until(lambda: c.health() == "NOT_SERVING", what="NOT_SERVING")
        with pytest.raises(GenerationError) as e:
            c.generate([1, 2], max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "engine failed" in e.value.message
        assert c.stats()["requests_finished"] == {"error": 1}
    assert srv.server.failed.is_set()


def test_sigterm_drains_and_exits_zero(ckpt, compile_cache, tmp_path):
    """The real command: --port 0 prints the port, health turns SERVING after warm-up, SIGTERM turns it NOT_SERVING,
    refuses new requests with UNAVAILABLE, lets the in-flight request finish, and exits 0."""
    cmd = [sys.executable, "-m", "jaxmtp.serve", "--model", ckpt, "--port", "0", "--dtype", "float32",
           "--slots", "4", "--max-context", "256", "-k", "2", "--prefill-chunk", "16", "--steps-per-sync", "4",
           "--compilation-cache-dir", compile_cache, "--drain-grace", "120"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    err_path = tmp_path / "serve.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith("jaxmtp.serve listening on 127.0.0.1:"), (line, err_path.read_text())
        address = line.split()[-1]
        with Client(address, timeout=120) as c:
            c.wait_ready(timeout=300)
            assert c.health() == "SERVING"
            # 16 requests through 4 slots: in flight (running or queued) for many engine iterations
            streams = [c.stream([2, 3, 4 + i], max_tokens=LONG, ignore_eos=True) for i in range(16)]
            it0 = iter(streams[0])
            first = next(it0)
            watch = iter(pb.HealthStub(c.channel).Watch(pb.HealthCheckRequest(), timeout=120))
            assert next(watch).status == pb.SERVING
            proc.send_signal(signal.SIGTERM)
            assert next(watch).status == pb.NOT_SERVING
            with pytest.raises(GenerationError) as e:
                c.generate([1, 2], max_tokens=2)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.message
            counts = [len(first.token_ids) + sum(len(ch.token_ids) for ch in it0)]
            counts += [sum(len(ch.token_ids) for ch in s) for s in streams[1:]]
            assert counts == [LONG] * 16 and all(s.completion.finish_reason == "length" for s in streams)
        assert proc.wait(timeout=120) == 0
        log = err_path.read_text()
        assert "memory plan" in log and "SIGTERM: draining" in log and "SERVING" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- command-line client and the benchmark script --------------------------------------------------------------
def test_cli_client_streams_text(server, model):
    want = reference(model, "def g():", max_new_tokens=12, temperature=0.7, seed=3)
    out = subprocess.run([sys.executable, "-m", "jaxmtp.client", "def g():", "--address", server.address,
                          "--max-tokens", "12", "--temperature", "0.7", "--seed", "3"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def g():" + want.text)
    assert f"finish={want.finish_reason}" in out.stderr and "seed 3" in out.stderr


def test_bench_script_against_a_running_server(server, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(ROOT, "scripts", "bench_serve.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--address", server.address, "--concurrency", "1", "2", "--requests", "3",
                       "--max-tokens", "8", "--prompt-tokens", "6", "--json", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    assert [lvl["concurrency"] for lvl in data["levels"]] == [1, 2]
    for lvl in data["levels"]:
        assert lvl["requests"] == 3 and lvl["errors"] == 0 and lvl["output_tokens"] == 24
        for key in ("ttft_ms", "tpot_ms", "latency_ms"):
            assert set(lvl[key]) == {"p50", "p90", "p99", "mean"} and lvl[key]["p50"] > 0
        assert lvl["output_tokens_per_s"] > 0
