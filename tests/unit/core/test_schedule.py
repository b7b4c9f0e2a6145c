"""Schedule: validation, next_fire across DST changes, jitter, ids and the catch-up plan."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from daemon import Schedule, ValidationError
from daemon.core.schedule import COUNT_CAP, iso, manual_id, plan, workflow_id


def utc(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> datetime:
    """Return an aware UTC datetime."""
    return datetime(y, mo, d, h, mi, s, tzinfo=UTC)


def fires(s: Schedule, after: datetime, n: int) -> list[datetime]:
    """Return the next `n` fires of `s` after `after`, by repeated next_fire."""
    out = []
    for _ in range(n):
        after = s.next_fire(after)
        out.append(after)
    return out


def ts(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> float:
    """Return a UTC time as epoch seconds."""
    return utc(y, mo, d, h, mi, s).timestamp()


class TestBerlin:
    """Europe/Berlin: CET (+1) / CEST (+2); 2024 changes on 31 March and 27 October."""

    def test_daily_across_spring_forward(self) -> None:
        """02:30 does not exist on 31 March: it fires at 03:00 CEST, the end of the gap."""
        s = Schedule("nightly", "Backup", cron="30 2 * * *", tz="Europe/Berlin")
        assert fires(s, utc(2024, 3, 29, 12), 3) == [
            utc(2024, 3, 30, 1, 30),  # 02:30 CET
            utc(2024, 3, 31, 1, 0),  # 03:00 CEST: the first valid instant after the gap
            utc(2024, 4, 1, 0, 30),  # 02:30 CEST
        ]

    def test_daily_across_fall_back(self) -> None:
        """02:30 happens twice on 27 October: it fires once, at the first (CEST) one."""
        s = Schedule("nightly", "Backup", cron="30 2 * * *", tz="Europe/Berlin")
        assert fires(s, utc(2024, 10, 25, 12), 3) == [
            utc(2024, 10, 26, 0, 30),  # 02:30 CEST
            utc(2024, 10, 27, 0, 30),  # the first 02:30 (CEST), not the second (01:30 UTC)
            utc(2024, 10, 28, 1, 30),  # 02:30 CET
        ]

    def test_every_quarter_hour_in_the_gap_fires_once(self) -> None:
        """All of 02:00-02:45 are missing on spring-forward day: they make one fire, at 03:00."""
        s = Schedule("q", "Backup", cron="*/15 * * * *", tz="Europe/Berlin")
        assert fires(s, utc(2024, 3, 31, 0, 40), 4) == [
            utc(2024, 3, 31, 0, 45),  # 01:45 CET
            utc(2024, 3, 31, 1, 0),  # 03:00 CEST (02:00-02:45 collapsed into it)
            utc(2024, 3, 31, 1, 15),  # 03:15 CEST
            utc(2024, 3, 31, 1, 30),
        ]

    def test_every_quarter_hour_in_the_repeated_hour_fires_once_each(self) -> None:
        """In the repeated 02:00-02:59 only the first pass fires."""
        s = Schedule("q", "Backup", cron="*/15 * * * *", tz="Europe/Berlin")
        assert fires(s, utc(2024, 10, 27, 0, 40), 3) == [
            utc(2024, 10, 27, 0, 45),  # 02:45 CEST (first pass)
            utc(2024, 10, 27, 2, 0),  # 03:00 CET: the second pass of 02:xx fires nothing
            utc(2024, 10, 27, 2, 15),
        ]

    def test_after_inside_the_second_pass(self) -> None:
        """Asked from inside the second 02:xx, the next fire is after it, not its first pass."""
        s = Schedule("q", "Backup", cron="*/15 * * * *", tz="Europe/Berlin")
        assert s.next_fire(utc(2024, 10, 27, 1, 10)) == utc(2024, 10, 27, 2, 0)
        # and looking back from there finds the first pass's last fire
        assert s.prev_nominal(ts(2024, 10, 27, 1, 10)) == ts(2024, 10, 27, 0, 45)

    def test_seconds_field(self) -> None:
        """Six fields: seconds first."""
        s = Schedule("s", "Backup", cron="*/20 * * * * *", tz="Europe/Berlin")
        assert fires(s, utc(2024, 1, 1, 0, 0, 5), 3) == [
            utc(2024, 1, 1, 0, 0, 20),
            utc(2024, 1, 1, 0, 0, 40),
            utc(2024, 1, 1, 0, 1, 0),
        ]


class TestNewYork:
    """America/New_York: EST (-5) / EDT (-4); 2024 changes on 10 March and 3 November."""

    def test_spring_forward(self) -> None:
        """02:30 does not exist on 10 March: 03:00 EDT; 01:30 is untouched."""
        s = Schedule("ny", "Backup", cron="30 2 * * *", tz="America/New_York")
        assert fires(s, utc(2024, 3, 8, 12), 3) == [
            utc(2024, 3, 9, 7, 30),  # 02:30 EST
            utc(2024, 3, 10, 7, 0),  # 03:00 EDT
            utc(2024, 3, 11, 6, 30),  # 02:30 EDT
        ]
        early = Schedule("ny1", "Backup", cron="30 1 * * *", tz="America/New_York")
        assert early.next_fire(utc(2024, 3, 10, 0)) == utc(2024, 3, 10, 6, 30)

    def test_fall_back(self) -> None:
        """01:30 happens twice on 3 November: once, at 01:30 EDT."""
        s = Schedule("ny", "Backup", cron="30 1 * * *", tz="America/New_York")
        assert fires(s, utc(2024, 11, 1, 12), 3) == [
            utc(2024, 11, 2, 5, 30),  # 01:30 EDT
            utc(2024, 11, 3, 5, 30),  # the first 01:30 (EDT); not 06:30 UTC (EST)
            utc(2024, 11, 4, 6, 30),  # 01:30 EST
        ]

    def test_hourly_never_repeats_nor_skips_an_instant(self) -> None:
        """Hourly fires across both changes are strictly increasing and an hour or less apart."""
        s = Schedule("h", "Backup", cron="0 * * * *", tz="America/New_York")
        for start in (utc(2024, 3, 10, 4), utc(2024, 11, 3, 3)):
            got = fires(s, start, 6)
            gaps = [(b - a).total_seconds() for a, b in zip([start, *got], got, strict=False)]
            assert all(0 < g <= 7200 for g in gaps), got
            assert len(set(got)) == len(got)


class TestEvery:
    """Intervals count from the Unix epoch, in UTC."""

    def test_multiples_of_the_interval(self) -> None:
        """every=30 fires at :00 and :30 of each minute, strictly after `after`."""
        s = Schedule("tick", "Hello", every=30.0)
        assert s.next_fire(utc(2024, 1, 1, 0, 0, 0)) == utc(2024, 1, 1, 0, 0, 30)
        assert s.next_fire(utc(2024, 1, 1, 0, 0, 29)) == utc(2024, 1, 1, 0, 0, 30)

    def test_half_second(self) -> None:
        """every=0.5 is the minimum; its ids stay distinct (milliseconds when not whole)."""
        s = Schedule("fast", "Hello", every=0.5)
        assert s.next_nominal(10.2) == 10.5
        assert s.prev_nominal(10.5) == 10.0
        assert s.count(10.0, 13.0) == (5, False)
        assert workflow_id("fast", 10.0) == "fast:1970-01-01T00:00:10Z"
        assert workflow_id("fast", 10.5) == "fast:1970-01-01T00:00:10.500Z"

    def test_next_fire_needs_an_aware_datetime(self) -> None:
        """A naive datetime is refused rather than guessed."""
        with pytest.raises(ValueError, match="aware"):
            Schedule("tick", "Hello", every=1).next_fire(datetime(2024, 1, 1))


class TestIds:
    """Workflow ids of fires."""

    def test_nominal_id_is_iso_utc_seconds(self) -> None:
        """`<schedule>:<nominal time, ISO 8601 UTC, seconds>`."""
        at = ts(2026, 12, 2, 1, 30)
        assert workflow_id("nightly-backup", at) == "nightly-backup:2026-12-02T01:30:00Z"
        assert iso(at) == "2026-12-02T01:30:00Z"

    def test_manual_id(self) -> None:
        """`<schedule>:manual:<ISO now>`, to the millisecond so two triggers differ."""
        assert manual_id("tick", ts(2026, 1, 2, 3, 4, 5) + 0.25) == (
            "tick:manual:2026-01-02T03:04:05.250Z"
        )


class TestValidation:
    """A bad schedule raises ValidationError naming it."""

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"cron": "* * *"}, "5 fields"),
            ({"cron": "61 * * * *"}, "invalid cron"),
            ({"cron": "0 0 31 2 *"}, "invalid cron"),
            ({"cron": "* * * * *", "every": 1.0}, "exactly one"),
            ({}, "exactly one"),
            ({"every": 0.1}, ">= 0.5"),
            ({"every": True}, ">= 0.5"),
            ({"cron": "* * * * *", "tz": "Mars/Olympus"}, "unknown time zone"),
            ({"cron": "* * * * *", "tz": "../../etc/passwd"}, "unknown time zone"),
            ({"every": 5, "tz": "Europe/Berlin"}, "tz applies to cron"),
            ({"every": 5, "catchup": "some"}, "catchup must be"),
            ({"every": 5, "overlap": "queue"}, "overlap must be"),
            ({"every": 5, "jitter_s": -1}, "jitter_s"),
            ({"every": 5, "catchup_window_s": float("nan")}, "catchup_window_s"),
            ({"every": 5, "input": ["x"]}, "input must be"),
        ],
    )
    def test_refused(self, kwargs: dict[str, Any], message: str) -> None:
        """Each bad argument is named in the error."""
        with pytest.raises(ValidationError, match=message) as e:
            Schedule("bad-one", "Hello", **kwargs)
        assert "schedule 'bad-one'" in str(e.value)

    @pytest.mark.parametrize("name", ["", "a b", "a:b", "tab\there"])
    def test_bad_names(self, name: str) -> None:
        """The name goes into workflow ids: no ':' or spaces."""
        with pytest.raises(ValidationError):
            Schedule(name, "Hello", every=1)

    def test_spec(self) -> None:
        """`spec` is what `schedule list` shows."""
        assert Schedule("a", "W", cron="30  2 * * *").spec == "30 2 * * *"
        assert Schedule("b", "W", every=30).spec == "every 30s"


class TestJitter:
    """Jitter is fixed per schedule and nominal time."""

    def test_in_range_and_stable(self) -> None:
        """Each delay is in [0, jitter_s) and the same on every call (and every restart)."""
        s = Schedule("j", "W", every=60, jitter_s=30)
        delays = [s.jitter(60.0 * k) for k in range(200)]
        assert all(0 <= d < 30 for d in delays)
        assert delays == [
            Schedule("j", "W", every=60, jitter_s=30).jitter(60.0 * k) for k in range(200)
        ]
        assert len(set(delays)) > 150  # spread, not one constant
        assert Schedule("other", "W", every=60, jitter_s=30).jitter(0.0) != delays[0]

    def test_none_by_default(self) -> None:
        """No jitter_s, no delay."""
        assert Schedule("n", "W", every=60).jitter(120.0) == 0.0


class TestPlan:
    """The catch-up arithmetic: what happens after the schedule was not watched for a while."""

    def every(self, catchup: str, window: float = 86400.0) -> Schedule:
        """A 10-second schedule with the given catch-up policy."""
        return Schedule("t", "W", every=10, catchup=catchup, catchup_window_s=window)  # type: ignore[arg-type]

    def test_on_time(self) -> None:
        """Nothing missed: the next nominal time, at its time."""
        p = plan(self.every("once"), last=100.0, now=101.0, live_since=50.0)
        assert (p.nominal, p.at, p.catch_up, p.given_up) == (110.0, 110.0, False, 0)

    def test_on_time_with_jitter(self) -> None:
        """Jitter delays the start, not the nominal time."""
        s = Schedule("t", "W", every=10, jitter_s=5)
        p = plan(s, last=100.0, now=101.0, live_since=50.0)
        assert p.nominal == 110.0 and p.at == 110.0 + s.jitter(110.0)

    def test_skip(self) -> None:
        """skip: every missed time is given up; last_nominal moves to the newest of them."""
        p = plan(self.every("skip"), last=100.0, now=165.0, live_since=165.0)
        assert (p.nominal, p.given_up, p.given_up_until) == (None, 6, 160.0)
        after = plan(self.every("skip"), last=160.0, now=165.0, live_since=165.0)
        assert (after.nominal, after.catch_up) == (170.0, False)

    def test_once(self) -> None:
        """once: the newest missed time starts now; the older ones are given up."""
        p = plan(self.every("once"), last=100.0, now=165.0, live_since=165.0)
        assert (p.nominal, p.at, p.catch_up, p.given_up) == (160.0, 165.0, True, 5)

    def test_once_outside_the_window(self) -> None:
        """once: a missed time older than catchup_window_s is never caught up."""
        p = plan(self.every("once", window=3.0), last=100.0, now=165.0, live_since=165.0)
        assert (p.nominal, p.given_up, p.given_up_until) == (None, 6, 160.0)

    def test_all_in_order(self) -> None:
        """all: one plan per missed time, oldest first."""
        s = self.every("all")
        started = []
        last = 100.0
        while True:
            p = plan(s, last=last, now=165.0, live_since=165.0)
            if not p.catch_up:
                break
            assert p.nominal is not None and p.given_up == 0
            started.append(p.nominal)
            last = p.nominal
        assert started == [110.0, 120.0, 130.0, 140.0, 150.0, 160.0]

    def test_all_inside_the_window_only(self) -> None:
        """all: times older than the window are given up, the rest caught up."""
        p = plan(self.every("all", window=25.0), last=100.0, now=165.0, live_since=165.0)
        assert (p.nominal, p.catch_up, p.given_up) == (140.0, True, 3)

    def test_clock_backward_never_repeats(self) -> None:
        """With the clock behind last_nominal, the next fire is still after last_nominal."""
        p = plan(self.every("all"), last=1000.0, now=500.0, live_since=400.0)
        assert p.nominal == 1010.0 and p.at == 1010.0

    def test_count_is_capped(self) -> None:
        """A seconds cron down for a long time counts up to COUNT_CAP, then says so."""
        s = Schedule("c", "W", cron="* * * * * *", catchup="skip")
        p = plan(s, last=0.0, now=COUNT_CAP * 3.0, live_since=COUNT_CAP * 3.0)
        assert p.nominal is None and p.capped and p.given_up == COUNT_CAP + 1

    def test_cron_catch_up_across_a_dst_change(self) -> None:
        """once over the Berlin spring-forward night starts the gap-shifted 03:00 CEST fire."""
        s = Schedule("n", "W", cron="30 2 * * *", tz="Europe/Berlin", catchup="once")
        now = ts(2024, 3, 31, 6)
        p = plan(s, last=ts(2024, 3, 28, 12), now=now, live_since=now)
        assert (p.nominal, p.given_up) == (ts(2024, 3, 31, 1, 0), 2)
