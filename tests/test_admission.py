"""shared.admission: the cost fit and the admission arithmetic, by hand."""

from __future__ import annotations

import pytest

from shared.admission import Tally, check, drained
from shared.costs import Cost, CostBook
from shared.errors import ServiceError


def test_the_fit_separates_a_batch_cost_from_a_token_cost():
    book = CostBook()
    for tokens in (16, 512, 64, 1024, 128, 16, 512):
        book.observe("m", 0.05 + 0.001 * tokens, tokens)
    cost = book.cost("m")
    assert cost.per_batch == pytest.approx(0.05, rel=1e-6)
    assert cost.per_token == pytest.approx(0.001, rel=1e-6)


def test_batches_of_one_size_are_charged_per_token():
    book = CostBook()
    for _ in range(3):
        book.observe("m", 0.2, 100)
    assert book.cost("m") == Cost(0.0, pytest.approx(0.002))


def test_one_size_after_a_learned_estimate_keeps_its_split_at_the_observed_level():
    """A decoder whose repeated prompts are cached computes one-token chunks only:
    charged per token, a 500-token prompt would cost 500 of them. The learned
    estimate (its warm-up's) keeps the split, scaled to what the chunks cost."""
    book = CostBook()
    book.learn("m", Cost(0.010, 0.002))
    for _ in range(200):
        book.observe("m", 0.024, 1)  # twice the learned 0.012
    cost = book.cost("m")
    assert cost.per_batch + cost.per_token == pytest.approx(0.024, rel=0.01)
    assert cost.per_batch / cost.per_token == pytest.approx(5.0, rel=0.01)
    assert cost.seconds(1, 500, 32) == pytest.approx(2 * (0.010 + 0.002 * 500), rel=0.01)


def test_one_slow_batch_moves_the_estimate_a_little_and_a_lasting_slowdown_fully():
    book = CostBook()
    for _ in range(10):
        book.observe("m", 0.125, 1000)
    # A batch twice the size at 2.4x its time per token: it ran while a burst's
    # refusals and tokenizing held the cores. Unclipped it moved the estimate +47 %.
    book.observe("m", 0.6, 2000)
    assert book.cost("m").seconds(8, 1000, 32) < 0.125 * 1.2
    # The machine gets twice as slow and stays so: the estimate follows within a dozen batches.
    for _ in range(12):
        book.observe("m", 0.25, 1000)
    assert book.cost("m").seconds(8, 1000, 32) == pytest.approx(0.25, rel=0.05)


def test_another_schedulers_estimate_is_taken_as_it_was_given():
    book = CostBook()
    book.learn("m", Cost(0.03, 0.0005))
    assert book.cost("m").per_batch == pytest.approx(0.03)
    assert book.cost("m").per_token == pytest.approx(0.0005)


def refusal(**kw) -> ServiceError:
    args = dict(model="m", ahead=Tally(10, 10, 1000), inputs=1, tokens=100, n_ready=1,
                max_batch=32, cost=Cost(0.0, 0.001), left_s=30.0, max_queue_per_worker=256,
                max_queue_s=5.0)
    args.update(kw)
    with pytest.raises(ServiceError) as err:
        check(**args)
    return err.value


def test_work_ahead_against_the_queue_bound_and_the_deadline():
    # 1.1 s of work: admitted with 30 s to live, refused with 1.2 s (half of it is 0.6 s).
    check("m", Tally(10, 10, 1000), 1, 100, 1, 32, Cost(0.0, 0.001), 30.0, 256, 5.0)
    late = refusal(left_s=1.2)
    assert late.status == 429 and late.retry_after == pytest.approx(0.5)
    # Two workers share it: 0.55 s each, which fits.
    check("m", Tally(10, 10, 1000), 1, 100, 2, 32, Cost(0.0, 0.001), 1.2, 256, 5.0)
    full = refusal(max_queue_s=1.0)
    assert full.retry_after == pytest.approx(0.1) and "capacity" in full.message


def test_the_count_bound_holds_whatever_the_cost():
    assert refusal(ahead=Tally(256, 256, 256)).status == 429


def test_reports_drain_by_whole_batches_while_they_age():
    # 64 inputs of 100 tokens: two batches of 32, 3.2 s each on one worker.
    ahead = Tally(64, 64, 6400)
    cost = Cost(0.0, 0.001)
    assert drained(ahead, cost, 32, 1, 3.0) == ahead  # the first batch is not done yet
    assert drained(ahead, cost, 32, 1, 3.3) == Tally(32, 32, 3200)
    assert drained(ahead, cost, 32, 2, 3.3) == Tally(0, 0, 0)  # two workers, one each
    assert drained(Tally(10, 10, 1000), cost, 32, 1, 0.5) == Tally(10, 10, 1000)
    assert drained(Tally(10, 10, 1000), cost, 32, 1, 1.0) == Tally(0, 0, 0)
    assert drained(ahead, None, 32, 1, 0.5) == ahead
