"""Prometheus metrics of a :class:`jaxmtp.serving.server.GenerationServer` (``GET /metrics`` of the HTTP API).

They cover every request the scheduler runs, whichever protocol brought it (gRPC or HTTP). Names follow vLLM's
``vllm:*`` metrics where one exists, under the ``jaxmtp_`` prefix:

* counters read from the scheduler at scrape time: ``jaxmtp_requests_finished_total{finish_reason}`` (stop, length,
  abort, cancelled, deadline, shutdown, error), ``jaxmtp_requests_rejected_total{code}`` (gRPC status names: HTTP
  400 counts as INVALID_ARGUMENT, 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE),
  ``jaxmtp_prompt_tokens_total``, ``jaxmtp_generation_tokens_total``, ``jaxmtp_spec_decode_num_drafts_total``
  (verify steps x requests), ``jaxmtp_spec_decode_num_draft_tokens_total``,
  ``jaxmtp_spec_decode_num_accepted_tokens_total`` and ``..._per_pos_total{position}`` (steps whose drafts 1..p were
  all accepted), ``jaxmtp_engine_iterations_total``;
* gauges: ``jaxmtp_num_requests_running`` (busy slots), ``jaxmtp_num_requests_waiting`` (queue depth),
  ``jaxmtp_num_slots``, ``jaxmtp_spec_decode_acceptance_rate_per_pos{position}``, ``jaxmtp_server_ready``;
* with the prefix cache on: ``jaxmtp_prefix_cache_queries_total`` and ``..._hits_total`` (prompt tokens looked up
  and restored), ``jaxmtp_prefix_cache_evictions_total``, ``jaxmtp_prefix_cache_bytes``;
* histograms observed as each request ends (:attr:`Scheduler.on_finish`, before its last output reaches the
  client), timed on the engine thread from submission: ``jaxmtp_time_to_first_token_seconds``,
  ``jaxmtp_time_per_output_token_seconds`` ((end - first token) / (tokens - 1)),
  ``jaxmtp_e2e_request_latency_seconds``, ``jaxmtp_request_prompt_tokens``, ``jaxmtp_request_generation_tokens``.
  A request of ``n`` samples is one request: its first token is any sample's, its generation tokens the sum over
  the samples, its time per output token that of its longest sample.

Each server has its own ``CollectorRegistry`` (several servers in one process do not clash).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxmtp.serving.scheduler import FinishedRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _SchedulerCollector:
    """Counters and gauges read from one consistent scheduler snapshot per scrape."""

    def __init__(self, server):
        self.server = server

    def describe(self):
        return []

    def collect(self):
        srv = self.server
        s = srv.scheduler.snapshot()
        spec = s["spec"]
        model = {"model_name": srv.model_name}
        names, values = list(model), list(model.values())

        def counter(name, doc, value):
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc, labels=names)
            m.add_metric(values, value)
            return m

        finished = CounterMetricFamily("jaxmtp_requests_finished", "Requests that ended, by finish reason",
                                       labels=names + ["finish_reason"])
        for reason, n in sorted(s["requests_finished"].items()):
            finished.add_metric(values + [reason], n)
        yield finished
        rejected = CounterMetricFamily("jaxmtp_requests_rejected", "Requests refused before they started, by gRPC "
                                       "status name", labels=names + ["code"])
        for code, n in sorted(s["requests_rejected"].items()):
            rejected.add_metric(values + [code], n)
        yield rejected
        yield counter("jaxmtp_requests", "Requests accepted by the scheduler", s["requests_total"])
        yield counter("jaxmtp_prompt_tokens", "Prompt tokens of accepted requests", s["prompt_tokens_total"])
        yield counter("jaxmtp_generation_tokens", "Output tokens generated", s["generated_tokens_total"])
        yield counter("jaxmtp_engine_iterations", "Engine iterations (prefill + device loop)", s["engine_iterations"])
        yield counter("jaxmtp_spec_decode_num_drafts", "Verify steps summed over requests", spec.steps)
        yield counter("jaxmtp_spec_decode_num_draft_tokens", "Draft tokens proposed", spec.drafted)
        yield counter("jaxmtp_spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.accepted)
        per_pos = CounterMetricFamily("jaxmtp_spec_decode_num_accepted_tokens_per_pos", "Verify steps whose drafts "
                                      "1..position were all accepted", labels=names + ["position"])
        rate = GaugeMetricFamily("jaxmtp_spec_decode_acceptance_rate_per_pos", "Fraction of verify steps whose drafts "
                                 "1..position were all accepted", labels=names + ["position"])
        for i, n in enumerate(spec.accepted_per_position):
            per_pos.add_metric(values + [str(i + 1)], n)
            rate.add_metric(values + [str(i + 1)], n / spec.steps if spec.steps else 0.0)
        yield per_pos
        yield rate
        yield gauge("jaxmtp_num_requests_running", "Requests in engine slots (busy slots)", s["requests_running"])
        yield gauge("jaxmtp_num_requests_waiting", "Requests queued for a slot", s["requests_queued"])
        yield gauge("jaxmtp_num_slots", "Engine slots", srv.engine.num_slots)
        yield gauge("jaxmtp_server_ready", "1 when warmed up and accepting requests",
                    1.0 if srv.ready and not srv.draining and srv.scheduler.failure is None else 0.0)
        pc = srv.engine.prefix_cache_stats()
        if pc is not None:  # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens
            yield counter("jaxmtp_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                          pc["queried_tokens"])
            yield counter("jaxmtp_prefix_cache_hits", "Prompt tokens restored from the prefix cache", pc["hit_tokens"])
            yield counter("jaxmtp_prefix_cache_evictions", "Prefix-cache blocks and snapshots evicted", pc["evictions"])
            yield gauge("jaxmtp_prefix_cache_bytes", "Device memory of the prefix cache's pools", pc["pool_bytes"])


class ServerMetrics:
    """The registry of one server; :meth:`observe` is hooked into the scheduler's ``on_finish``."""

    def __init__(self, server):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SchedulerCollector(server))
        labels = {"model_name": server.model_name}
        names = list(labels)

        def hist(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        self.ttft = hist("jaxmtp_time_to_first_token_seconds", "Submission to the first output token", TTFT_BUCKETS)
        self.tpot = hist("jaxmtp_time_per_output_token_seconds", "(End - first token) / (output tokens - 1)",
                         TPOT_BUCKETS)
        self.latency = hist("jaxmtp_e2e_request_latency_seconds", "Submission to the end of the request",
                            LATENCY_BUCKETS)
        self.prompt_tokens = hist("jaxmtp_request_prompt_tokens", "Prompt tokens per finished request", TOKEN_BUCKETS)
        self.generation_tokens = hist("jaxmtp_request_generation_tokens", "Output tokens per finished request",
                                      TOKEN_BUCKETS)
        server.scheduler.on_finish.append(self.observe)

    def observe(self, r: FinishedRequest) -> None:  # the engine thread
        self.latency.observe(r.finished - r.submitted)
        self.prompt_tokens.observe(r.prompt_tokens)
        self.generation_tokens.observe(r.completion_tokens)
        if r.first_token is not None:
            self.ttft.observe(r.first_token - r.submitted)
            tokens = r.completion_tokens if r.longest_sample is None else r.longest_sample
            if tokens > 1:
                self.tpot.observe((r.finished - r.first_token) / (tokens - 1))

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
