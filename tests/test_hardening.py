"""Hardening of the server and the library against hostile or careless input (issue 28).

Stop strings are bounded and matched in time linear in the new text; every client error gets its documented status
code and at most one log line; a busy port is a settings error; a client's early Abort is remembered; the optional
API key and TLS work; a bounded fuzz run leaves no server-side traceback and a SERVING server.
"""

import logging
import os
import random
import subprocess
import sys
import threading
import time

import grpc
import jax
import numpy as np
import pytest

import jaxmtp
from jaxmtp.engine import Engine, SpecStats
from jaxmtp.engine import engine as engine_module
from jaxmtp.engine.text import MAX_STOP_BYTES, MAX_STOP_STRINGS, IncrementalDetokenizer, StopMatcher
from jaxmtp.sampling import SamplingParams
from jaxmtp.serving import protocol as pb
from jaxmtp.serving import scheduler as scheduler_module
from jaxmtp.serving.client import Client, GenerationError, build_request
from jaxmtp.serving.server import ServerConfig, ServerThread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_KW = dict(num_slots=1, max_context=256, num_draft_tokens=2, prefill_chunk=16, steps_per_sync=4,
                 slot_buckets=False)


# ---- stop strings: the matcher against a brute-force reference ------------------------------------------------
def _first_stop(text, stops):
    """Brute force: (end, length) of the first stop string to complete in ``text`` (longest among equal ends)."""
    for end in range(1, len(text) + 1):
        found = [len(s) for s in stops if text[:end].endswith(s)]
        if found:
            return end, max(found)
    return None


def _held(text, stops):
    """Brute force: the longest tail of ``text`` that is a proper prefix of a stop string."""
    return max([n for s in stops for n in range(1, len(s)) if n <= len(text) and text.endswith(s[:n])] or [0])


def test_stop_matcher_equals_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        alphabet = rng.choice(["ab", "abc", "aé日\n"])
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        m, pos, got = StopMatcher(stops), 0, None
        while pos < len(text):
            piece = text[pos : pos + rng.randint(0, 5)]
            hit = m.feed(piece)
            if hit is not None:
                got = (pos + hit[0], hit[1])
                break
            pos += len(piece)
            assert m.held == _held(text[:pos], stops), (stops, text[:pos])
        assert got == _first_stop(text, stops), (stops, text)


class _CountingTokenizer:
    """A character tokenizer (id i is chr(32 + i)) that counts the ids it decodes."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return "".join(chr(32 + i) for i in ids)


def test_detokenizer_and_matcher_work_per_piece_does_not_grow_with_the_output():
    """Feeding a 20,000-token output piece by piece: the ids decoded and the matcher's held-back tail per piece stay
    bounded by the window and the longest stop string, not by the output so far."""
    tok = _CountingTokenizer()
    detok = IncrementalDetokenizer(tok)
    rng = np.random.default_rng(0)
    stops = ["~" + "".join(chr(32 + int(i)) for i in rng.integers(0, 90, 255)) for _ in range(MAX_STOP_STRINGS)]
    m = StopMatcher(stops)
    per_piece, n_text = [], 0
    for _ in range(5000):
        before = tok.decoded
        delta = detok.add(rng.integers(0, 90, 4).tolist())
        assert m.feed(delta) is None
        n_text += len(delta)
        per_piece.append(tok.decoded - before)
        assert m.held < 256
    assert detok.n_chars == n_text == 20000
    assert max(per_piece) <= 3 * 4 + 4  # two short windows per piece


class _HostOnly(Engine):
    """The engine's host-side output path (``_emit``) without a model or a device."""

    def __init__(self):
        self._lock = threading.RLock()
        self._by_id = {}


def test_engine_text_work_per_step_does_not_grow_with_the_output():
    """The engine thread's work per step (detokenise, match stop strings, stream) for a request whose output is 8,000
    characters long is as small as at its start. The stop string is the worst case for a tail-by-prefix scan: never
    a prefix of the output's tail, so a scan tries every length (quadratic matching took milliseconds per step at
    this length, and grew with it)."""
    tok = _CountingTokenizer()
    a = ord("a") - 32
    params = SamplingParams(max_new_tokens=10**6, stop=("b" + "a" * (MAX_STOP_BYTES - 2),))
    req = engine_module._Request("r", np.ones(1, np.int32), params, 0.0, detok=IncrementalDetokenizer(tok),
                                 stats=SpecStats(k=0, accepted_per_position=[]))
    req.stops = StopMatcher(params.stop)
    host, outputs, text = _HostOnly(), {}, []

    def steps(n):
        t0 = time.perf_counter()
        for _ in range(n):
            outputs.clear()
            host._emit(outputs, req, [a] * 4)
            text.append(outputs[("r", 0)].text)
        return (time.perf_counter() - t0) / n

    steps(2000)  # 8,000 characters of output
    late = min(steps(50) for _ in range(5))
    assert late < 1e-3, f"{late * 1e3:.2f} ms per step"
    assert not req.done and "".join(text) == "a" * (4 * 2250)  # nothing held back: "a" never begins the stop


# ---- a server with captured logs -------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def tracebacks(self):
        return [r for r in self.records if r.exc_info or "Traceback" in r.getMessage()]


@pytest.fixture(scope="module")
def logs():
    """Every log record of the process while this module's servers run (grpc's own loggers included)."""
    handler = _Records()
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in ("jaxmtp", "grpc")}
    root.addHandler(handler)
    logging.getLogger("jaxmtp").setLevel(logging.DEBUG)  # the one-line rejections included
    logging.getLogger("grpc").setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(scope="module")
def server(model, compile_cache, logs):
    with ServerThread(model, ServerConfig(port=0, max_queue=8, default_max_tokens=16, **ENGINE_KW)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


def _code(call):
    """The status code of a unary-stream call run to its end (OK if it completed)."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _raw(channel, method, streaming):
    """A call of ``method`` that sends raw bytes (no client-side serialisation)."""
    path = pb.method_path(pb.HEALTH_SERVICE if method in ("Check", "Watch") else pb.GENERATION_SERVICE, method)
    factory = channel.unary_stream if streaming else channel.unary_unary
    return factory(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)


# ---- item 1: stop-string limits, and their cost on the engine thread -------------------------------------------
@pytest.mark.parametrize("stops, message", [
    (["s%d" % i for i in range(MAX_STOP_STRINGS + 1)], f"at most {MAX_STOP_STRINGS} stop strings"),
    (["x" * (MAX_STOP_BYTES // 2), "é" * (MAX_STOP_BYTES // 4 + 1)], f"more than the limit of {MAX_STOP_BYTES}"),
])
def test_stop_strings_past_the_limits_are_invalid_argument(client, stops, message):
    with pytest.raises(GenerationError) as e:
        client.generate("ab", max_tokens=2, stop=stops)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.message


def test_stop_strings_at_the_limits_change_nothing_until_one_completes(client, model):
    """The most stop strings allowed, none completing: the output equals the output without them (greedy). Then the
    same strings plus one taken from that output: the text ends right before it, as a brute-force search says."""
    stops = ["\t" * (MAX_STOP_BYTES // MAX_STOP_STRINGS - 1) + chr(33 + i) for i in range(MAX_STOP_STRINGS - 1)]
    plain = client.generate([5, 6, 7], max_tokens=200, ignore_eos=True)
    assert all(s not in plain.text for s in stops)
    got = client.generate([5, 6, 7], stop=stops, max_tokens=200, ignore_eos=True)
    assert got.token_ids == plain.token_ids and got.text == plain.text and len(got.token_ids) == 200
    stop = plain.text[120:127]
    cut = plain.text.find(stop)
    hit = client.generate([5, 6, 7], stop=stops + [stop], max_tokens=200, ignore_eos=True)
    assert hit.finish_reason == "stop" and hit.text == plain.text[:cut]
    assert model.tokenizer.decode(hit.token_ids).startswith(plain.text[: cut + len(stop)])
    assert hit.token_ids == plain.token_ids[: len(hit.token_ids)]


# ---- item 2: status codes of malformed input -------------------------------------------------------------------
ODD_IDS = ["é", "日本", "a\nb", "a\tb", "nul\x00", "del\x7f", "\x1b[31m"]


@pytest.mark.parametrize("rid", ODD_IDS)
def test_request_id_outside_printable_ascii_is_invalid_argument(client, rid):
    with pytest.raises(GenerationError) as e:
        client.generate("ab", max_tokens=2, request_id=rid)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "printable ASCII" in e.value.message


def test_printable_request_ids_are_echoed(client):
    rid = "".join(chr(c) for c in range(0x21, 0x7f))[:80] + " x"
    out = client.generate("ab", max_tokens=2, request_id=rid)
    assert out.request_id == rid and out.completion_tokens == 2


def _utf8_field(number: int, payload: bytes) -> bytes:
    assert number < 16 and len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize("method, streaming, payload", [
    ("Generate", True, b"\xff\xff\xff\xff"),
    ("Generate", True, _utf8_field(pb.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number, b"ab\xff\xfe")),
    ("Generate", True, _utf8_field(pb.GenerateRequest.DESCRIPTOR.fields_by_name["request_id"].number, b"\xc3")),
    ("Abort", False, b"\x0a\x05ab"),  # a length past the end
    ("GetModelInfo", False, b"\x08"),
    ("Check", False, b"\x0a\x02\xff\xff"),
])
def test_malformed_messages_are_invalid_argument(client, method, streaming, payload):
    call = _raw(client.channel, method, streaming)
    if streaming:
        code, details = _code(call(payload, timeout=30))
    else:
        try:
            call(payload, timeout=30)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "is not a valid" in details


# ---- item 8: an Abort that arrives before its request ----------------------------------------------------------
def test_abort_before_the_request_arrives_cancels_it_at_once(client, model, monkeypatch):
    assert client.abort("early-1") == []  # not in flight: remembered
    out = client.generate([3, 4, 5], max_tokens=200, ignore_eos=True, request_id="early-1")
    assert out.finish_reason == "abort" and out.completion_tokens == 0
    # remembered once: the id can be used again, and other ids are not affected
    again = client.generate([3, 4, 5], max_tokens=6, ignore_eos=True, request_id="early-1")
    want = client.generate([3, 4, 5], max_tokens=6, ignore_eos=True)
    assert again.finish_reason == "length" and again.token_ids == want.token_ids
    # an abort older than the memory lasts is forgotten
    monkeypatch.setattr(scheduler_module, "RECENT_ABORT_SECONDS", 0.05)
    client.abort("early-2")
    time.sleep(0.2)
    assert client.generate([3, 4, 5], max_tokens=6, ignore_eos=True, request_id="early-2").finish_reason == "length"


def test_remembered_aborts_are_bounded(server, monkeypatch):
    monkeypatch.setattr(scheduler_module, "RECENT_ABORTS", 16)
    sched = server.server.scheduler
    for i in range(100):
        assert not sched.abort(f"never-{i}")
    assert len(sched._recent_aborts) <= 16 and "never-99" in sched._recent_aborts


# ---- item 3: a busy port -----------------------------------------------------------------------------------------
def test_busy_port_is_a_one_line_settings_error(ckpt, server):
    port = server.address.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "jaxmtp.serve", "--model", ckpt, "--port", port, "--dtype",
                           "float32", "--slots", "1", "--max-context", "64"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "listening" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line or line.startswith("E0")]
    assert len(errors) == 1 and "could not bind" in errors[0] and port in errors[0], proc.stderr


def test_missing_http_dependency_is_a_one_line_error_before_loading(monkeypatch, caplog):
    """Without starlette the HTTP API cannot start: the server says so and exits 2 before it loads the model or binds
    a port (where it once crashed after 'listening', and a client waited out its deadline)."""
    from jaxmtp import serve

    for name in [m for m in sys.modules if m.split(".")[0] == "starlette"] + ["starlette"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing starlette or a submodule now raises ImportError
    monkeypatch.delitem(sys.modules, "jaxmtp.serving.http_api", raising=False)
    monkeypatch.setattr(serve, "load_model", lambda args: pytest.fail("loaded the model before the check"))
    # this process's JAX settings stay as the other tests set them
    monkeypatch.setattr("jaxmtp.compile_cache.enable_from_args", lambda args: None)
    monkeypatch.setattr("jaxmtp.engine.memory.set_memory_fraction", lambda fraction: None)
    with caplog.at_level(logging.ERROR, logger="jaxmtp.serve"):
        assert serve.main(["--random-model", "tiny", "--port", "0"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "starlette" in errors[0] and "--no-http" in errors[0], errors


def test_a_kernel_override_is_checked_before_loading_and_applied_after(monkeypatch, caplog):
    """``--kernel-override``: a bad spec is one error line and exit 2 before any weight is read; a good one is the
    loaded model's backend, its other fields as --backend chose them."""
    from jaxmtp import serve
    from jaxmtp.pallas import resolve_backend

    monkeypatch.setattr("jaxmtp.compile_cache.enable_from_args", lambda args: None)
    monkeypatch.setattr("jaxmtp.engine.memory.set_memory_fraction", lambda fraction: None)
    monkeypatch.setattr("jaxmtp.load", lambda *a, **k: pytest.fail("loaded the model before the check"))
    with caplog.at_level(logging.ERROR, logger="jaxmtp.serve"):
        assert serve.main(["--no-http", "--port", "0", "--kernel-override", "attention_mosaic_min_tokens=x"]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "attention_mosaic_min_tokens takes an integer" in errors[0], errors
    monkeypatch.undo()

    args = serve.build_parser().parse_args(["--random-model", "tiny", "--kernel-override",
                                            "attention_mosaic_min_tokens=none,recurrent_max_tokens=7"])
    model = serve.load_model(args)
    policy = model.backend.policy
    assert policy.attention_mosaic_min_tokens is None and policy.recurrent_max_tokens == 7
    plain = resolve_backend("auto", model.config, model.dtype)
    assert model.backend.attention == plain.attention
    assert policy.attention_max_splits == plain.policy.attention_max_splits


def test_the_servers_reduce_choices_are_the_reduction_modes():
    """``--tensor-parallel-reduce`` spells the modes out (its parser imports no JAX): they stay those of
    jaxmtp.pallas.collectives, plus auto."""
    from jaxmtp import serve
    from jaxmtp.pallas.collectives import REDUCE_MODES

    action = next(a for a in serve.build_parser()._actions if a.dest == "tensor_parallel_reduce")
    assert sorted(action.choices) == sorted(("auto", *REDUCE_MODES)) and action.default == "auto"


# ---- item 7: API key and TLS -------------------------------------------------------------------------------------
def _self_signed(tmp_path):
    crypto = pytest.importorskip("cryptography")  # noqa: F841
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(certfile), str(keyfile)


def test_api_key_and_tls(model, compile_cache, tmp_path, monkeypatch):
    monkeypatch.delenv("JAXMTP_API_KEY", raising=False)
    monkeypatch.delenv("JAXMTP_SSL_CA_CERTFILE", raising=False)
    certfile, keyfile = _self_signed(tmp_path)
    cfg = ServerConfig(host="localhost", port=0, api_key="s3cret-key", ssl_certfile=certfile, ssl_keyfile=keyfile,
                       **ENGINE_KW)
    with ServerThread(model, cfg) as srv:
        address = f"localhost:{srv.port}"
        with Client(address, timeout=60, ssl_ca_certfile=certfile, api_key="s3cret-key") as c:
            assert c.generate([1, 2, 3], max_tokens=3).completion_tokens == 3
            assert c.model_info()["num_slots"] == 1
        for key in ("", "wrong", "s3cret-key "):
            with Client(address, timeout=60, ssl_ca_certfile=certfile, api_key=key) as c:
                assert c.health() == "SERVING"  # health checks need no key
                for call in (lambda: c.generate([1, 2], max_tokens=2), c.stats, lambda: c.abort("x")):
                    with pytest.raises(GenerationError) as e:
                        call()
                    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.message
        # the command-line client takes both flags (token ids: the test model has no tokenizer)
        from jaxmtp.client import main as client_main

        argv = ["--address", address, "--token-ids", "1,2,3", "--max-tokens", "2", "--quiet", "--wait", "30"]
        assert client_main(argv + ["--api-key", "s3cret-key", "--ssl-ca-certfile", certfile]) == 0
        assert client_main(argv + ["--api-key", "wrong", "--ssl-ca-certfile", certfile]) != 0
        monkeypatch.setenv("JAXMTP_API_KEY", "s3cret-key")  # the client's default
        monkeypatch.setenv("JAXMTP_SSL_CA_CERTFILE", certfile)
        with Client(address, timeout=60) as c:
            assert c.generate([1, 2, 3], max_tokens=2).completion_tokens == 2
        with Client(address, timeout=10, ssl_ca_certfile=None) as c:  # env CA: still TLS
            assert c.health() == "SERVING"
        with Client(address, timeout=10, channel=grpc.insecure_channel(address)) as c:  # plaintext to a TLS port
            with pytest.raises(GenerationError) as e:
                c.health()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_bad_tls_and_key_settings_are_errors(tmp_path):
    with pytest.raises(ValueError, match="both --ssl-certfile and --ssl-keyfile"):
        ServerConfig(ssl_certfile=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="is not a file"):
        ServerConfig(ssl_certfile=str(tmp_path / "a"), ssl_keyfile=str(tmp_path / "b")).validate()
    with pytest.raises(ValueError, match="printable ASCII"):
        ServerConfig(api_key="clé").validate()


# ---- item 6: one dtype rule --------------------------------------------------------------------------------------
def test_every_entry_point_uses_one_auto_dtype(ckpt):
    from jaxmtp.generation import main as _  # noqa: F401 - the CLI module imports
    from jaxmtp.loaded_model import resolve_dtype
    from jaxmtp.serve import build_parser

    want = np.dtype("float32") if jax.default_backend() == "cpu" else np.dtype("bfloat16")
    assert resolve_dtype("auto") == want and resolve_dtype() == want
    assert jaxmtp.load(ckpt, progress=False).dtype == want  # the library default
    assert build_parser().parse_args([]).dtype == "auto"
    import jaxmtp.generation as gen

    src = open(gen.__file__).read()
    assert 'ap.add_argument("--dtype", default="auto"' in src


# ---- the fuzz run ------------------------------------------------------------------------------------------------
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.ALREADY_EXISTS}


def _random_request(rng: random.Random):
    """A GenerateRequest: a valid one with 0-3 random mutations (odd field values, odd ids, stop-string bombs), or
    garbage bytes, or a valid message with a corrupted byte."""
    kind = rng.random()
    if kind < 0.15:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    if kind < 0.25:
        data = bytearray(build_request("abc", max_tokens=3).SerializeToString())
        data[rng.randrange(len(data))] = rng.getrandbits(8)
        return bytes(data)
    pick = rng.choice
    req = build_request(pick(["def f(x):", [5, 6, 7]]), max_tokens=rng.randint(1, 8))
    s = req.sampling

    def stops(n, length):
        s.stop.extend(("ab" * length)[:length] + str(i) for i in range(n))

    mutations = [
        lambda: setattr(req, "request_id", pick(["ok-id", "é", "a\nb", "\x00", " ", "x" * 300, "dup"])
                        + str(rng.randint(0, 3))),
        lambda: setattr(req, "text", pick(["", "\U0001f600" * 3, "\x00\x01", "a" * 200])),
        lambda: req.token_ids.ids.extend(pick([0, 112, 113, 2**32 - 1]) for _ in range(rng.randint(0, 8))),
        lambda: req.chat.messages.add(role=pick(["user", "", "\x00"]), content=pick(["hi", ""])),
        lambda: req.ClearField("input"),
        lambda: setattr(s, "max_tokens", pick([-1, 0, 300, 2**31 - 1])),
        lambda: setattr(s, "temperature", pick([-1.0, 0.7, float("nan"), float("inf"), 1e30])),
        lambda: setattr(s, "top_p", pick([0.0, 0.5, 1.5, float("nan")])),
        lambda: setattr(s, "top_k", pick([-3, 5, 2**31 - 1])),
        lambda: setattr(s, "seed", pick([0, 2**63 - 1, 2**64 - 1])),
        lambda: stops(MAX_STOP_STRINGS, MAX_STOP_BYTES // MAX_STOP_STRINGS - 2),  # at the limits: accepted
        lambda: stops(pick([MAX_STOP_STRINGS + 1, 1000]), pick([1, 50])),
        lambda: stops(pick([2, 40]), pick([5000, 20000])),
        lambda: s.stop.append(""),
        lambda: s.stop_token_ids.extend(pick([0, 7, 111, 113, 2**32 - 1]) for _ in range(rng.randint(1, 9))),
        lambda: setattr(s, "ignore_eos", True),
        lambda: setattr(req, "num_draft_tokens", pick([0, 2, 7])),
        lambda: setattr(req, "model", pick(["", "other"])),
    ]
    for _ in range(pick([0, 0, 1, 1, 2, 3])):
        pick(mutations)()
    return req


def test_fuzz_status_codes_no_tracebacks_and_still_serving(server, client, logs, capfd):
    """300 random requests (random field values, garbage bytes, odd ids, stop-string bombs), 4 at a time, plus
    Aborts of random ids: every status is one a client error may get, the server logs no traceback, and it is
    SERVING afterwards and gives the output it gave before."""
    rng = random.Random(28)
    requests = [_random_request(rng) for _ in range(300)]
    before = client.generate([1, 2, 3], max_tokens=8, ignore_eos=True)
    raw = _raw(client.channel, "Generate", True)
    codes, lock = {}, threading.Lock()
    first_record = len(logs.records)

    def run(part, seed):
        rng = random.Random(seed)
        for item in part:
            data = item if isinstance(item, bytes) else item.SerializeToString()
            code, details = _code(raw(data, timeout=60))
            with lock:
                codes.setdefault(code, []).append(details)
            if rng.random() < 0.1:
                client.abort(*rng.choice([["dup1"], ["é"], ["x" * 1000], ["", "ok-id0"]]))

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(requests[i::4], i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert time.monotonic() - t0 < 60
    assert set(codes) <= ALLOWED, {c: v[:2] for c, v in codes.items() if c not in ALLOWED}
    assert len(codes.get(grpc.StatusCode.INVALID_ARGUMENT, [])) > 50 and len(codes.get(grpc.StatusCode.OK, [])) > 50
    new = logs.records[first_record:]
    assert not [r for r in new if r.exc_info or "Traceback" in r.getMessage()], \
        [r.getMessage()[:200] for r in new if r.exc_info][:3]
    assert not [r for r in new if r.levelno >= logging.WARNING], [r.getMessage()[:200] for r in new][:5]
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    assert client.health() == "SERVING"
    assert client.generate([1, 2, 3], max_tokens=8, ignore_eos=True).token_ids == before.token_ids


def test_no_server_traceback_in_this_module(logs):
    """Every client error of this module logged one line at most and no traceback."""
    assert not logs.tracebacks(), [r.getMessage()[:300] for r in logs.tracebacks()][:3]
