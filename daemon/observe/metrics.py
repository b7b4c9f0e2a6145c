"""The daemon's Prometheus metrics: one `Metrics` object that the parts which count are given."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge, openmetrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

#: Step durations, in seconds: from a pure-Python step to a long sync one.
STEP_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0)
#: How late a timer fires, in seconds.
LATENESS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0)
#: One group commit, in seconds.
COMMIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
#: Writes per group commit.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CONTENT_TYPE = CONTENT_TYPE_LATEST
OPENMETRICS_TYPE = openmetrics.exposition.CONTENT_TYPE_LATEST


@dataclass(slots=True)
class _Hist:
    """One histogram child kept as plain numbers; exposed only when scraped."""

    counts: list[int]
    total: float = 0.0


@dataclass(slots=True)
class _StepTally:
    """Per-step counters without the library's per-call locks and label lookups.

    The step path runs once per step of every workflow; a dict lookup and two additions keep
    it well under the 2 µs budget (measured in tests/benchmarks/bench_metrics.py), where the
    library's labelled children cost about as much again.
    """

    steps: dict[tuple[str, str, str], int] = field(default_factory=dict)
    durations: dict[str, _Hist] = field(default_factory=dict)


class _StepCollector(Collector):
    def __init__(self, tally: _StepTally) -> None:
        self._tally = tally

    def collect(self) -> Iterator[Metric]:
        steps = CounterMetricFamily(
            "workflowd_steps", "Steps run, by outcome.", labels=("workflow", "step", "outcome")
        )
        for labels, n in sorted(dict(self._tally.steps).items()):
            steps.add_metric(labels, n)
        yield steps
        hist = HistogramMetricFamily(
            "workflowd_step_duration_seconds",
            "How long a step ran (slot wait included).",
            labels=("workflow",),
        )
        for wf, h in sorted(dict(self._tally.durations).items()):
            running, buckets = 0, []
            for bound, n in zip((*STEP_BUCKETS, float("inf")), h.counts, strict=True):
                running += n
                buckets.append((_bound(bound), float(running)))
            hist.add_metric((wf,), buckets, h.total)
        yield hist


def _bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


class _Counts(Collector):
    """A labelled counter kept as plain numbers on the loop, exposed only when scraped.

    The library's counter takes a lock per increment; the daemon counts on its event loop
    only (the writer's commits are reported back on it), so a dict of floats is enough.
    """

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        #: Label values -> [count, created (epoch seconds, as the library's child has)].
        self.values: dict[tuple[str, ...], list[float]] = {}

    def add(self, key: tuple[str, ...], n: float) -> None:
        """Add `n` to the child of those label values."""
        have = self.values.get(key)
        if have is None:
            self.values[key] = [float(n), time.time()]
        else:
            have[0] += n

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, (n, created) in list(self.values.items()):
            family.add_metric(key, n, created=created)
        yield family


class _Buckets(Collector):
    """An unlabelled histogram kept as plain numbers, exposed as the library's would be."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, buckets
        self._les = [_bound(b) for b in (*buckets, float("inf"))]
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        """Count one value into its bucket (a bound is inclusive, as `le` says)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def collect(self) -> Iterator[Metric]:
        family = Metric(self.name, self.doc, "histogram")
        running = 0
        for le, n in zip(self._les, list(self.counts), strict=True):
            running += n
            family.add_sample(self.name + "_bucket", {"le": le}, float(running))
        family.add_sample(self.name + "_count", {}, float(running))
        family.add_sample(self.name + "_sum", {}, self.total)
        family.add_sample(self.name + "_created", {}, self.created)
        yield family


class Metrics:
    """Every metric the daemon exposes at `/metrics`; counting costs the step path little.

    Gauges that a query answers better than counting does (workflows by status, the inbox,
    armed waits) are set from a snapshot just before each scrape (`set_snapshot`).
    """

    def __init__(self, version: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._tally = _StepTally()
        r.register(_StepCollector(self._tally))
        self._workflows = Gauge(
            "workflowd_workflows",
            "Workflows by type and status.",
            ("workflow", "status"),
            registry=r,
        )
        self._callbacks = _Counts(
            "workflowd_callbacks", "Callbacks (events) applied or refused.", ("outcome",)
        )
        r.register(self._callbacks)
        #: The callbacks' rows by outcome (the same lists): one lookup per callback.
        self._callback_rows: dict[str, list[float]] = {}
        self._waits = Gauge(
            "workflowd_waits_armed", "Waits armed now, by kind.", ("kind",), registry=r
        )
        self._lateness = _Buckets(
            "workflowd_timer_lateness_seconds",
            "How long after its deadline a timer fired.",
            LATENESS_BUCKETS,
        )
        r.register(self._lateness)
        self._commit = _Buckets(
            "workflowd_commit_duration_seconds", "How long one group commit took.", COMMIT_BUCKETS
        )
        r.register(self._commit)
        self._batch = _Buckets(
            "workflowd_commit_batch_size",
            "Writes committed together in one group commit.",
            tuple(float(b) for b in BATCH_BUCKETS),
        )
        r.register(self._batch)
        self._inbox = Gauge(
            "workflowd_inbox_depth", "Events acknowledged but not yet applied.", registry=r
        )
        self._fires = _Counts(
            "workflowd_schedule_fires", "Schedule fires by outcome.", ("schedule", "outcome")
        )
        r.register(self._fires)
        info = Gauge("workflowd_build_info", "The running version.", ("version",), registry=r)
        info.labels(version).set(1)
        self._shown: set[tuple[str, str]] = set()

    # -- the hot paths ----------------------------------------------------------------------

    def step(self, workflow: str, step: str, outcome: str, seconds: float) -> None:
        """Count one step run (`done`, `failed` or `cancelled`) and its duration."""
        t = self._tally
        key = (workflow, step, outcome)
        t.steps[key] = t.steps.get(key, 0) + 1
        h = t.durations.get(workflow)
        if h is None:
            h = t.durations[workflow] = _Hist([0] * (len(STEP_BUCKETS) + 1))
        h.counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        h.total += seconds

    def callback(self, outcome: str) -> None:
        """Count one callback: `applied` or `rejected`."""
        row = self._callback_rows.get(outcome)
        if row is None:
            self._callbacks.add((outcome,), 1)
            self._callback_rows[outcome] = self._callbacks.values[outcome,]
        else:
            row[0] += 1

    def timer_fired(self, late_s: float) -> None:
        """Note how late a timer fired."""
        self._lateness.observe(max(0.0, late_s))

    def timers_fired(self, lateness: list[float]) -> None:
        """Note how late each of a batch of fired timers fired (one call per batch)."""
        observe = self._lateness.observe
        for late_s in lateness:
            observe(max(0.0, late_s))

    def commit(self, seconds: float, writes: int) -> None:
        """Note one group commit."""
        self._commit.observe(seconds)
        self._batch.observe(writes)

    def schedule_fire(self, schedule: str, outcome: str, n: int = 1) -> None:
        """Count schedule fires: `fired`, `caught_up`, `manual`, `skipped`, `buffered`, `failed`."""
        self._fires.add((schedule, outcome), n)

    def schedule_fires(self, fires: list[tuple[str, str]]) -> None:
        """Count one fire each of many (schedule, outcome) pairs (one call for a batch)."""
        add = self._fires.add
        for key in fires:
            add(key, 1)

    # -- scraping ---------------------------------------------------------------------------

    def set_snapshot(
        self,
        *,
        workflows: Mapping[tuple[str, str], int],
        inbox: int,
        waits: Mapping[str, int],
    ) -> None:
        """Set the gauges a query answers: workflows by (type, status), the inbox, armed waits."""
        for key in self._shown - workflows.keys():
            self._workflows.labels(*key).set(0)  # gone to zero, not gone from the graph
        for key, n in workflows.items():
            self._workflows.labels(*key).set(n)
        self._shown |= set(workflows)
        self._inbox.set(inbox)
        for kind, n in waits.items():
            self._waits.labels(kind).set(n)

    def render(self, *, openmetrics_format: bool = False) -> bytes:
        """Return every metric in the Prometheus text format, or in OpenMetrics'."""
        if openmetrics_format:
            # The library leaves this one function without annotations.
            om: bytes = openmetrics.exposition.generate_latest(self.registry)  # type: ignore[no-untyped-call]
            return om
        return generate_latest(self.registry)
