"""``python -m jaxmtp.serve``: the gRPC server (``jaxmtp.v1.Generation`` + ``grpc.health.v1.Health``) and, on the
same engine, the OpenAI-compatible HTTP API (:mod:`jaxmtp.serving.http_api`; ``--http-port``, ``--no-http``).

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
import importlib
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
    g.add_argument("--kernel-override", default="", metavar="SPEC",
                   help="for debugging and side-by-side benchmarks: kernel choices or kernel-policy fields set over "
                        "--backend, 'name=value,...' (jaxmtp.pallas.override_backend), e.g. "
                        "attention_mosaic_min_tokens=none runs prefill attention on the Triton kernel on Hopper")
    g.add_argument("--exact-draft-head", dest="int8_draft_head", action="store_false",
                   help="draft with the bf16 LM head and MTP layer instead of their quantised copies (outputs are the "
                        "same either way; the copies cut what each draft reads: the head to a quarter (int4) or half "
                        "(int8), the MTP layer (int8, on GPUs for hidden sizes <= 2560) to half)")
    g.add_argument("--draft-head-bits", type=int, default=None, choices=[8, 4],
                   help="quantisation of the drafts' copy of the LM head (default 4 on a GPU where the hidden size is "
                        "a multiple of 128, else 8): 8 drafts a little closer to the exact head, 4 reads half the bytes "
                        "(outputs are the same; docs/performance.md, \"Draft head quantisation\")")
    g.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="draft only among these token ids (.json list, .npy or whitespace-separated text; build one "
                        "with scripts/build_draft_vocab.py): each draft reads N rows of the head instead of the whole "
                        "vocabulary; outputs are the same, acceptance can drop (docs/performance.md)")
    g.add_argument("-q", "--quantization", default=None, choices=["fp8"],
                   help="quantise a floating checkpoint's projections to block FP8 on load (the official FP8 "
                        "checkpoints' layout; half the bytes per decode step). FP8 checkpoints load as FP8 without it")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N devices, taken in order: heads, MLP widths and MoE experts per device "
                        "(docs/engine.md, Parallelism)")
    g.add_argument("-dp", "--data-parallel-size", type=int, default=1, metavar="M",
                   help="M replicas of the tensor-parallel group, each with an equal share of the slots "
                        "(--slots must be a multiple of M)")
    # the modes of jaxmtp.pallas.collectives.REDUCE_MODES, spelled out: the parser imports no JAX (a fast --help)
    g.add_argument("--tensor-parallel-reduce", default="auto", choices=["auto", "psum", "oneshot", "fixed"],
                   help="how -tp ranks sum their partial products: psum (XLA's all-reduce), oneshot (a one-shot "
                        "kernel in the step's stream for decode and verify rows; CUDA with jax_triton: pip install "
                        "'jaxmtp[gpu]'), fixed (one fixed order, the same bits at every -tp; slower; for debugging); "
                        "auto: oneshot at -tp 2 or 4 without -dp where it can run, else psum")
    g.add_argument("--served-model-name", default=None, help="the name requests may give in their model field "
                   "(default: the checkpoint directory's name, 'jaxmtp-default' for the embedded model)")
    g = ap.add_argument_group("network")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=50051, help="port (0: pick a free one; it is printed)")
    g.add_argument("--http-port", type=int, default=None,
                   help="port of the OpenAI-compatible HTTP API on the same host (default 8000, or a free one when "
                        "--port is 0; 0: pick a free one); it is printed")
    g.add_argument("--no-http", dest="http", action="store_false", help="serve gRPC only")
    g.add_argument("--api-key", default=os.environ.get("JAXMTP_API_KEY"),
                   help="require the metadata 'authorization: Bearer KEY' on every call but health checks "
                        "(UNAUTHENTICATED otherwise); default: the JAXMTP_API_KEY environment variable")
    g.add_argument("--ssl-certfile", default=None, help="serve TLS with this PEM certificate (chain)")
    g.add_argument("--ssl-keyfile", default=None, help="the PEM private key of --ssl-certfile")
    g = ap.add_argument_group("engine")
    g.add_argument("--slots", type=int, default=8, help="requests decoded concurrently (engine slots)")
    g.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                   help="MTP draft tokens per verify step for every request (default 3 with an MTP head, else 0)")
    g.add_argument("--max-context", type=int, default=None,
                   help="tokens per request, prompt + output (default min(8192, the model's maximum))")
    g.add_argument("--prefill-chunk", type=int, default=None,
                   help="largest prompt chunk per prefill call, a power of two (default 1024 on a GPU or TPU, 256 on "
                        "the CPU)")
    g.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="most tokens (rows x chunk) in one prefill call: several prompts prefilled together take "
                        "shorter chunks; below the default chunk it lowers that chunk (default 2048, or one whole "
                        "--prefill-chunk if larger)")
    g.add_argument("--steps-per-sync", type=int, default=8, help="speculative steps per device loop")
    g.add_argument("--max-prefill-batch", type=int, default=None,
                   help="prompts prefilled together (per data-parallel replica)")
    g.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="prefix_caching",
                   action="store_false", help="turn the prefix cache off (default on: a prompt that begins with an "
                   "earlier prompt's prefix resumes after it, same tokens; docs/engine.md, \"Prefix caching\")")
    g.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--prefix-cache-memory", type=bytes_or_auto, default="auto", metavar="BYTES",
                   help="device memory for the prefix cache, e.g. 2GiB or 500MB (default auto: half what the memory "
                        "plan leaves free, at most every slot's whole context)")
    g.add_argument("--prefix-cache-granularity", type=int, default=None, metavar="TOKENS",
                   help="tokens per cached block, a power of two >= 16 (default 256)")
    g.add_argument("--no-slot-buckets", dest="slot_buckets", action="store_false",
                   help="always step every slot (default: the smallest power-of-two prefix of slots holding every "
                        "busy one; warm-up compiles one step per prefix size)")
    from jaxmtp.compile_cache import add_arguments as add_compile_cache_arguments

    add_compile_cache_arguments(g)
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="share of each GPU's memory JAX's allocator takes (default 0.9; JAX's own default is 0.75), "
                        "for the weights, the slots' KV/state buffers and the step's temporaries; ignored if "
                        "XLA_PYTHON_CLIENT_MEM_FRACTION is set; no effect on a CPU")
    g.add_argument("--compile-all", dest="background_compile", action="store_false",
                   help="compile every executable before SERVING (default: only the sampling loop over all slots "
                        "and a one-row prefill, which serve every request; the other slot buckets and prefill "
                        "shapes compile in the background after SERVING, while no request runs)")
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


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def bytes_or_auto(text: str):
    """``"auto"``, or a byte count with an optional unit (``2GiB``, ``500MB``, ``1048576``)."""
    import re

    if text.strip().lower() == "auto":
        return "auto"
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 2GiB, 500MB, 1048576) or 'auto'")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def _config_from_args(args):
    from jaxmtp.serving.server import ServerConfig

    return ServerConfig(
        host=args.host, port=args.port, num_slots=args.slots, max_context=args.max_context,
        num_draft_tokens=args.num_draft_tokens, prefill_chunk=args.prefill_chunk, steps_per_sync=args.steps_per_sync,
        max_prefill_batch=args.max_prefill_batch, max_prefill_tokens=args.max_prefill_tokens,
        slot_buckets=args.slot_buckets, max_queue=args.max_queue,
        prefix_cache_memory=args.prefix_cache_memory if args.prefix_caching else 0,
        prefix_cache_granularity=args.prefix_cache_granularity,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens_limit=args.max_new_tokens_limit, default_max_tokens=args.default_max_tokens,
        max_message_bytes=args.max_message_bytes, max_request_seconds=args.max_request_seconds,
        drain_grace=args.drain_grace, served_model_name=args.served_model_name,
        background_compile=args.background_compile, progress=True, api_key=args.api_key or None,
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)


def load_model(args):
    import jaxmtp
    from jaxmtp.loaded_model import resolve_dtype

    dtype = resolve_dtype(args.dtype).name  # the rule jaxmtp.load and python -m jaxmtp apply
    if args.kernel_override:  # a bad spec is refused before any weight is read
        from jaxmtp.pallas import Backend, override_backend

        override_backend(Backend(), args.kernel_override)
    if args.random_model:
        from jaxmtp.serving.random_model import random_model

        if args.draft_vocab is not None:
            raise ValueError("--draft-vocab takes a checkpoint's token ids; it does not apply to --random-model")
        model = random_model(args.random_model, dtype=dtype, backend=args.backend,
                             int8_draft_head=args.int8_draft_head, draft_head_bits=args.draft_head_bits,
                             tensor_parallel_size=args.tensor_parallel_size,
                             data_parallel_size=args.data_parallel_size, quantization=args.quantization,
                             tensor_parallel_reduce=args.tensor_parallel_reduce)
    else:
        model = jaxmtp.load(args.model, dtype=dtype, backend=args.backend, progress=False,
                            int8_draft_head=args.int8_draft_head, draft_vocab=args.draft_vocab,
                            draft_head_bits=args.draft_head_bits, memory_fraction=args.gpu_memory_utilization,
                            tensor_parallel_size=args.tensor_parallel_size,
                            data_parallel_size=args.data_parallel_size, quantization=args.quantization,
                            tensor_parallel_reduce=args.tensor_parallel_reduce)
    if args.kernel_override:
        from jaxmtp.benchmarking import variant_model

        model = variant_model(model, args.kernel_override)
        log.info("kernel override %s: %s", args.kernel_override, model.backend)
    return model


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
    log.info("engine: %d slots x %d tokens of context, k=%d draft tokens, prefill chunk %d (%d tokens per call), "
             "%d steps per sync, slot buckets %s, backend %s", e.num_slots, e.max_context, e.k, e.prefill_chunk,
             e.max_prefill_tokens, e.steps_per_sync, e.slot_buckets, info.backend)
    if e.k:
        from jaxmtp.mtp import describe_draft_head

        log.info("drafts: %s", describe_draft_head(model.params, model.config.vocab_size))
    log.info("limits: queue %d, prompt %d tokens, max_tokens <= %d (default %d), messages <= %d bytes, request "
             "time %s, drain grace %.1f s", config.max_queue, server.max_prompt_tokens, server.max_new_tokens_limit,
             server.default_max_tokens, config.max_message_bytes,
             f"<= {config.max_request_seconds} s" if config.max_request_seconds else "unlimited", config.drain_grace)
    if e.prefix_cache is not None:
        pc = e.prefix_cache
        log.info("prefix cache: %d blocks of %d tokens, %d snapshots, %.1f MiB", pc.num_blocks, pc.granularity,
                 pc.num_snapshots, e.plan.prefix_cache / 2**20)
    else:
        log.info("prefix cache: off")
    log.info("memory plan:\n%s", e.plan.table())
    from jaxmtp.engine.memory import device_memory_bytes, most_slots

    available = device_memory_bytes()
    if available:
        log.info("memory: %.2f GiB usable (90%% of %.2f GiB), the plan takes %.2f GiB; at most %d slots of %d "
                 "tokens fit; weights placed with a device peak of %.2f GiB", 0.9 * available / 2**30,
                 available / 2**30, e.plan.total / 2**30, most_slots(e.plan, available), e.max_context,
                 model.load_info.get("peak_device_bytes", e.plan.weights) / 2**30)

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
    http = None
    if args.http:
        from jaxmtp.serving.http_api import HttpApi

        http_port = args.http_port if args.http_port is not None else (0 if args.port == 0 else 8000)
        http = HttpApi(server, port=http_port)
        try:
            http_port = await http.start()
        except OSError:
            await server.stop()
            raise
        print(f"jaxmtp.serve http listening on {host}:{http_port}", flush=True)
        log.info("OpenAI-compatible HTTP API on http%s://%s:%d/v1", "s" if config.ssl_certfile else "", host,
                 http_port)
    log.info("listening on %s:%d%s (health NOT_SERVING until warmed up)", host, port,
             " with TLS" if config.ssl_certfile else "")
    if config.api_key:
        log.info("calls other than health checks need the API key")
    elif config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening beyond loopback without an API key: anyone who reaches %s:%d can generate and abort "
                    "requests (see --api-key and --ssl-certfile)", host, port)

    code = 0
    warm = asyncio.ensure_future(server.warmup())
    stopper = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(server.failed.wait())
    await asyncio.wait({warm, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if warm.done():
        seconds = warm.result()  # raises if the warm-up failed
        if not stop.is_set():
            w = server.engine.warmup_status()
            log.info("warmed up in %.1f s (%d of the engine's %d executables%s): SERVING", seconds, w["done"],
                     w["total"], "; the rest compile in the background while idle" if w["compiled"] < w["total"]
                     else "")
            plan = server.engine.plan
            log.info("memory: prefill calls take up to %.0f MiB of temporaries (measured on the compiled prefill); "
                     "the plan takes %.2f GiB", plan.prefill_activations / 2**20, plan.total / 2**30)
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
    if http is not None:
        await http.stop()
    await server.stop()
    log.info("stopped")
    bg = server.engine.background
    if not warm.done() or (bg is not None and not bg.finished.is_set()):
        # A compile in progress (warm-up or background thread) cannot be interrupted: leave without joining it.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "DEBUG":
        logging.getLogger("jax").setLevel(logging.WARNING)  # e.g. its INFO line about absent TPU backends
    from jaxmtp.compile_cache import enable_from_args

    cache = enable_from_args(args)  # before anything compiles
    log.info("compilation cache: %s", cache or "off")
    from jaxmtp.engine import EngineConfigError
    from jaxmtp.engine.memory import set_memory_fraction

    try:
        fraction = set_memory_fraction(args.gpu_memory_utilization)  # before JAX starts a GPU backend
    except EngineConfigError as e:
        log.error("%s", e)
        return 2
    log.info("GPU memory fraction: %s", fraction if fraction is not None else "JAX's")

    if args.http:  # a missing dependency is an error now, not after minutes of loading and a port already bound
        try:
            importlib.import_module("jaxmtp.serving.http_api")
        except ImportError as e:
            log.error("the OpenAI-compatible HTTP API needs %s (pip install 'starlette>=0.37' 'uvicorn>=0.29', "
                      "which jaxmtp's install brings); or serve gRPC only with --no-http", e.name or e)
            return 2
    try:
        return asyncio.run(serve(args))
    except (EngineConfigError, ValueError, FileNotFoundError, OSError) as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
