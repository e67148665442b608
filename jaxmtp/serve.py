"""``python -m jaxmtp.serve``: the gRPC server (``jaxmtp.v1.Generation`` + ``grpc.health.v1.Health``).

    python -m jaxmtp.serve                                 # the embedded default model on 127.0.0.1:50051
    python -m jaxmtp.serve --model /path/to/Qwen3.5-0.8B --dtype bfloat16 --slots 32 --port 0
    python -m jaxmtp.serve --random-model qwen3.5-0.8b     # random weights of real shapes (benchmarks)

Start-up: load the model, build the engine (refusing settings that do not fit in memory), log the configuration and
the memory plan, bind (printing ``jaxmtp.serve listening on HOST:PORT`` on stdout; ``--port 0`` picks a free
port), warm up (compile every device function; health NOT_SERVING meanwhile), then report SERVING. SIGTERM or SIGINT
drains: NOT_SERVING, new requests get UNAVAILABLE, in-flight ones finish within ``--drain-grace`` seconds (then
they are aborted), exit 0. A second signal skips the rest of the grace period. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

log = logging.getLogger("jaxmtp.serve")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxmtp.serve", description="Serve a Qwen3.5 model over gRPC with "
                                 "MTP speculative decoding and continuous batching (docs/serving.md).")
    g = ap.add_argument_group("model")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint directory (HF or native jaxmtp); default: the "
                     "embedded default model")
    src.add_argument("--random-model", default=None, metavar="PRESET",
                     help="serve random weights of a preset's shapes instead (qwen3.5-0.8b, tiny); token-id prompts "
                     "only; for benchmarks")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights and activations; auto: float32 on CPU, bfloat16 on accelerators")
    g.add_argument("--backend", default="auto", help="kernels: auto or xla (jaxmtp.pallas.resolve_backend)")
    g.add_argument("--exact-draft-head", dest="int8_draft_head", action="store_false",
                   help="draft with the bf16 LM head and MTP layer instead of their quantised copies (outputs are the "
                        "same either way; the copies cut what each draft reads: the head to a quarter (int4) or half "
                        "(int8), the MTP layer (int8, on GPUs for hidden sizes <= 2560) to half)")
    g.add_argument("--draft-head-bits", type=int, default=None, choices=[8, 4],
                   help="quantisation of the drafts' copy of the LM head (default 4 on a GPU where the hidden size is "
                        "a multiple of 128, else 8): 8 drafts a little closer to the exact head, 4 reads half the bytes "
                        "(outputs are the same; docs/performance.md run 10)")
    g.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="draft only among these token ids (.json list, .npy or whitespace-separated text; build one "
                        "with scripts/build_draft_vocab.py): each draft reads N rows of the head instead of the whole "
                        "vocabulary; outputs are the same, acceptance can drop (docs/performance.md)")
    g.add_argument("--served-model-name", default=None, help="the name requests may give in their model field "
                   "(default: the checkpoint directory's name, 'jaxmtp-default' for the embedded model)")
    g = ap.add_argument_group("network")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=50051, help="port (0: pick a free one; it is printed)")
    g = ap.add_argument_group("engine")
    g.add_argument("--slots", type=int, default=8, help="requests decoded concurrently (engine slots)")
    g.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="MTP draft tokens per verify step for every request (default 3 with an MTP head, else 0)")
    g.add_argument("--max-context", type=int, default=None,
                   help="tokens per request, prompt + output (default min(8192, the model's maximum))")
    g.add_argument("--prefill-chunk", type=int, default=256, help="largest prompt chunk per prefill call")
    g.add_argument("--steps-per-sync", type=int, default=8, help="speculative steps per device loop")
    g.add_argument("--max-prefill-batch", type=int, default=None, help="prompts prefilled together")
    g.add_argument("--no-slot-buckets", dest="slot_buckets", action="store_false",
                   help="always step every slot (default: the smallest power-of-two prefix of slots holding every "
                        "busy one; warm-up compiles one step per prefix size)")
    g.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache directory (faster restarts)")
    g = ap.add_argument_group("limits")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a slot; past it requests get RESOURCE_EXHAUSTED")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="default: max context - 1")
    g.add_argument("--max-new-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: the max context)")
    g.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of requests that leave it unset")
    g.add_argument("--max-message-bytes", type=int, default=4 << 20, help="largest request message")
    g.add_argument("--max-request-seconds", type=float, default=None,
                   help="server-side time limit per request (DEADLINE_EXCEEDED); client deadlines always apply")
    g.add_argument("--drain-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return ap


def _config_from_args(args):
    from jaxmtp.serving.server import ServerConfig

    return ServerConfig(
        host=args.host, port=args.port, num_slots=args.slots, max_context=args.max_context,
        num_draft_tokens=args.num_draft_tokens, prefill_chunk=args.prefill_chunk, steps_per_sync=args.steps_per_sync,
        max_prefill_batch=args.max_prefill_batch, slot_buckets=args.slot_buckets, max_queue=args.max_queue,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens_limit=args.max_new_tokens_limit, default_max_tokens=args.default_max_tokens,
        max_message_bytes=args.max_message_bytes, max_request_seconds=args.max_request_seconds,
        drain_grace=args.drain_grace, served_model_name=args.served_model_name)


def load_model(args):
    import jax

    import jaxmtp

    dtype = args.dtype if args.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    if args.random_model:
        from jaxmtp.serving.random_model import random_model

        if args.draft_vocab is not None:
            raise ValueError("--draft-vocab takes a checkpoint's token ids; it does not apply to --random-model")
        return random_model(args.random_model, dtype=dtype, backend=args.backend,
                            int8_draft_head=args.int8_draft_head, draft_head_bits=args.draft_head_bits)
    return jaxmtp.load(args.model, dtype=dtype, backend=args.backend, progress=False,
                       int8_draft_head=args.int8_draft_head, draft_vocab=args.draft_vocab,
                       draft_head_bits=args.draft_head_bits)


async def serve(args) -> int:
    from jaxmtp.serving import protocol as pb
    from jaxmtp.serving.server import GenerationServer

    config = _config_from_args(args)
    config.validate()
    model = load_model(args)
    server = GenerationServer(model, config)
    e = server.engine
    info = server.model_info()
    log.info("model %s (%s, %d layers, hidden %d, vocab %d, %.3g B parameters, %s) from %s", info.model_name,
             info.family, info.num_hidden_layers, info.hidden_size, info.vocab_size, info.num_parameters / 1e9,
             info.dtype, info.model_path or "-")
    log.info("engine: %d slots x %d tokens of context, k=%d draft tokens, prefill chunk %d, %d steps per sync, "
             "slot buckets %s, backend %s", e.num_slots, e.max_context, e.k, e.prefill_chunk, e.steps_per_sync,
             e.slot_buckets, info.backend)
    if e.k:
        from jaxmtp.model import describe_draft_head

        log.info("drafts: %s", describe_draft_head(model.params, model.config.vocab_size))
    log.info("limits: queue %d, prompt %d tokens, max_tokens <= %d (default %d), messages <= %d bytes, request "
             "time %s, drain grace %.1f s", config.max_queue, server.max_prompt_tokens, server.max_new_tokens_limit,
             server.default_max_tokens, config.max_message_bytes,
             f"<= {config.max_request_seconds} s" if config.max_request_seconds else "unlimited", config.drain_grace)
    log.info("memory plan:\n%s", e.plan.table())

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = {"count": 0}

    def on_signal(signame):
        signals["count"] += 1
        if signals["count"] == 1:
            log.info("%s: draining (NOT_SERVING; in-flight requests get %.1f s)", signame, config.drain_grace)
            server.draining = True
            server.health.set(pb.NOT_SERVING)
            stop.set()
        else:
            log.info("%s again: aborting in-flight requests", signame)
            server.scheduler.abort_all("shutdown")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)

    port = await server.start()
    host = config.host if ":" not in config.host else f"[{config.host}]"
    print(f"jaxmtp.serve listening on {host}:{port}", flush=True)
    log.info("listening on %s:%d (health NOT_SERVING until warmed up)", host, port)

    code = 0
    warm = asyncio.ensure_future(server.warmup())
    stopper = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(server.failed.wait())
    await asyncio.wait({warm, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if warm.done():
        seconds = warm.result()  # raises if the warm-up failed
        if not stop.is_set():
            log.info("warmed up in %.1f s: SERVING", seconds)
        await asyncio.wait({stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
        if failed.done() and not stop.is_set():
            log.error("the engine failed (see above): shutting down so that a supervisor can restart the server")
            code = 1
        cut = await server.drain()
        if cut:
            log.warning("%d request(s) were cut off by the drain grace period", cut)
    else:
        log.info("stopping during warm-up")
    failed.cancel()
    stopper.cancel()
    await server.stop()
    log.info("stopped")
    if not warm.done():  # the compile in the warm-up thread cannot be interrupted: leave without joining it
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    return code


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "DEBUG":
        logging.getLogger("jax").setLevel(logging.WARNING)  # e.g. its INFO line about absent TPU backends
    if args.compilation_cache_dir:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from jaxmtp.engine import EngineConfigError

    try:
        return asyncio.run(serve(args))
    except (EngineConfigError, ValueError, FileNotFoundError, OSError) as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
