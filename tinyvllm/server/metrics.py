"""GET /metrics: vLLM's Prometheus metric set, named as vLLM names it with the `tinyvllm:` prefix
(so a vLLM Grafana dashboard needs only `vllm:` replaced), each with a `model_name` label.
docs/server.md has the table.

The engine thread only appends each step's StepStats (engine/stats.py) to a queue; this module
folds them into cumulative counters and histograms on the event loop (EngineLoop.drain_stats,
every second and before each scrape), so a step never waits on Prometheus bookkeeping. The
histograms are kept here rather than in prometheus_client.Histogram because inter-token gaps
arrive as (gap, count) pairs, which that class cannot observe; prometheus_client still does the
exposition (a custom collector on the server's own registry)."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from tinyvllm.engine.stats import FINISH_REASONS, StepStats

PREFIX = "tinyvllm:"

# vLLM's bucket boundaries
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    """Bucket counts, sum and count; observe() takes a weight."""
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)        # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count   # le: value <= bound
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        total, out = 0, []
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            total += n
            out.append((floatToGoString(bound), total))
        return out


@dataclass(frozen=True)
class _Spec:
    name: str
    help: str


# StepStats field -> counter (prometheus_client appends `_total`)
COUNTERS = {
    "num_prompt_tokens": _Spec("prompt_tokens", "Number of prefill tokens processed."),
    "num_generation_tokens": _Spec("generation_tokens", "Number of generation tokens processed."),
    "num_preemptions": _Spec("num_preemptions", "Cumulative number of preemption from the engine."),
    "prefix_cache_queries": _Spec("prefix_cache_queries",
                                  "Prefix cache queries, in terms of number of queried tokens."),
    "prefix_cache_hits": _Spec("prefix_cache_hits",
                               "Prefix cache hits, in terms of number of cached tokens."),
}
# FinishedRequestStats field -> (histogram, help, buckets), one observation per finished
# request; buckets "tokens" = buckets_1_2_5(max_model_len)
REQUEST_HISTOGRAMS = {
    "e2e_latency": ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                    REQUEST_TIME_BUCKETS),
    "queued_time": ("request_queue_time_seconds",
                    "Histogram of time spent in WAITING phase for request.", REQUEST_TIME_BUCKETS),
    "inference_time": ("request_inference_time_seconds",
                       "Histogram of time spent in RUNNING phase for request.", REQUEST_TIME_BUCKETS),
    "prefill_time": ("request_prefill_time_seconds",
                     "Histogram of time spent in PREFILL phase for request.", REQUEST_TIME_BUCKETS),
    "decode_time": ("request_decode_time_seconds",
                    "Histogram of time spent in DECODE phase for request.", REQUEST_TIME_BUCKETS),
    "time_per_output_token": ("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              TOKEN_GAP_BUCKETS),
    "num_prompt_tokens": ("request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    "num_generation_tokens": ("request_generation_tokens", "Number of generation tokens processed.",
                              "tokens"),
    "max_tokens": ("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                   "tokens"),
}


class EngineMetrics:
    """Cumulative metrics built from StepStats (event-loop thread only); a prometheus_client
    collector on its own registry, so several servers in one process never collide."""

    def __init__(self, model_name: str, max_model_len: int, cache_info: dict[str, str]):
        self.labels = {"model_name": model_name}
        self.cache_info = cache_info
        self.latest: StepStats | None = None
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.request_success = dict.fromkeys(sorted(set(FINISH_REASONS.values())), 0)
        token_buckets = buckets_1_2_5(max_model_len)
        self.histograms = {
            "iteration_tokens_total": (Histogram(ITERATION_TOKEN_BUCKETS),
                                       "Histogram of number of tokens per engine_step."),
            "time_to_first_token_seconds": (Histogram(TTFT_BUCKETS),
                                            "Histogram of time to first token in seconds."),
            "inter_token_latency_seconds": (Histogram(TOKEN_GAP_BUCKETS),
                                            "Histogram of inter-token latency in seconds."),
        }
        for name, doc, bounds in REQUEST_HISTOGRAMS.values():
            self.histograms[name] = (Histogram(token_buckets if bounds == "tokens" else bounds), doc)
        self._requests = [(field, self.histograms[spec[0]][0]) for field, spec in REQUEST_HISTOGRAMS.items()]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def record(self, s: StepStats) -> None:
        self.latest = s
        c = self.counters
        for field in COUNTERS:
            c[field] += getattr(s, field)
        h = self.histograms
        if s.num_scheduled_tokens:
            h["iteration_tokens_total"][0].observe(s.num_scheduled_tokens)
        ttft = h["time_to_first_token_seconds"][0]
        for t in s.time_to_first_tokens:
            ttft.observe(t)
        gaps = h["inter_token_latency_seconds"][0]
        for gap, count in s.inter_token_latencies:
            gaps.observe(gap, count)
        for request in s.finished:
            self.request_success[request.finish_reason] = self.request_success.get(request.finish_reason, 0) + 1
            for field, histogram in self._requests:
                value = getattr(request, field)
                if value is not None:
                    histogram.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        labels, names, values = self.labels, list(self.labels), list(self.labels.values())
        s = self.latest
        for name, doc, value in (
                ("num_requests_running", "Number of requests in model execution batches.",
                 s.num_running if s else 0),
                ("num_requests_waiting", "Number of requests waiting to be processed.",
                 s.num_waiting if s else 0),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 s.kv_cache_usage if s else 0.0)):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(values, value)
            yield g
        info = {**labels, **self.cache_info}
        g = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(info))
        g.add_metric(list(info.values()), 1)
        yield g
        for field, spec in COUNTERS.items():
            counter = CounterMetricFamily(PREFIX + spec.name, spec.help, labels=names)
            counter.add_metric(values, self.counters[field])
            yield counter
        success = CounterMetricFamily(PREFIX + "request_success", "Count of successfully processed "
                                      "requests.", labels=names + ["finished_reason"])
        for reason, n in self.request_success.items():
            success.add_metric(values + [reason], n)
        yield success
        for name, (histogram, doc) in self.histograms.items():
            family = HistogramMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, histogram.cumulative(), histogram.sum)
            yield family
