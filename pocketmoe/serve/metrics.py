"""The server's Prometheus metrics (GET /metrics), one registry per server so tests can run several."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: TTFT spans a prefill, inter-token latency a decode step (ms on the bench preset).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "pocketmoe_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.prefix_cache_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache at admission", registry=r)
        self.prefix_cache_hits = Counter(p + "prefix_cache_hits", "Prompt tokens whose KV rows came from the prefix "
                                         "cache instead of a prefill", registry=r)
        self.prefix_cache_disk_hits = Counter(p + "prefix_cache_disk_hits", "Prompt tokens whose KV rows the prefix "
                                              "cache read from --prefix-cache-dir", registry=r)
        self.prefix_cache_disk_bytes = Gauge(p + "prefix_cache_disk_bytes", "Bytes of KV pages kept in "
                                             "--prefix-cache-dir", registry=r)
        self.kv_cached_pages = Gauge(p + "kv_cache_prefix_pages", "KV pages the prefix cache holds (those no "
                                     "sequence uses count as free)", registry=r)
        self.preemptions = Counter(p + "preemptions", "Sequences preempted (recomputed later) for KV pages",
                                   registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between a sequence's tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.running = Gauge(p + "num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Sequences waiting for admission", registry=r)
        self.kv_used = Gauge(p + "kv_cache_usage_ratio", "Fraction of the KV pool's pages in use", registry=r)
        self.kv_pages = Gauge(p + "kv_cache_pages", "Pages in the KV pool", registry=r)
        self.kv_bytes = Gauge(p + "kv_cache_bytes", "Bytes of the KV pool", registry=r)
        self.responses_stored = Gauge(p + "responses_stored", "/v1/responses replies kept for previous_response_id",
                                      registry=r)
        self.responses_store_bytes = Gauge(p + "responses_store_bytes", "Bytes (JSON) of the kept /v1/responses "
                                           "replies, at most --responses-store-mib", registry=r)
        self.llama = LlamaMetrics(r, self.running, self.waiting)


    def watch_experts(self, runner) -> None:  # noqa: ANN001
        """Gauges read at scrape time: the expert cache statistics and the predicted decode tok/s (the plan's
        and the cost model's) beside the measured one (1 / the mean inter-token latency)."""
        from pocketmoe.experts.report import expert_report

        p, r = "pocketmoe_", self.registry
        stats = ("hits", "misses", "staged", "cpu_experts", "bytes_copied", "hit_rate", "bytes_copied_per_token",
                 "cpu_experts_per_token")
        for name in stats:
            g = Gauge(p + "expert_" + name, f"Routed experts: {name.replace('_', ' ')} since start", registry=r)
            g.set_function(lambda n=name: float((expert_report(runner).get("stats") or {}).get(n, 0.0)))
        for name in ("plan_decode_tok_s", "cost_model_decode_tok_s"):
            g = Gauge(p + "predicted_" + name.removesuffix("_decode_tok_s") + "_decode_tok_s",
                      f"Predicted decode tokens/s ({name.split('_decode')[0].replace('_', ' ')})", registry=r)
            g.set_function(lambda n=name: float(expert_report(runner).get(n) or 0.0))

        def measured() -> float:
            total = r.get_sample_value(p + "inter_token_latency_seconds_sum") or 0.0
            count = r.get_sample_value(p + "inter_token_latency_seconds_count") or 0.0
            return count / total if total > 0 else 0.0

        Gauge(p + "measured_decode_tok_s", "Measured decode tokens/s of one sequence (1 / mean inter-token "
              "latency)", registry=r).set_function(measured)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class LlamaMetrics:
    """llama-server's metrics under its names (`llamacpp:`), for the dashboards built on them: prompt tokens computed
    (cache hits left out) and the seconds from each sequence's admission to its first token; tokens generated and
    the seconds from its first token to its last; steps (its llama_decode calls) and the running sequences per step;
    the longest sequence; running and waiting sequences; and the prompt and generation tokens/s since the previous
    scrape (its per-bucket averages)."""

    def __init__(self, r: CollectorRegistry, running: Gauge, waiting: Gauge) -> None:
        p = "llamacpp:"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Number of prompt tokens processed.", registry=r)
        self.prompt_seconds = Counter(p + "prompt_seconds", "Prompt process time", registry=r)
        self.tokens_predicted = Counter(p + "tokens_predicted", "Number of generation tokens processed.", registry=r)
        self.predicted_seconds = Counter(p + "tokens_predicted_seconds", "Predict process time", registry=r)
        self.n_decode = Counter(p + "n_decode", "Total number of llama_decode() calls", registry=r)
        self.busy_slots = 0  # running sequences summed over the steps
        self.n_tokens_max = Gauge(p + "n_tokens_max", "Largest observed n_tokens.", registry=r)
        Gauge(p + "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
              registry=r).set_function(lambda: self.busy_slots / max(self.n_decode._value.get(), 1))
        Gauge(p + "requests_processing", "Number of requests processing.", registry=r).set_function(
            lambda: running._value.get())
        Gauge(p + "requests_deferred", "Number of requests deferred.", registry=r).set_function(
            lambda: waiting._value.get())
        self._last = {"prompt": (0.0, 0.0), "predicted": (0.0, 0.0)}
        Gauge(p + "prompt_tokens_seconds", "Average prompt throughput in tokens/s.", registry=r).set_function(
            lambda: self._rate("prompt", self.prompt_tokens, self.prompt_seconds))
        Gauge(p + "predicted_tokens_seconds", "Average generation throughput in tokens/s.", registry=r).set_function(
            lambda: self._rate("predicted", self.tokens_predicted, self.predicted_seconds))

    def _rate(self, name: str, tokens: Counter, seconds: Counter) -> float:
        """Tokens per second since the previous scrape (0 where no time passed in sequences)."""
        n, t = tokens._value.get(), seconds._value.get()
        n0, t0 = self._last[name]
        self._last[name] = (n, t)
        return (n - n0) / (t - t0) if t > t0 else 0.0

    def step(self, running: int, longest: int) -> None:
        """One step of `running` sequences, the longest `longest` tokens."""
        self.n_decode.inc()
        self.busy_slots += running
        if longest > self.n_tokens_max._value.get():
            self.n_tokens_max.set(longest)
