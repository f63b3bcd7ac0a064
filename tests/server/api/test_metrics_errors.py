"""Metrics of answers that failed after admission: counted as errors, kept out of their layer's figures."""
import time

from strata.server.api.metrics import Metrics
from strata.server.api.serving import Answer


def values(metric, sample_name: str) -> dict:
    return {tuple(s.labels.values()): s.value for family in metric.collect() for s in family.samples
            if s.name == sample_name}


def test_an_answer_that_fails_after_admission_counts_as_an_error_not_as_its_layer():
    """Audit 14: a 500 engine_error or a 503 from an engine that died mid-answer was counted under `miss`, its
    latency in the miss histogram; the docs say cache_layer is `error` for 4xx / 5xx."""
    metrics = Metrics(lambda: {}, None, "m")
    answer = Answer("miss", "factual", None, 12, started=time.perf_counter(), completion_tokens=5)
    for status in (200, 500, 503, 499):
        metrics.observe("chat", answer, status)
    assert values(metrics.requests, "strata_requests_total") == {
        ("chat", "miss", "200"): 1, ("chat", "error", "500"): 1, ("chat", "error", "503"): 1, ("chat", "miss", "499"): 1}
    assert values(metrics.latency, "strata_request_latency_seconds_count") == {("miss",): 2}   # 200 and the 499
    assert values(metrics.output_tokens, "strata_output_tokens_total") == {("miss",): 10}
    assert [r["cache"] for r in metrics.recent] == ["miss", "error", "error", "miss"]
