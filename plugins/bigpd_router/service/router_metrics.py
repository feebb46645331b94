"""Layer: service (no SGLang import). The router's Prometheus metrics, all made through kllm_plugins.metrics."""
from __future__ import annotations

from typing import Any

from kllm_plugins import metrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.requests: Any = metrics.counter(
            "kllm_bigpd_router_requests_total", "requests answered by the router", ("endpoint", "status"))
        self.retries: Any = metrics.counter(
            "kllm_bigpd_router_retries_total", "attempts retried on another instance before the first token",
            ("reason",))
        self.ttft: Any = metrics.histogram(
            "kllm_bigpd_router_ttft_seconds", "time to first token seen by the router", LATENCY_BUCKETS)
        self.tpot: Any = metrics.histogram(
            "kllm_bigpd_router_tpot_seconds", "time per output token seen by the router (streams)", TPOT_BUCKETS)
        self.e2e: Any = metrics.histogram(
            "kllm_bigpd_router_request_seconds", "whole request latency seen by the router", LATENCY_BUCKETS)
        self.slo_load: Any = metrics.gauge(
            "kllm_bigpd_router_slo_load_ratio", "SLO Load per pool: max(pred, actual) / target", ("pool",))
        self.slo_pred: Any = metrics.gauge(
            "kllm_bigpd_router_slo_pred_seconds", "predicted TTFT (prefill/plain) or TPOT (decode) per pool",
            ("pool",))
        self.instances: Any = metrics.gauge(
            "kllm_bigpd_router_instances_count", "instances per pool and health state", ("pool", "health"))
        self.in_flight: Any = metrics.gauge(
            "kllm_bigpd_router_in_flight_requests", "requests in flight per instance", ("instance",))
        self.scale_actions: Any = metrics.counter(
            "kllm_bigpd_router_scale_actions_total", "scaling decisions carried out", ("pool", "action"))
        self.prompt_tokens: Any = metrics.counter(
            "kllm_bigpd_router_prompt_tokens_total", "prompt tokens reported by instances")
        self.kv_lookups: Any = metrics.counter(
            "kllm_bigpd_router_kv_lookups_total", "prefill choices made on KV-event matches")
        self.disconnects: Any = metrics.counter(
            "kllm_bigpd_router_client_disconnects_total",
            "requests whose client closed or reset the connection before the answer ended (logged as 499; "
            "the upstream request is aborted)", ("phase",))
        self.client_events: Any = metrics.counter(
            "kllm_bigpd_router_client_connections_closed_total",
            "client connections the router closed: header/body/idle timeouts, per-address cap, resets",
            ("reason",))
        self.refused: Any = metrics.counter(
            "kllm_bigpd_router_refused_requests_total",
            "requests refused before reaching an instance: invalid for the model (input), quarantined (poison)",
            ("reason",))
        self.watchdog: Any = metrics.counter(
            "kllm_bigpd_router_watchdog_ends_total",
            "requests the watchdog ended: client gone, no data in time, instance marked down", ("reason",))
        self.cached_tokens: Any = metrics.counter(
            "kllm_bigpd_router_cached_tokens_total", "prompt tokens the instances served from their prefix cache")
