"""Prometheus metrics of the whole fleet, built from telemetry records.

Names mirror vLLM's where the meaning is the same (`vllm:e2e_request_latency_seconds`
-> `tensorbus_e2e_request_latency_seconds`, ...). Base units, `_total` on counters, a
`model` label wherever a model applies. Every metric lives in the registry passed in.

What each kind of record feeds:

1. RequestRecord: `tensorbus_requests_total` counts every finished request by status;
   it and `tensorbus_e2e_request_latency_seconds` carry the model `version` too, so a
   canary and prod compare side by side;
   histograms and token counters describe served requests only (status < 400), so a
   fast 429 under overload cannot make latency look better. Failures show in the
   counter's `status` label.
2. Heartbeat: per-worker gauges, replaced on every beat; a worker silent for
   `expiry_s` (or one that reports `stopped`) has all its series removed, and the
   per-model fleet gauges are recomputed from the workers still alive.
3. ScaleDecision: the latest decision of each live scheduler is kept;
   `tensorbus_model_desired_replicas` (the value KEDA scales on) is their
   `shared.scaling.combine`, and `tensorbus_model_held_requests` the sum of what they
   hold. An idle model's schedulers say 0, so the gauge says 0; a scheduler silent
   for `DECISION_TTL_S` stops counting.
4. A RequestRecord with `hold_s` > 0 (held for a cold start, whatever its outcome)
   feeds `tensorbus_cold_start_wait_seconds`.
5. Generation: `tensorbus_time_to_first_token_seconds` is the gateway's TTFT (receipt
   to first chunk), `tensorbus_worker_time_to_first_token_seconds` the worker's share.
   `tensorbus_inter_token_latency_seconds` has one observation per generated token
   gap: the worker counts gaps into the histogram's own buckets (`itl_counts`), and
   `TokenGapHistogram` adds those counts, so no gap is lost and none is sent alone.
6. Every summary sets the cost gauges (`tensorbus_cost_per_million_*_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from shared.scaling import LiveDecisions
from shared.telemetry import (ENCODER_ENDPOINTS, ITL_BUCKETS, Heartbeat, RequestRecord,
                              ScaleDecision, kv_usage)

NS = "tensorbus"

# 100 us .. 2 min: sub-millisecond encoder batches up to long generations.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384
BATCH_BUCKETS = tuple(float(2**i) for i in range(10))  # 1 .. 512


@dataclass
class _Seen:
    model: str
    state: str
    last_seen: float  # monotonic seconds in this process
    queue_depth: int
    device: str = ""
    in_flight: int = 0
    decoder: bool = False  # vLLM's running / waiting gauges count decoders' sequences
    # prefix queries, hits, preemptions, speculative drafts, draft and accepted tokens so far
    counted: tuple[int, ...] = (0,) * 6

    @property
    def running(self) -> int:
        """vLLM's num_requests_running: a decoder's sequences holding a slot."""
        return self.in_flight if self.decoder else 0

    @property
    def waiting(self) -> int:
        """vLLM's num_requests_waiting: a decoder's sequences waiting for a slot."""
        return self.queue_depth if self.decoder else 0


class TokenGapHistogram:
    """A Prometheus histogram (label `model`) fed with bucket counts, not values.

    prometheus_client's Histogram takes one value per `observe()`; a worker already
    counted its request's gaps into the same buckets, so adding the counts is exact
    and costs 18 additions per request instead of one call per token."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self.name, self.doc = name, doc
        self._bounds = [floatToGoString(b) for b in buckets] + ["+Inf"]
        self._series: dict[str, tuple[list[int], list[float]]] = {}  # model -> counts, [sum]
        registry.register(self)

    def add(self, model: str, counts: list[int], total_s: float) -> None:
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = ([0] * len(self._bounds), [0.0])
        acc, total = series
        for i, n in enumerate(counts[:len(acc)]):
            acc[i] += n
        total[0] += total_s

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc, labels=["model"])]

    def collect(self):
        fam = HistogramMetricFamily(self.name, self.doc, labels=["model"])
        for model, (acc, total) in self._series.items():
            running, buckets = 0, []
            for bound, n in zip(self._bounds, acc):
                running += n
                buckets.append((bound, running))
            fam.add_metric([model], buckets, total[0])
        yield fam


@dataclass(slots=True)
class _ModelSeries:
    """One model's children of the request metrics."""

    queue: Histogram
    batch_wait: Histogram
    compute: Histogram
    ttft: Histogram
    worker_ttft: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    batch_size: Histogram


class TelemetryMetrics:
    def __init__(self, registry: CollectorRegistry, *, expiry_s: float = 2.0) -> None:
        self.registry = registry
        self.expiry_s = expiry_s
        self._workers: dict[str, _Seen] = {}
        self._models: set[str] = set()
        self._build_request_metrics(registry)
        self._build_worker_metrics(registry)
        self._build_self_metrics(registry)
        self._record_child = self.records.labels("request")
        self._request_children: dict[tuple[str, str, str, int], Counter] = {}
        self._e2e_children: dict[tuple[str, str], Histogram] = {}
        self._series: dict[str, _ModelSeries] = {}
        self.decisions = LiveDecisions()
        self._costed: list[set[str]] = [set(), set()]  # models with an input, output cost series

    # --- construction

    def _build_request_metrics(self, r: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{NS}_{name}", doc, ["model"], buckets=buckets, registry=r)

        self.requests = Counter(f"{NS}_requests", "Finished requests by endpoint and status.",
                                ["model", "version", "endpoint", "status"], registry=r)
        self.e2e = Histogram(f"{NS}_e2e_request_latency_seconds",
                             "Gateway receipt to reply sent, served requests.",
                             ["model", "version"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue = hist("request_queue_time_seconds",
                          "Time waiting in scheduler and worker queues.", LATENCY_BUCKETS)
        self.batch_wait = hist("request_batch_wait_seconds",
                               "Time waiting for a batch to fill.", LATENCY_BUCKETS)
        self.compute = hist("request_compute_seconds",
                            "Time in the engine's forward passes.", LATENCY_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds",
                         "Gateway receipt to the first generated token reaching it.",
                         LATENCY_BUCKETS)
        self.worker_ttft = hist("worker_time_to_first_token_seconds",
                                "Worker receipt to its first generated token.", LATENCY_BUCKETS)
        self.itl = TokenGapHistogram(f"{NS}_inter_token_latency_seconds",
                                     "Gap between consecutive generated tokens, per token.",
                                     ITL_BUCKETS, r)
        self.cost_input = Gauge(f"{NS}_cost_per_million_input_tokens",
                                "Cost of 1M prompt tokens over the summary window (price "
                                "per worker-hour, split by prefill time).", ["model"], registry=r)
        self.cost_output = Gauge(f"{NS}_cost_per_million_output_tokens",
                                 "Cost of 1M generated tokens over the summary window (price "
                                 "per worker-hour, split by decode time).", ["model"], registry=r)
        self.prompt_tokens = Counter(f"{NS}_prompt_tokens", "Prompt (input) tokens processed.",
                                     ["model"], registry=r)
        self.generation_tokens = Counter(f"{NS}_generation_tokens", "Tokens generated.",
                                         ["model"], registry=r)
        self.request_prompt_tokens = hist("request_prompt_tokens",
                                          "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation_tokens = hist("request_generation_tokens",
                                              "Generated tokens per request.", TOKEN_BUCKETS)
        self.batch_size = hist("batch_size", "Size of the batch a request ran in.",
                               BATCH_BUCKETS)
        self.cold_start_wait = hist("cold_start_wait_seconds",
                                    "Time a request was held waiting for a worker to start.",
                                    LATENCY_BUCKETS)

    def _build_worker_metrics(self, r: CollectorRegistry) -> None:
        def worker_gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{NS}_{name}", doc, ["worker", "model"], registry=r)

        # `up` first: a scrape (on the HTTP server's thread, while the loop may drop a
        # worker) collects families in the order they were made, so it reads `up`
        # before the worker's other series, which `_drop` removes before `up`.
        self.w_up = Gauge(f"{NS}_worker_up", "1 per live worker, labelled with its state.",
                          ["worker", "model", "state"], registry=r)
        self.w_queue = worker_gauge("worker_queue_depth", "Requests waiting in the worker.")
        self.w_in_flight = worker_gauge("worker_in_flight", "Requests the worker is running.")
        self.w_occupancy = worker_gauge("worker_batch_occupancy",
                                        "Mean batch fill (items / max_batch), last interval.")
        self.w_rss = worker_gauge("worker_rss_bytes", "Resident memory of the worker process.")
        self.w_kv = worker_gauge("kv_cache_usage_perc", "KV cache usage, 1 = full.")
        self.w_slots = worker_gauge("worker_slots_used", "Decode slots holding a sequence.")
        # vLLM's scheduler and cache metrics, per worker (sum() for the fleet).
        self.w_running = worker_gauge("num_requests_running",
                                      "Sequences holding a decode slot (prefilling or decoding).")
        self.w_waiting = worker_gauge("num_requests_waiting",
                                      "Sequences waiting for a slot or KV cache room.")
        self.w_blocks = worker_gauge("kv_cache_blocks", "KV cache blocks of the loaded engines.")

        def worker_counter(name: str, doc: str) -> Counter:
            return Counter(f"{NS}_{name}", doc, ["worker", "model"], registry=r)

        self.w_prefix_queries = worker_counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.w_prefix_hits = worker_counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (K/V reused).")
        self.w_preemptions = worker_counter(
            "num_preemptions", "Sequences preempted to free KV cache blocks.")
        # vLLM's speculative decoding counters: acceptance rate is accepted / draft
        # tokens, accepted tokens per verify pass accepted / drafts.
        self.w_spec_drafts = worker_counter(
            "spec_decode_num_drafts", "Speculative verify passes (one draft each).")
        self.w_spec_draft_tokens = worker_counter(
            "spec_decode_num_draft_tokens", "Draft tokens checked by verify passes.")
        self.w_spec_accepted = worker_counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted by verify passes.")
        self.w_mem_used = worker_gauge("worker_memory_used_bytes",
                                       "Memory in use (device where reported, else host RSS).")
        self.w_mem_limit = worker_gauge("worker_memory_limit_bytes",
                                        "The limit that memory in use is measured against.")
        self.m_queue = Gauge(f"{NS}_model_queue_depth", "Queued requests over live workers.",
                             ["model"], registry=r)
        self.m_running = Gauge(f"{NS}_model_num_requests_running",
                               "Sequences holding a decode slot, over live workers.",
                               ["model"], registry=r)
        self.m_waiting = Gauge(f"{NS}_model_num_requests_waiting",
                               "Sequences waiting for a slot or KV cache room, over live workers.",
                               ["model"], registry=r)
        self.m_ready = Gauge(f"{NS}_model_ready_workers", "Live workers in state ready.",
                             ["model"], registry=r)
        self.m_desired = Gauge(f"{NS}_model_desired_replicas",
                               "Replicas the schedulers want, combined (the autoscaling target).",
                               ["model"], registry=r)
        self.m_held = Gauge(f"{NS}_model_held_requests",
                            "Requests held for a cold start, over live schedulers.",
                            ["model"], registry=r)
        self.m_batch_waiting = Gauge(
            f"{NS}_model_batch_waiting_requests",
            "Batch-priority requests waiting for idle capacity, over live schedulers.",
            ["model"], registry=r)

    def _build_self_metrics(self, r: CollectorRegistry) -> None:
        self.records = Counter(f"{NS}_telemetry_records", "Telemetry records consumed.",
                               ["kind"], registry=r)
        self.bad_records = Counter(f"{NS}_telemetry_bad_records",
                                   "Messages that did not decode as a telemetry record.",
                                   registry=r)
        self.dropped = Counter(f"{NS}_telemetry_dropped_messages",
                               "Messages dropped because this consumer fell behind.",
                               ["subject"], registry=r)
        self.pending = Gauge(f"{NS}_telemetry_pending_messages",
                             "Messages received but not yet processed.", ["subject"],
                             registry=r)

    # --- records

    def observe_request(self, rec: RequestRecord) -> None:
        self._record_child.inc()
        key = (rec.model, rec.version, rec.endpoint, rec.status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(
                rec.model, rec.version, rec.endpoint, str(rec.status))
        counter.inc()
        if rec.hold_s > 0:
            self.cold_start_wait.labels(rec.model).observe(rec.hold_s)
        if rec.status >= 400:
            return
        s = self._series.get(rec.model) or self._model_series(rec.model)
        e2e = self._e2e_children.get((rec.model, rec.version))
        if e2e is None:
            e2e = self._e2e_children[(rec.model, rec.version)] = self.e2e.labels(
                rec.model, rec.version)
        e2e.observe(rec.total_s)
        s.queue.observe(rec.queue_s)
        s.batch_wait.observe(rec.batch_wait_s)
        s.compute.observe(rec.compute_s)
        if rec.batch_size > 0:
            s.batch_size.observe(rec.batch_size)
        s.prompt_tokens.inc(rec.prompt_tokens)
        s.request_prompt_tokens.observe(rec.prompt_tokens)
        if rec.endpoint not in ENCODER_ENDPOINTS:
            s.generation_tokens.inc(rec.completion_tokens)
            s.request_generation_tokens.observe(rec.completion_tokens)
        if rec.ttft_s > 0:
            s.ttft.observe(rec.ttft_s)
        if rec.worker_ttft_s > 0:
            s.worker_ttft.observe(rec.worker_ttft_s)
        gaps = sum(rec.itl_counts)
        if gaps:
            self.itl.add(rec.model, rec.itl_counts, rec.itl_s * gaps)

    def set_costs(self, costs: dict[str, tuple[float, float]]) -> None:
        """Cost gauges, model -> (per 1M input, per 1M output tokens). A model with no
        price, or no such tokens in the window, has no series rather than a 0 that
        would claim its tokens were free."""
        for gauge, i in ((self.cost_input, 0), (self.cost_output, 1)):
            for model in self._costed[i] - {m for m, c in costs.items() if c[i] > 0}:
                gauge.remove(model)
            self._costed[i] = set()
            for model, c in costs.items():
                if c[i] > 0:
                    gauge.labels(model).set(c[i])
                    self._costed[i].add(model)

    def _model_series(self, model: str) -> "_ModelSeries":
        # `labels()` costs about as much as `observe()`; resolve each child once.
        s = _ModelSeries(**{f: getattr(self, f).labels(model) for f in _ModelSeries.__slots__})
        self._series[model] = s
        return s

    def observe_heartbeat(self, hb: Heartbeat, now: float) -> None:
        self.records.labels("heartbeat").inc()
        w, m = hb.worker_id, hb.model
        old = self._workers.get(w)
        if hb.state == "stopped":
            if old is not None:
                self._drop(w)
            return
        if old is not None and old.model != m:
            self._drop(w)
            old = None
        counted = old.counted if old is not None and old.model == m else (0,) * 6
        seen = self._workers[w] = _Seen(
            m, hb.state, now, hb.queue_depth, hb.device, hb.in_flight, hb.kind == "decoder",
            (hb.prefix_cache_queries, hb.prefix_cache_hits, hb.preemptions,
             hb.spec_decode_drafts, hb.spec_decode_draft_tokens,
             hb.spec_decode_accepted_tokens))
        self._models.add(m)
        self.w_queue.labels(w, m).set(hb.queue_depth)
        self.w_in_flight.labels(w, m).set(hb.in_flight)
        self.w_occupancy.labels(w, m).set(hb.batch_occupancy)
        self.w_rss.labels(w, m).set(hb.rss_bytes)
        # One heartbeat field each: a decoder's slots used, running and waiting are its
        # in flight and queue depth (0 for an encoder); its KV usage is blocks held / all.
        self.w_kv.labels(w, m).set(kv_usage(hb))
        self.w_slots.labels(w, m).set(seen.running)
        self.w_mem_used.labels(w, m).set(hb.mem_used_bytes)
        self.w_mem_limit.labels(w, m).set(hb.mem_limit_bytes)
        self.w_running.labels(w, m).set(seen.running)
        self.w_waiting.labels(w, m).set(seen.waiting)
        self.w_blocks.labels(w, m).set(hb.kv_blocks_total)
        # The worker reports totals since it started; the counters move by the change.
        for c, new, was in zip(self._worker_counters(), seen.counted, counted):
            c.labels(w, m).inc(max(new - was, 0))
        self._refresh_model(m)
        # `up` last: a scrape (another thread) that sees a worker up sees all of its
        # series and the fleet gauges that count it.
        if old is not None and old.state != hb.state:
            self.w_up.remove(w, old.model, old.state)
        self.w_up.labels(w, m, hb.state).set(1)

    def observe_scale(self, d: ScaleDecision, now: float) -> None:
        self.records.labels("scale").inc()
        self.decisions.observe(d, now)
        self._refresh_desired(d.model)

    def expire_decisions(self, now: float) -> None:
        """Forget the decisions of schedulers gone silent. A model whose last scheduler
        went keeps its last combined value: no scheduler is no reason to scale to 0."""
        for model in self.decisions.expire(now):
            if self.decisions.latest(model):
                self._refresh_desired(model)

    def _refresh_desired(self, model: str) -> None:
        self.m_desired.labels(model).set(self.decisions.desired(model))
        self.m_held.labels(model).set(self.decisions.held(model))
        self.m_batch_waiting.labels(model).set(self.decisions.batch_waiting(model))

    def expire_workers(self, now: float) -> list[str]:
        """Drop workers silent for longer than `expiry_s`; returns their ids."""
        gone = [w for w, s in self._workers.items() if now - s.last_seen > self.expiry_s]
        for w in gone:
            self._drop(w)
        return gone

    def workers(self) -> dict[str, str]:
        """Live worker id -> model."""
        return {w: s.model for w, s in self._workers.items()}

    def worker_devices(self) -> list[tuple[str, str]]:
        """(model, device) of every live worker."""
        return [(s.model, s.device) for s in self._workers.values()]

    def _drop(self, worker: str) -> None:
        seen = self._workers.pop(worker)
        for g in (self.w_queue, self.w_in_flight, self.w_occupancy, self.w_rss, self.w_kv,
                  self.w_slots, self.w_mem_used, self.w_mem_limit, self.w_running,
                  self.w_waiting, self.w_blocks, *self._worker_counters()):
            g.remove(worker, seen.model)
        self._refresh_model(seen.model)
        # `up` last: a scrape that no longer sees the worker sees none of its series
        # (it reads `up` first: _build_worker_metrics).
        self.w_up.remove(worker, seen.model, seen.state)

    def _worker_counters(self) -> tuple[Counter, ...]:
        """The per-worker counters, in `_Seen.counted`'s order."""
        return (self.w_prefix_queries, self.w_prefix_hits, self.w_preemptions,
                self.w_spec_drafts, self.w_spec_draft_tokens, self.w_spec_accepted)

    def _refresh_model(self, model: str) -> None:
        # Fleet gauges stay at 0 once every worker of a model is gone (KEDA reads 0,
        # not a missing series).
        live = [s for s in self._workers.values() if s.model == model]
        self.m_queue.labels(model).set(sum(s.queue_depth for s in live))
        self.m_running.labels(model).set(sum(s.running for s in live))
        self.m_waiting.labels(model).set(sum(s.waiting for s in live))
        self.m_ready.labels(model).set(sum(1 for s in live if s.state == "ready"))
