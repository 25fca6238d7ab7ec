"""The canary guard's judgement on known figures (the integration test,
tests/integration/test_canary.py, rolls a failing canary back on a real fleet)."""

from __future__ import annotations

from services.telemetry.canary import _Counts, verdict
from shared.registry import CanaryGuard
from shared.telemetry import RequestRecord

GUARD = CanaryGuard(window_s=60.0, min_requests=20, error_margin=0.05, p95_margin=0.5)


def counts(n: int, *, errors: int = 0, latency_s: float = 0.01, client_errors: int = 0) -> _Counts:
    c = _Counts()
    for i in range(n):
        status = 500 if i < errors else 400 if i < errors + client_errors else 200
        c.add(RequestRecord(request_id=str(i), endpoint="embeddings", model="m", version="v",
                            worker_id="w", status=status, error_code="", total_s=latency_s,
                            queue_s=0.0, batch_wait_s=0.0, compute_s=0.0, prompt_tokens=1,
                            completion_tokens=0))
    return c


def test_errors_past_the_margin_roll_back_and_within_it_do_not():
    prod = counts(400, errors=4)  # 1 %
    assert verdict(GUARD, counts(100, errors=5), prod) == ""  # 5 %: 4 points above, within
    why = verdict(GUARD, counts(100, errors=10), prod)
    assert why.startswith("error rate 10.0% vs prod 1.0%")


def test_client_errors_are_not_the_versions_fault():
    assert verdict(GUARD, counts(100, client_errors=50), counts(400)) == ""


def test_p95_past_the_margin_rolls_back():
    prod = counts(400, latency_s=0.010)
    assert verdict(GUARD, counts(100, latency_s=0.014), prod) == ""  # +40 %
    assert verdict(GUARD, counts(100, latency_s=0.016), prod).startswith("p95 16.")  # +60 %


def test_too_few_canary_requests_are_no_verdict():
    assert verdict(GUARD, counts(19, errors=19), counts(400)) == ""
