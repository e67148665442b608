#!/usr/bin/env python
"""A victim's latency beside an adversarial neighbour: does one request stall the others?

Starts a server in this process (default: the embedded model, ``--dtype auto``) and times a short greedy request
(the victim: ``--victim-tokens`` tokens, ``ignore_eos``) in three settings, ``--repeats`` times each:

* ``alone``: nothing else runs;
* ``plain_neighbour``: beside a long request (``--neighbour-tokens``, ``ignore_eos``) without stop strings;
* ``adversarial_neighbour``: beside the same long request carrying ``--stop-count`` stop strings of
  ``--stop-bytes`` bytes together (default: the server's limits, 64 and 16,384), built so that a long tail of its
  output is always a prefix of some stop string (the most text held back and re-examined).

The three settings alternate round by round (so that a slower or busier spell of the machine hits all three), the
server compiles everything before the first round, and each neighbour is started afresh for each victim and aborted
after it; the time from the Abort call to the end of its stream is recorded too. Prints a summary and writes
``--json`` (latencies in seconds, ratios of medians to ``alone``).

    python scripts/bench_adversarial.py --json runs/bench_adversarial_cpu.json
    python scripts/bench_adversarial.py --stop-count 1000 --stop-bytes 4000000   # the limits refuse this one
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time


def _stops(count: int, total_bytes: int) -> list[str]:
    """``count`` distinct stop strings of ``total_bytes`` ASCII bytes together, each a run of spaces (which code
    output is full of) closed by a character the model never writes, so that no string ever completes."""
    each = max(2, total_bytes // count)
    return [" " * (each - len(str(i)) - 1) + "\x07" + str(i) for i in range(count)]


class _Neighbour:
    """A long streaming request in a thread; ``abort()`` aborts it and returns how long its stream took to end."""

    def __init__(self, client, tokens: int, stop: list[str] | None, rid: str):
        self.client, self.rid = client, rid
        self.error: Exception | None = None
        self.started = threading.Event()
        self.ended = threading.Event()
        self.finish_reason = None
        self.tokens = 0
        self._stream = client.stream("def main():\n", max_tokens=tokens, ignore_eos=True, stop=stop, request_id=rid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            for chunk in self._stream:
                self.tokens += len(chunk.token_ids)
                self.started.set()
            self.finish_reason = self._stream.completion.finish_reason
        except Exception as e:  # noqa: BLE001 - reported in the results
            self.error = e
        finally:
            self.started.set()
            self.ended.set()

    def abort(self) -> float:
        t0 = time.perf_counter()
        self.client.abort(self.rid)
        self.ended.wait(120)
        return time.perf_counter() - t0


def _summary(xs: list[float]) -> dict:
    return {"p50": statistics.median(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def run(args) -> dict:
    import jax

    import jaxmtp
    from jaxmtp.serving.client import Client, GenerationError
    from jaxmtp.serving.server import ServerConfig, ServerThread

    import dataclasses

    model = jaxmtp.load(args.model, dtype=args.dtype, progress=False)
    extra = {"background_compile": False} if "background_compile" in {
        f.name for f in dataclasses.fields(ServerConfig)} else {}  # every compile before the first round
    cfg = ServerConfig(port=0, num_slots=args.slots, max_context=args.max_context, **extra)
    stops = _stops(args.stop_count, args.stop_bytes)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
               "device": f"{jax.default_backend()} ({platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start)",
               "model": model.path, "dtype": str(model.dtype), "slots": args.slots,
               "victim_tokens": args.victim_tokens, "neighbour_tokens": args.neighbour_tokens,
               "stop_count": len(stops), "stop_bytes": sum(len(s) for s in stops), "settings": {}}
    settings = {"alone": None, "plain_neighbour": [], "adversarial_neighbour": stops}
    lat = {name: [] for name in settings}
    aborts = {name: [] for name in settings}
    overlap = {name: True for name in settings}
    refused = {}
    with ServerThread(model, cfg) as srv, Client(srv.address, timeout=600) as client:
        prompt = "def fibonacci(n):"
        for _ in range(2):  # warm the host paths too
            client.generate(prompt, max_tokens=args.victim_tokens, ignore_eos=True)

        def victim() -> float:
            t0 = time.perf_counter()
            out = client.generate(prompt, max_tokens=args.victim_tokens, ignore_eos=True)
            assert out.completion_tokens == args.victim_tokens
            return time.perf_counter() - t0

        for r in range(args.repeats):
            names = list(settings)
            for name in names[r % 3:] + names[: r % 3]:
                stop = settings[name]
                if name in refused:
                    continue
                nb = None
                if stop is not None:
                    try:
                        nb = _Neighbour(client, args.neighbour_tokens, stop or None, f"{name}-{r}")
                        nb.started.wait(300)
                        if nb.error is not None:
                            raise nb.error
                    except GenerationError as e:
                        refused[name] = f"{e.code.name}: {e.message}"
                        continue
                lat[name].append(victim())
                if nb is not None:
                    overlap[name] &= not nb.ended.is_set()  # the neighbour still decoding when the victim ended
                    aborts[name].append(nb.abort())
    for name in settings:
        entry = {"victim_latency_s": _summary(lat[name]) if lat[name] else None,
                 "neighbour_running_throughout": overlap[name]}
        if aborts[name]:
            entry["abort_to_stream_end_s"] = _summary(aborts[name])
        if name in refused:
            entry["neighbour_refused"] = refused[name]
        results["settings"][name] = entry
    alone = results["settings"]["alone"]["victim_latency_s"]["p50"]
    plain = results["settings"]["plain_neighbour"]["victim_latency_s"]
    for name, entry in results["settings"].items():
        if entry["victim_latency_s"]:
            entry["p50_over_alone"] = entry["victim_latency_s"]["p50"] / alone
            if name == "adversarial_neighbour" and plain:  # what the stop strings themselves cost the victim
                entry["p50_over_plain_neighbour"] = entry["victim_latency_s"]["p50"] / plain["p50"]
    return results


def main(argv=None) -> int:
    from jaxmtp.engine.text import MAX_STOP_BYTES, MAX_STOP_STRINGS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--victim-tokens", type=int, default=64)
    ap.add_argument("--neighbour-tokens", type=int, default=3000)
    ap.add_argument("--stop-count", type=int, default=MAX_STOP_STRINGS)
    ap.add_argument("--stop-bytes", type=int, default=MAX_STOP_BYTES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    results = run(args)
    for name, e in results["settings"].items():
        lat = e["victim_latency_s"]
        line = f"{name:>22}: -"
        if lat:
            line = f"{name:>22}: victim p50 {lat['p50']:.3f} s (x{e['p50_over_alone']:.2f} alone"
            line += f", x{e['p50_over_plain_neighbour']:.2f} plain)" if "p50_over_plain_neighbour" in e else ")"
        if "abort_to_stream_end_s" in e:
            line += f", abort -> stream end p50 {e['abort_to_stream_end_s']['p50'] * 1e3:.0f} ms"
        if not e["neighbour_running_throughout"]:
            line += " (the neighbour ended early: raise --neighbour-tokens)"
        if "neighbour_refused" in e:
            line += f" [neighbour refused: {e['neighbour_refused'][:100]}]"
        print(line)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
