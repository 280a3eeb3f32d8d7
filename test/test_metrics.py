"""MetricsCollector on its own (the served /metrics is covered in test_reliability.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.metrics.collector import MetricsCollector


@dataclass
class _State:
    stream: bool
    created: float = 0.0
    first_token_at: Optional[float] = None


def _meta(completion: int, finished: bool) -> dict:
    reason = {"type": "length", "length": completion} if finished else None
    return {"completion_tokens": completion, "prompt_tokens": 7, "cached_tokens": 3, "finish_reason": reason}


def _samples(collector: MetricsCollector) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(collector.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_request_figures():
    m = MetricsCollector("m")
    stream = _State(stream=True)
    m.on_output(stream, _meta(1, False), now=0.5)  # first token after 0.5 s
    m.on_output(stream, _meta(3, False), now=0.7)
    m.on_output(stream, _meta(5, True), now=1.3)  # 4 more tokens in 0.8 s
    m.on_output(_State(stream=False), _meta(2, True), now=2.0)
    s = _samples(m)
    label = (("model_name", "m"),)
    assert s[("sglang:num_requests_total", label)] == 2
    assert s[("sglang:prompt_tokens_total", label)] == 14
    assert s[("sglang:generation_tokens_total", label)] == 7
    assert s[("sglang:cached_tokens_total", label)] == 6
    # TTFT and TPOT only from the streaming request; e2e from both.
    assert s[("sglang:time_to_first_token_seconds_count", label)] == 1
    assert s[("sglang:time_to_first_token_seconds_sum", label)] == pytest.approx(0.5)
    assert s[("sglang:time_per_output_token_seconds_sum", label)] == pytest.approx(0.2)
    assert s[("sglang:e2e_request_latency_seconds_sum", label)] == pytest.approx(3.3)
    assert s[("sglang:time_to_first_token_seconds_bucket", (("le", "0.5"),) + label)] == 1


def test_per_rank_gauges():
    m = MetricsCollector("m")
    common = {"max_total_num_tokens": 100, "last_gen_throughput": 9.0}
    m.set_rank_states(
        [
            {
                **common,
                "dp_rank": 0,
                "available_kv_tokens": 75,
                "num_running_reqs": 2,
                "num_waiting_reqs": 1,
                "avg_spec_accept_length": 2.5,
            },
            {
                **common,
                "dp_rank": 1,
                "available_kv_tokens": 100,
                "num_running_reqs": 0,
                "num_waiting_reqs": 0,
                "avg_spec_accept_length": 3.0,
            },
        ]
    )
    s = _samples(m)

    def rank(r: int) -> tuple:
        return (("dp_rank", str(r)), ("model_name", "m"))

    assert s[("sglang:token_usage", rank(0))] == 0.25 and s[("sglang:token_usage", rank(1))] == 0.0
    assert s[("sglang:num_running_reqs", rank(0))] == 2 and s[("sglang:num_queue_reqs", rank(0))] == 1
    assert s[("sglang:spec_accept_length", rank(0))] == 2.5 and s[("sglang:spec_accept_length", rank(1))] == 3.0
    # A rank without speculation reports no accept length: the gauge stays absent.
    m2 = MetricsCollector("m")
    m2.set_rank_states(
        [
            {
                **common,
                "dp_rank": 0,
                "available_kv_tokens": 1,
                "num_running_reqs": 0,
                "num_waiting_reqs": 0,
                "avg_spec_accept_length": None,
            }
        ]
    )
    assert not any(name == "sglang:spec_accept_length" for name, _ in _samples(m2))


def test_dp_balance_gauges():
    m = MetricsCollector("m")
    state = {"dp_rank": 1, "tokens_per_iteration": 3.5, "balance_ratio": 0.75, "stalled_iteration_fraction": 0.1}
    m.set_rank_states([state])
    label = (("dp_rank", "1"), ("model_name", "m"))
    s = _samples(m)
    assert s[("sglang:tokens_per_iteration", label)] == 3.5
    assert s[("sglang:dp_balance_ratio", label)] == 0.75
    assert s[("sglang:stalled_iteration_fraction", label)] == 0.1


def test_adaptive_tier_gauges():
    """--speculative-adaptive: the current tier, and cycles and accept length per tier (a label)."""
    m = MetricsCollector("m")
    state = {
        "dp_rank": 0,
        "spec_tier": 3,
        "spec_tier_cycles": {"1": 4, "3": 10},
        "spec_tier_accept_length": {"1": 1.5, "3": 2.75},
    }
    m.set_rank_states([state, {"dp_rank": 1}])  # rank 1 reports nothing of tiers
    s = _samples(m)
    rank0 = (("dp_rank", "0"), ("model_name", "m"))
    assert s[("sglang:spec_tier", rank0)] == 3
    assert s[("sglang:spec_tier_cycles", (("dp_rank", "0"), ("model_name", "m"), ("steps", "1")))] == 4
    assert s[("sglang:spec_tier_cycles", (("dp_rank", "0"), ("model_name", "m"), ("steps", "3")))] == 10
    assert s[("sglang:spec_tier_accept_length", (("dp_rank", "0"), ("model_name", "m"), ("steps", "3")))] == 2.75
    assert not any(dict(labels).get("dp_rank") == "1" for name, labels in s if name.startswith("sglang:spec_tier"))


def test_collectors_do_not_share_a_registry():
    a, b = MetricsCollector("m"), MetricsCollector("m")  # would raise on a shared registry
    a.num_requests.inc()
    assert _samples(b)[("sglang:num_requests_total", (("model_name", "m"),))] == 0
