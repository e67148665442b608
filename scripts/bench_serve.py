"""Load test of ``python -m jaxmtp.serve``: throughput and latency percentiles at several concurrency levels.

    # CPU, the embedded default model (the script starts the server itself and stops it at the end):
    python scripts/bench_serve.py --json runs/bench_serve_cpu.json

    # GPU, random weights of Qwen3.5-0.8B shapes (token-id prompts), 32 slots; the compilation cache makes a second
    # run (or a retry after a time-out during the warm-up) skip the compiles:
    python scripts/bench_serve.py --random-model qwen3.5-0.8b --slots 32 --prompt-tokens 256 --max-tokens 256 \\
        --server-arg=--max-prefill-batch=4 --server-arg=--compilation-cache-dir=runs/jax_cache \\
        --label "H100" --json runs/bench_serve_h100.json

    # Any running server:
    python scripts/bench_serve.py --address 127.0.0.1:50051

    # The OpenAI-compatible HTTP API instead of gRPC (same server, same engine; docs/serving.md):
    python scripts/bench_serve.py --protocol http
    python scripts/bench_serve.py --protocol http --address 127.0.0.1:50051 --http-address 127.0.0.1:8000

At each concurrency level C (default 1, 8, 32), C asynchronous clients send ``--requests`` requests in total (default
4 x C), each client one request at a time. Per request: TTFT (send to the first chunk with tokens), TPOT ((last chunk
- first chunk) / (output tokens - 1), as vLLM's benchmark; left out for a request whose tokens all came in one chunk),
latency (send to the final message). Per level: p50/p90/p99/mean of each, output tokens per second over the level's
wall time, requests per second, and the server's speculation counters over the level (mean acceptance length,
acceptance per draft position). ``--protocol http`` sends the same requests as streamed ``POST /v1/completions``
(server-sent events, ``stream_options.continuous_usage_stats`` for the token counts) over one keep-alive HTTP/1.1
connection per client, read by a minimal asyncio client so that client-side parsing costs about what gRPC's does;
the counters still come from the gRPC stats call. ``ignore_eos`` is on by default so that every request produces exactly
``--max-tokens`` tokens. The started server's logs (configuration, memory plan, warm-up time) go to stderr.

Prompts: token ids drawn uniformly from the vocabulary (``--prompt-source random``, the default for models without a
tokenizer), or windows of Python standard-library source (``text``, the default otherwise: the default model was
trained on it) cut to ``--prompt-chars`` characters (default 4 x ``--prompt-tokens``); the JSON reports the prompt
tokens the server counted.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    g = ap.add_argument_group("target (default: start `python -m jaxmtp.serve` with the embedded default model)")
    g.add_argument("--address", default=None, help="benchmark a running server at host:port (its gRPC port)")
    g.add_argument("--protocol", choices=["grpc", "http"], nargs="+", default=["grpc"],
                   help="send the requests over gRPC (Generate) or the OpenAI-compatible HTTP API (/v1/completions); "
                        "both: each client alternates them request by request (the same prompt over each in turn), "
                        "and every level reports each protocol's latencies")
    g.add_argument("--http-address", default=None,
                   help="with --address and --protocol http: the running server's HTTP host:port")
    g.add_argument("--model", default=None, help="checkpoint directory for the server this script starts")
    g.add_argument("--random-model", default=None, help="random weights of a preset (qwen3.5-0.8b, tiny)")
    g.add_argument("--slots", type=int, default=32)
    g.add_argument("-k", "--num-draft-tokens", type=int, default=None)
    g.add_argument("--max-context", type=int, default=None, help="default: enough for prompt + output")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--steps-per-sync", type=int, default=None)
    g.add_argument("--prefill-chunk", type=int, default=None)
    g.add_argument("--server-arg", action="append", default=[], help="extra flag for the server (repeatable)")
    g.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for SERVING")
    g = ap.add_argument_group("load")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    g.add_argument("--requests", type=int, default=None, help="requests per level (default 4 x concurrency)")
    g.add_argument("--prompt-tokens", type=int, default=128)
    g.add_argument("--prompt-chars", type=int, default=None, help="text prompts: characters (default 4 x tokens)")
    g.add_argument("--prompt-source", choices=["auto", "random", "text"], default="auto")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    g.add_argument("--warmup-requests", type=int, default=2, help="untimed requests before the first level")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, default=600.0, help="deadline per request, seconds")
    g = ap.add_argument_group("output")
    g.add_argument("--json", default=None, help="write the results here")
    g.add_argument("--label", default=None, help="free text stored in the JSON (e.g. the machine)")
    return ap.parse_args(argv)


# ---- the server --------------------------------------------------------------------------------------------------
class StartedServer:
    def __init__(self, args):
        cmd = [sys.executable, "-m", "jaxmtp.serve", "--port", "0", "--http-port", "0", "--slots", str(args.slots),
               "--dtype", args.dtype, "--max-queue", str(max(1024, 4 * max(args.concurrency)))]
        if args.model:
            cmd += ["--model", args.model]
        if args.random_model:
            cmd += ["--random-model", args.random_model]
        if args.num_draft_tokens is not None:
            cmd += ["-k", str(args.num_draft_tokens)]
        max_context = args.max_context
        if max_context is None:  # room for the prompt (text prompts may take more tokens than characters / 4)
            prompt = args.prompt_tokens if args.prompt_source == "random" else (
                args.prompt_chars or 4 * args.prompt_tokens)
            max_context = 1 << (prompt + args.max_tokens + 16).bit_length()
        cmd += ["--max-context", str(max_context), "--max-new-tokens-limit", str(args.max_tokens)]
        if args.steps_per_sync is not None:
            cmd += ["--steps-per-sync", str(args.steps_per_sync)]
        if args.prefill_chunk is not None:
            cmd += ["--prefill-chunk", str(args.prefill_chunk)]
        cmd += args.server_arg
        self.cmd = cmd
        print("starting:", " ".join(cmd), file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        if not line.startswith("jaxmtp.serve listening on "):
            self.proc.wait(30)
            raise SystemExit(f"the server did not start (exit code {self.proc.returncode}): {line!r}")
        self.address = line.split()[-1]
        self.http_address = None
        if "--no-http" in cmd:  # no second line to wait for
            return
        line = self.proc.stdout.readline()
        if not line.startswith("jaxmtp.serve http listening on "):
            self.stop()
            raise SystemExit(f"the server's HTTP API did not start: {line!r}")
        self.http_address = line.split()[-1]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- prompts -------------------------------------------------------------------------------------------------------
def make_prompts(args, info, n):
    rng = np.random.default_rng(args.seed)
    source = args.prompt_source
    if source == "auto":
        source = "text" if info["has_tokenizer"] else "random"
    if source == "text" and not info["has_tokenizer"]:
        raise SystemExit("--prompt-source text needs a model with a tokenizer")
    if source == "random":
        hi = min(info["vocab_size"], 2**31 - 1)
        eos = set(info["eos_token_ids"])
        out = []
        for _ in range(n):
            ids = rng.integers(0, hi, args.prompt_tokens)
            out.append([int(t) if int(t) not in eos else 0 for t in ids])
        return source, out
    chars = args.prompt_chars or 4 * args.prompt_tokens
    lib = os.path.dirname(os.__file__)
    files = sorted(f for f in glob.glob(os.path.join(lib, "*.py")) if os.path.getsize(f) > 4 * chars)
    out = []
    while len(out) < n:
        with open(files[int(rng.integers(len(files)))], encoding="utf-8", errors="replace") as f:
            text = f.read()
        start = int(rng.integers(0, len(text) - chars))
        start = text.rfind("\n", 0, start) + 1
        out.append(text[start : start + chars])
    return source, out


# ---- one level -----------------------------------------------------------------------------------------------------
async def one_request(stub, pb, prompt, args, timeout):
    from jaxmtp.serving.client import build_request

    req = build_request(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                        ignore_eos=not args.no_ignore_eos, seed=args.seed)
    t0 = time.perf_counter()
    first = last = None
    n = chunks = 0
    done = None
    async for msg in stub.Generate(req, timeout=timeout):
        kind = msg.WhichOneof("response")
        if kind == "chunk" and msg.chunk.token_ids:
            last = time.perf_counter()
            first = first or last
            n += len(msg.chunk.token_ids)
            chunks += 1
        elif kind == "complete":
            done = msg.complete
        elif kind == "error":
            raise RuntimeError(f"{msg.error.code_name}: {msg.error.message}")
    end = time.perf_counter()
    if done is None:
        raise RuntimeError("no complete message")
    return {"ttft": (first - t0) if first else None, "tpot": ((last - first) / (n - 1)) if chunks > 1 else None,
            "latency": end - t0, "tokens": n, "prompt_tokens": done.usage.prompt_tokens}


class HttpConnection:
    """One keep-alive HTTP/1.1 connection that posts JSON and reads server-sent events (chunked transfer encoding)."""

    def __init__(self, address):
        self.host, port = address.rsplit(":", 1)
        self.host = self.host.strip("[]")
        self.port = int(port)
        self.reader = self.writer = None

    async def events(self, path, body):
        """Yields each event's data (parsed JSON) until ``[DONE]``; raises on an HTTP error."""
        data = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(data)}\r\n\r\n").encode() + data
        for attempt in (0, 1):  # the server closes a keep-alive connection idle for 5 s: then reconnect once
            if self.writer is None or self.reader.at_eof():
                await self.close()
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.write(request)
            line = await self.reader.readline()
            if line or attempt:
                break
            self.reader = None
            await self.close()
        status = int(line.split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if "chunked" not in headers.get("transfer-encoding", ""):
            payload = await self.reader.readexactly(int(headers.get("content-length", 0)))
            raise RuntimeError(f"HTTP {status}: {payload.decode(errors='replace')}")
        buf = b""
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                break
            buf += chunk[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    if event == b"data: [DONE]":
                        continue
                    yield json.loads(event[6:])

    async def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def one_request_http(conn, model, prompt, args):
    body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "ignore_eos": not args.no_ignore_eos, "seed": args.seed, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    t0 = time.perf_counter()
    first = last = None
    n = chunks = 0
    usage = None
    async for event in conn.events("/v1/completions", body):
        if "error" in event:
            raise RuntimeError(f"{event['error']['type']}: {event['error']['message']}")
        usage = event.get("usage") or usage
        if event["choices"] and usage and usage["completion_tokens"] > n:
            last = time.perf_counter()
            first = first or last
            n = usage["completion_tokens"]
            chunks += 1
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError("no usage in the stream")
    return {"ttft": (first - t0) if first else None, "tpot": ((last - first) / (n - 1)) if chunks > 1 else None,
            "latency": end - t0, "tokens": n, "prompt_tokens": usage["prompt_tokens"]}


async def run_level(address, http_address, model, pb, prompts, concurrency, total, args):
    """``total`` requests from ``concurrency`` clients; request i goes over ``args.protocol[i % n]`` with prompt
    ``i // n``, so that with both protocols consecutive requests differ only in the protocol."""
    import grpc

    protocols = args.protocol
    results, errors = [], []
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                           ("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb.GenerationStub(ch)
        counter = iter(range(total))

        async def worker():
            conn = HttpConnection(http_address) if "http" in protocols else None
            try:
                for i in counter:
                    proto = protocols[i % len(protocols)]
                    prompt = prompts[(i // len(protocols)) % len(prompts)]
                    try:
                        if proto == "grpc":
                            r = await one_request(stub, pb, prompt, args, args.timeout)
                        else:
                            r = await asyncio.wait_for(one_request_http(conn, model, prompt, args), args.timeout)
                        results.append({**r, "protocol": proto})
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        errors.append(f"{proto}: {e!r}")
                        if proto == "http":
                            await conn.close()
                            conn = HttpConnection(http_address)
            finally:
                if conn is not None:
                    await conn.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, errors, wall


def pct(values, scale=1e3):
    v = np.asarray([x for x in values if x is not None], np.float64) * scale
    if v.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99)), "mean": float(v.mean())}


def spec_delta(before, after):
    steps = after["steps"] - before["steps"]
    acc = after["accepted"] - before["accepted"]
    per = [(a - b) / steps if steps else 0.0
           for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
    return {"k": after["k"], "request_verify_steps": steps, "accepted": acc,  # summed over requests
            "mean_acceptance_length": (steps + acc) / steps if steps else 0.0, "acceptance_per_position": per}


def table(levels):
    head = (f"{'conc':>4} {'reqs':>5} {'err':>3} {'tok/s':>8} {'req/s':>6} | {'TTFT p50':>8} {'p90':>7} {'p99':>7} "
            f"| {'TPOT p50':>8} {'p90':>7} {'p99':>7} | {'lat p50':>8} {'p99':>8} | {'AL':>4}")
    rows = [head, "-" * len(head)]
    f = lambda x: f"{x:7.1f}" if x is not None else "      -"  # noqa: E731
    for lv in levels:
        rows.append(f"{lv['concurrency']:>4} {lv['requests']:>5} {lv['errors']:>3} {lv['output_tokens_per_s']:8.1f} "
                    f"{lv['requests_per_s']:6.2f} | {f(lv['ttft_ms']['p50']):>8} {f(lv['ttft_ms']['p90'])} "
                    f"{f(lv['ttft_ms']['p99'])} | {f(lv['tpot_ms']['p50']):>8} {f(lv['tpot_ms']['p90'])} "
                    f"{f(lv['tpot_ms']['p99'])} | {f(lv['latency_ms']['p50']):>8} {f(lv['latency_ms']['p99']):>8} "
                    f"| {lv['spec']['mean_acceptance_length']:4.2f}")
        for proto, b in lv.get("by_protocol", {}).items():
            rows.append(f"{'':>4} {b['requests']:>5} {proto:>12} {'':>6} | {f(b['ttft_ms']['p50']):>8} "
                        f"{f(b['ttft_ms']['p90'])} {f(b['ttft_ms']['p99'])} | {f(b['tpot_ms']['p50']):>8} "
                        f"{f(b['tpot_ms']['p90'])} {f(b['tpot_ms']['p99'])} | {f(b['latency_ms']['p50']):>8} "
                        f"{f(b['latency_ms']['p99']):>8} |")
    return "\n".join(rows) + "\n(ms; tok/s = output tokens per second over the level; AL = mean acceptance length)"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.address and (args.model or args.random_model):
        raise SystemExit("give either --address or a model to start, not both")
    if args.prompt_source == "auto" and args.random_model:
        args.prompt_source = "random"
    from jaxmtp.serving import protocol as pb
    from jaxmtp.serving.client import Client

    args.protocol = list(dict.fromkeys(args.protocol))
    if "http" in args.protocol and args.address and not args.http_address:
        raise SystemExit("--protocol http with --address needs --http-address (the server's HTTP host:port)")
    if "http" in args.protocol and "--no-http" in args.server_arg:
        raise SystemExit("--protocol http needs the server's HTTP API (drop --server-arg=--no-http)")
    server = None if args.address else StartedServer(args)
    address = args.address or server.address
    http_address = args.http_address or (server.http_address if server is not None else None)

    def level(prompts, concurrency, total):
        return asyncio.run(run_level(address, http_address, info["model_name"], pb, prompts, concurrency, total,
                                     args))
    try:
        with Client(address, timeout=120) as c:
            c.wait_ready(timeout=args.startup_timeout)
            info = c.model_info()
            n_prompts = max(args.requests or 0, 4 * max(args.concurrency), args.warmup_requests)
            source, prompts = make_prompts(args, info, n_prompts)
            print(f"model {info['model_name']} ({info['num_parameters'] / 1e9:.3g} B, {info['dtype']}, "
                  f"{info['backend']}), {info['num_slots']} slots, k={info['num_draft_tokens']}, "
                  f"context {info['max_context']}; prompts: {source}", file=sys.stderr, flush=True)
            if args.warmup_requests:
                level(prompts, min(args.warmup_requests, info["num_slots"]), args.warmup_requests)
            levels = []
            for conc in args.concurrency:
                total = args.requests or 4 * conc
                before = c.stats()
                results, errors, wall = level(prompts, conc, total)
                after = c.stats()
                toks = sum(r["tokens"] for r in results)
                lv = {
                    "concurrency": conc, "requests": len(results), "errors": len(errors), "wall_s": wall,
                    "output_tokens": toks, "output_tokens_per_s": toks / wall if wall else 0.0,
                    "requests_per_s": len(results) / wall if wall else 0.0,
                    "mean_prompt_tokens": float(np.mean([r["prompt_tokens"] for r in results])) if results else 0,
                    "ttft_ms": pct(r["ttft"] for r in results), "tpot_ms": pct(r["tpot"] for r in results),
                    "latency_ms": pct(r["latency"] for r in results),
                    "engine_steps": after["engine_steps"] - before["engine_steps"],
                    "spec": spec_delta(before["spec"], after["spec"]),
                    "first_errors": errors[:3],
                }
                if len(args.protocol) > 1:
                    lv["by_protocol"] = {p: {"requests": len(rs), "ttft_ms": pct(r["ttft"] for r in rs),
                                             "tpot_ms": pct(r["tpot"] for r in rs),
                                             "latency_ms": pct(r["latency"] for r in rs)}
                                         for p in args.protocol
                                         for rs in [[r for r in results if r["protocol"] == p]]}
                levels.append(lv)
                print(f"concurrency {conc}: {len(results)} requests, {lv['output_tokens_per_s']:.1f} tok/s, "
                      f"TTFT p50 {lv['ttft_ms']['p50'] or 0:.1f} ms, TPOT p50 {lv['tpot_ms']['p50'] or 0:.2f} ms"
                      + (f", {len(errors)} errors: {errors[:1]}" if errors else ""), file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
    report = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.relpath(sys.argv[0]) if argv is None else "scripts/bench_serve.py"]
                            + (sys.argv[1:] if argv is None else list(argv))),
        "server_command": server.cmd if server is not None else None,
        "label": args.label,
        "address": address,
        "protocol": args.protocol,
        "http_address": http_address if "http" in args.protocol else None,
        "model": info,
        "load": {"prompt_source": source, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                 "temperature": args.temperature, "ignore_eos": not args.no_ignore_eos},
        "levels": levels,
    }
    print(table(levels))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if any(lv["errors"] for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
