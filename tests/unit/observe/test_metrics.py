"""The Metrics object: what each counting call adds to the exposition."""

from __future__ import annotations

from unittest import mock

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.observe.metrics import (
    BATCH_BUCKETS,
    COMMIT_BUCKETS,
    LATENESS_BUCKETS,
    STEP_BUCKETS,
    Metrics,
)


def _samples(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_steps_are_counted_by_outcome_with_a_histogram() -> None:
    """Each step adds to its counter and to its workflow's duration buckets, cumulatively."""
    m = Metrics("1.2.3")
    m.step("W", "a", "done", 0.0001)
    m.step("W", "a", "done", 0.002)
    m.step("W", "b", "failed", 1000.0)
    found = _samples(m)
    label = frozenset({("workflow", "W"), ("step", "a"), ("outcome", "done")})
    assert found[("workflowd_steps_total", label)] == 2
    w = ("workflow", "W")
    assert found[("workflowd_step_duration_seconds_count", frozenset({w}))] == 3
    assert found[("workflowd_step_duration_seconds_sum", frozenset({w}))] > 1000
    first = frozenset({w, ("le", repr(STEP_BUCKETS[0]))})
    assert found[("workflowd_step_duration_seconds_bucket", first)] == 1
    assert found[("workflowd_step_duration_seconds_bucket", frozenset({w, ("le", "+Inf")}))] == 3
    assert found[("workflowd_build_info", frozenset({("version", "1.2.3")}))] == 1


def test_snapshot_sets_gauges_and_zeroes_the_gone() -> None:
    """A (type, status) pair that drops out of a later snapshot reads 0, not its old value."""
    m = Metrics()
    m.set_snapshot(workflows={("W", "Waiting"): 3}, inbox=2, waits={"timer": 1, "listener": 0})
    m.set_snapshot(workflows={("W", "Finished"): 3}, inbox=0, waits={"timer": 0, "listener": 0})
    found = _samples(m)
    gone = frozenset({("workflow", "W"), ("status", "Waiting")})
    assert found[("workflowd_workflows", gone)] == 0
    done = frozenset({("workflow", "W"), ("status", "Finished")})
    assert found[("workflowd_workflows", done)] == 3
    assert found[("workflowd_inbox_depth", frozenset())] == 0


def test_other_counters() -> None:
    """Callbacks, timer lateness (never negative), commits and schedule fires."""
    m = Metrics()
    m.callback("applied")
    m.timer_fired(-0.5)  # a clock step: counted as on time
    m.commit(0.001, 7)
    m.schedule_fire("nightly", "skipped", 3)
    found = _samples(m)
    assert found[("workflowd_callbacks_total", frozenset({("outcome", "applied")}))] == 1
    assert found[("workflowd_timer_lateness_seconds_sum", frozenset())] == 0
    assert found[("workflowd_commit_batch_size_sum", frozenset())] == 7
    fires = frozenset({("schedule", "nightly"), ("outcome", "skipped")})
    assert found[("workflowd_schedule_fires_total", fires)] == 3


def test_plain_counters_render_as_the_library_would() -> None:
    """The counters kept as plain numbers expose the library's names, values and order."""
    with mock.patch("time.time", return_value=1_700_000_000.0):
        m = Metrics()
        r = CollectorRegistry(auto_describe=True)
        callbacks = Counter(
            "workflowd_callbacks",
            "Callbacks (events) applied or refused.",
            ("outcome",),
            registry=r,
        )
        lateness = Histogram(
            "workflowd_timer_lateness_seconds",
            "How long after its deadline a timer fired.",
            buckets=LATENESS_BUCKETS,
            registry=r,
        )
        commit = Histogram(
            "workflowd_commit_duration_seconds",
            "How long one group commit took.",
            buckets=COMMIT_BUCKETS,
            registry=r,
        )
        batch = Histogram(
            "workflowd_commit_batch_size",
            "Writes committed together in one group commit.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        fires = Counter(
            "workflowd_schedule_fires",
            "Schedule fires by outcome.",
            ("schedule", "outcome"),
            registry=r,
        )
        for outcome in ("applied", "rejected", "applied"):
            m.callback(outcome)
            callbacks.labels(outcome).inc()
        late = [-0.5, 0.0004, 0.001, 0.3, 400.0]
        m.timers_fired(late[:2])
        for x in late[2:]:
            m.timer_fired(x)
        for x in late:
            lateness.observe(max(x, 0.0))
        for seconds, writes in ((0.001, 7), (0.00005, 1), (2.0, 3000)):
            m.commit(seconds, writes)
            commit.observe(seconds)
            batch.observe(writes)
        for schedule, outcome, n in (("b", "skipped", 3), ("b", "fired", 1), ("a", "fired", 2)):
            m.schedule_fire(schedule, outcome, n)
            fires.labels(schedule, outcome).inc(n)
        m.schedule_fires([("a", "fired"), ("c", "fired")])
        fires.labels("a", "fired").inc()
        fires.labels("c", "fired").inc()
        ours = m.render().decode()
        theirs = generate_latest(r).decode()
    for family in theirs.split("# HELP ")[1:]:
        assert "# HELP " + family in ours
