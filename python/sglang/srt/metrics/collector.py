"""Prometheus metrics of the server (--enable-metrics), served at /metrics.

Two kinds of figures, with SGLang's metric names:
- request figures (tokens, request count, TTFT, TPOT, end-to-end latency) are observed in
  the TokenizerManager process as outputs arrive, so they measure what clients see;
- per-DP-rank gauges (running/queued requests, KV usage, accept length, and with
  --speculative-adaptive per tier: cycles and accept length) are copied from the
  schedulers' internal state when /metrics is scraped. Pull instead of push: it needs no
  new message or timer in the scheduler loop, costs nothing while nobody scrapes, and a
  scrape always sees the state of that moment (one control round-trip per scrape).

Each collector owns its registry, so several servers (or tests) in one process never
clash over the global one.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets in seconds; TPOT is per output token, so its buckets are finer.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2, 4, 8, 16, 32, 64)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class MetricsCollector:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        names = list(labels)

        def counter(name: str, doc: str):
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        def rank_gauge(name: str, doc: str, per: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, names + ["dp_rank", *per], registry=self.registry)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens of finished requests.")
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache.")
        self.num_requests = counter("sglang:num_requests", "Requests that finished (aborted ones excluded).")
        self.num_aborted_requests = counter("sglang:num_aborted_requests", "Requests aborted before finishing.")
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Time to first token (streaming requests).", _TTFT_BUCKETS)
        self.tpot = histogram(
            "sglang:time_per_output_token_seconds", "Time per output token after the first (streaming requests).", _TPOT_BUCKETS
        )
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "End-to-end latency of finished requests.", _E2E_BUCKETS)
        self.num_running_reqs = rank_gauge("sglang:num_running_reqs", "Requests decoding on a DP rank.")
        self.num_queue_reqs = rank_gauge("sglang:num_queue_reqs", "Requests waiting on a DP rank.")
        self.token_usage = rank_gauge("sglang:token_usage", "Fraction of the KV pool in use on a DP rank.")
        self.gen_throughput = rank_gauge("sglang:gen_throughput", "Generated tokens per second on a DP rank (last log interval).")
        self.spec_accept_length = rank_gauge("sglang:spec_accept_length", "Mean tokens per verify step on a DP rank.")
        self.tokens_per_iteration = rank_gauge(
            "sglang:tokens_per_iteration", "Mean rows a DP rank fed the model per busy iteration since startup."
        )
        self.dp_balance_ratio = rank_gauge(
            "sglang:dp_balance_ratio",
            "DP attention: mean over largest per-rank rows, summed over iterations since startup (1 = even).",
        )
        self.stalled_iteration_fraction = rank_gauge(
            "sglang:stalled_iteration_fraction",
            "Share of iterations with running requests in which a DP rank ran no decode batch.",
        )
        self.spec_tier = rank_gauge("sglang:spec_tier", "--speculative-adaptive: draft steps of the latest decode cycle's tier.")
        self.spec_tier_cycles = rank_gauge(
            "sglang:spec_tier_cycles",
            "--speculative-adaptive: decode cycles a DP rank ran at each tier (steps) since startup.",
            ("steps",),
        )
        self.spec_tier_accept_length = rank_gauge(
            "sglang:spec_tier_accept_length",
            "--speculative-adaptive: mean tokens per verify at each tier (steps) since startup.",
            ("steps",),
        )

    def on_output(self, state: Any, meta: dict[str, Any], now: Optional[float] = None) -> None:
        """Observe one output of a request. `state` has `stream`, `created` and
        `first_token_at` (set here on the first output that carries a token)."""
        now = time.monotonic() if now is None else now
        completion = meta["completion_tokens"]
        if state.first_token_at is None and completion > 0:
            state.first_token_at = now
            # A non-streaming request's first output is its last: its TTFT is unknown here.
            if state.stream:
                self.ttft.observe(now - state.created)
        if meta["finish_reason"] is None:
            return
        self.num_requests.inc()
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(meta["cached_tokens"])
        self.e2e.observe(now - state.created)
        if state.stream and completion > 1:
            self.tpot.observe((now - state.first_token_at) / (completion - 1))

    def set_rank_states(self, states: list[dict[str, Any]]) -> None:
        """Copy each DP rank's scheduler state (GetInternalStateReq replies) into the gauges;
        a figure a rank does not report (e.g. accept length without speculation) is left out."""
        for s in states:
            rank = {**self._labels, "dp_rank": str(s.get("dp_rank", 0))}
            figures = {
                self.num_running_reqs: s.get("num_running_reqs"),
                self.num_queue_reqs: s.get("num_waiting_reqs"),
                self.gen_throughput: s.get("last_gen_throughput"),
                self.spec_accept_length: s.get("avg_spec_accept_length"),
                self.tokens_per_iteration: s.get("tokens_per_iteration"),
                self.dp_balance_ratio: s.get("balance_ratio"),
                self.stalled_iteration_fraction: s.get("stalled_iteration_fraction"),
                self.spec_tier: s.get("spec_tier"),
            }
            if "available_kv_tokens" in s:
                figures[self.token_usage] = 1.0 - s["available_kv_tokens"] / max(s["max_total_num_tokens"], 1)
            for gauge, value in figures.items():
                if value is not None:
                    gauge.labels(**rank).set(value)
            for gauge, per_tier in (
                (self.spec_tier_cycles, "spec_tier_cycles"),
                (self.spec_tier_accept_length, "spec_tier_accept_length"),
            ):
                for steps, value in s.get(per_tier, {}).items():
                    gauge.labels(**rank, steps=steps).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
