"""``python -m jaxmtp.client "prompt"``: stream a generation from a running ``python -m jaxmtp.serve``.

    python -m jaxmtp.client "def fibonacci(n):" --max-tokens 64
    python -m jaxmtp.client "import os" --temperature 0.8 --seed 1 --stop "\\n\\n" --port 50052
    python -m jaxmtp.client --token-ids 1,2,3 --max-tokens 16      # models without a tokenizer
    python -m jaxmtp.client "x =" --repetition-penalty 1.2 --logit-bias 7=-100 --logprobs 3
    python -m jaxmtp.client "def f(" --temperature 0.8 --seed 1 -n 3   # three samples (seeds 1, 2, 3)
    python -m jaxmtp.client --info                                  # model info, server stats, health

The text streams to stdout as it is accepted (with ``-n`` above 1, each sample is printed when all have finished,
under a ``--- sample i ---`` line); ``--logprobs`` N adds, after the text, a table of every output token's id and
log-probability with the N most likely alternatives; a summary (finish reason, usage, acceptance) goes to stderr.
The Python API is :class:`jaxmtp.serving.client.Client`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


DEFAULT_WAIT = 600.0


class WaitProgress:
    """Prints, on stderr, what a server that is not SERVING yet is doing: one line when it changes (or every
    ``every`` seconds)."""

    def __init__(self, address: str, stream=None, every: float = 10.0):
        self.address, self.stream, self.every = address, stream or sys.stderr, every
        self.t0 = time.monotonic()
        self._last, self._last_t = None, 0.0

    def __call__(self, info) -> None:
        waited = time.monotonic() - self.t0
        if info is None:
            msg = f"waiting for the server at {self.address} to start"
        else:
            done, planned = info.get("warmup_done", 0), info.get("warmup_planned", 0)
            if planned:
                msg = f"the server is warming up: compiled {done} of {planned} executables"
            else:
                msg = "the server is starting its warm-up"
        now = time.monotonic()
        if msg != self._last or now - self._last_t >= self.every:
            self.stream.write(f"[{waited:5.1f} s] {msg}\n")
            self.stream.flush()
            self._last, self._last_t = msg, now


def _bias(text: str) -> tuple[int, float]:
    """``ID=VALUE`` (a --logit-bias entry)."""
    key, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(key), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=VALUE (e.g. 7=-100), got {text!r}") from None


def format_logprobs(entries) -> str:
    """A table of :class:`jaxmtp.serving.client.TokenLogprob` s: position, token id, log-probability (and
    probability), then the alternatives as ``id:logprob``."""
    lines = [f"{'pos':>4}  {'token id':>8}  {'logprob':>9}  {'prob':>6}  top alternatives (id:logprob)"]
    for i, e in enumerate(entries):
        top = ", ".join(f"{t}:{v:.3f}" for t, v in e.top)
        prob = math.exp(e.logprob) if e.logprob > -1e4 else 0.0
        lines.append(f"{i:>4}  {e.token_id:>8}  {e.logprob:>9.4f}  {prob:>6.1%}  {top}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxmtp.client",
                                 description="Stream a generation from a jaxmtp gRPC server.")
    ap.add_argument("prompt", nargs="?", default=None, help="prompt text")
    ap.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    ap.add_argument("--address", default=None, help="host:port (overrides --host/--port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: the server's default")
    ap.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    ap.add_argument("--stop-token-id", type=int, action="append", default=None, help="stop token id (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--min-p", type=float, default=None, help="drop ids below MIN_P x the top probability")
    ap.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]")
    ap.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2]")
    ap.add_argument("--repetition-penalty", type=float, default=None, help="> 0 (1: off)")
    ap.add_argument("--min-tokens", type=int, default=0, help="no EOS / stop before this many tokens")
    ap.add_argument("--logit-bias", type=_bias, action="append", default=None, metavar="ID=VALUE",
                    help="add VALUE (in [-100, 100]) to token ID's logit (repeatable)")
    ap.add_argument("--logprobs", type=int, default=None, metavar="N",
                    help="print each output token's log-probability and the N most likely alternatives")
    ap.add_argument("-n", "--n", type=int, default=None, dest="n", help="samples of the prompt (seed + i each)")
    ap.add_argument("--request-id", default=None)
    ap.add_argument("--timeout", type=float, default=None, help="deadline of the request in seconds")
    ap.add_argument("--wait", type=float, default=DEFAULT_WAIT,
                    help="seconds to wait for the server to start and warm up (SERVING), showing its warm-up "
                         f"progress on stderr (default {DEFAULT_WAIT:.0f}: a first start's compile on a small CPU; "
                         "0: do not wait)")
    ap.add_argument("--api-key", default=None, help="the server's --api-key (default: $JAXMTP_API_KEY)")
    ap.add_argument("--ssl-ca-certfile", default=None,
                    help="connect with TLS, trusting this PEM certificate (default: $JAXMTP_SSL_CA_CERTFILE)")
    ap.add_argument("--quiet", action="store_true", help="no warm-up progress and no summary on stderr")
    ap.add_argument("--info", action="store_true", help="print model info, server stats and health as JSON, exit")
    ap.add_argument("--no-echo", action="store_true", help="do not print the prompt before the output")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jaxmtp.serving.client import Client, GenerationError

    address = args.address or (f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}")
    with Client(address, api_key=args.api_key, ssl_ca_certfile=args.ssl_ca_certfile) as client:
        try:
            if args.wait > 0:
                client.wait_ready(timeout=args.wait, on_progress=None if args.quiet else WaitProgress(address))
            if args.info:
                print(json.dumps({"model": client.model_info(), "stats": client.stats(), "health": client.health()},
                                 indent=1))
                return 0
            if args.token_ids is not None:
                prompt = [int(t) for t in args.token_ids.replace(" ", "").split(",") if t]
            elif args.prompt is not None:
                prompt = args.prompt
            else:
                print("error: give a prompt (or --token-ids, or --info)", file=sys.stderr)
                return 2
            t0 = time.perf_counter()
            stream = client.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                   top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                                   stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
                                   min_p=args.min_p, presence_penalty=args.presence_penalty,
                                   frequency_penalty=args.frequency_penalty,
                                   repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
                                   logit_bias=dict(args.logit_bias) if args.logit_bias else None,
                                   logprobs=args.logprobs, n=args.n, request_id=args.request_id,
                                   timeout=args.timeout)
            echo = prompt if isinstance(prompt, str) and not args.no_echo else ""
            several = stream.n > 1
            if not several:
                sys.stdout.write(echo)
            try:
                for chunk in stream:
                    if not several:
                        sys.stdout.write(_shown(chunk.text, chunk.token_ids, prompt))
                        sys.stdout.flush()
            except KeyboardInterrupt:
                stream.cancel()
                print("\n[cancelled]", file=sys.stderr)
                return 130
        except GenerationError as e:
            print(f"\nerror: {e.code.name}: {e.message}", file=sys.stderr)
            return 1
    wall = time.perf_counter() - t0
    done = stream.completions
    for c in done:
        if several:
            sys.stdout.write(("\n" if c.index else "") + f"--- sample {c.index} ---\n" + echo
                             + _shown(c.text, c.token_ids, prompt))
        if c.logprobs is not None:
            sys.stdout.write("\n\n" + format_logprobs(c.logprobs) + "\n")
    sys.stdout.flush()
    if args.quiet:
        print()
        return 0
    lines = []
    for c in done:
        rate = "" if several else f", {c.completion_tokens / wall:.1f} tokens/s"
        lines.append(f"[{f'sample {c.index}: ' if several else ''}{c.completion_tokens} tokens, "
                     f"finish={c.finish_reason}, prompt {c.prompt_tokens} tokens, seed {c.seed}, k={c.spec['k']}, "
                     f"mean acceptance length {c.spec['mean_acceptance_length']:.2f}, acceptance per position "
                     f"{[round(a, 2) for a in c.spec['acceptance_per_position']]}, "
                     f"TTFT {c.time_to_first_token * 1e3:.0f} ms{rate}]")
    if several:
        total = sum(c.completion_tokens for c in done)
        lines.append(f"[{len(done)} samples, {total} tokens, {total / wall:.1f} tokens/s]")
    print("\n\n" + "\n".join(lines), file=sys.stderr)
    return 0


def _shown(text: str, token_ids, prompt) -> str:
    """What stdout shows of an output: its text, or its ids for a model without a tokenizer (id prompts)."""
    return text if text or isinstance(prompt, str) else " ".join(map(str, token_ids)) + " "


if __name__ == "__main__":
    sys.exit(main())
