"""Schedules: when a workflow starts by the calendar or an interval, and what a missed fire does.

Pure: times are epoch seconds or aware datetimes, and nothing here sleeps or reads the clock.
The cron fields are parsed by cronsim on local wall-clock times without a zone; the DST rules
are ours (`_instant`): a local time that does not exist fires at the first valid instant after
the gap, and a local time that happens twice fires once, at its first occurrence.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from daemon.errors import ValidationError

Catchup = Literal["skip", "once", "all"]
Overlap = Literal["skip", "allow", "buffer_one", "cancel_other"]
CATCHUPS: tuple[str, ...] = get_args(Catchup)
OVERLAPS: tuple[str, ...] = get_args(Overlap)
#: The shortest interval `every=` accepts.
MIN_EVERY_S = 0.5
#: Missed fires counted one by one before the count stops (a cron firing every second, down a year).
COUNT_CAP = 10_000
#: Cron candidates skipped before giving up: the repeated hour of a fall-back holds 3,600 of a
#: seconds cron, each resolving to its (earlier) first occurrence.
_MAX_SKIPPED = 10_000


def _fail(name: object, message: str) -> ValidationError:
    return ValidationError(f"schedule {name!r}: {message}")


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class Schedule:
    """Starts a workflow type on a cron expression in a time zone, or every `every` seconds.

    `Schedule("nightly", "Backup", cron="30 2 * * *", tz="Europe/Berlin")` fires each day at
    02:30 Berlin time; `Schedule("tick", "Hello", every=30.0)` fires at every multiple of 30
    seconds since the Unix epoch. Invalid arguments raise ValidationError naming the schedule.
    """

    __slots__ = (
        "_zone",
        "catchup",
        "catchup_window_s",
        "cron",
        "every",
        "input",
        "jitter_s",
        "name",
        "overlap",
        "tz",
        "workflow",
    )

    def __init__(
        self,
        name: str,
        workflow: str,
        *,
        cron: str | None = None,
        every: float | None = None,
        tz: str = "UTC",
        input: dict[str, Any] | None = None,
        catchup: Catchup = "once",
        catchup_window_s: float = 86400.0,
        jitter_s: float = 0.0,
        overlap: Overlap = "skip",
    ) -> None:
        if not isinstance(name, str) or not name or not name.isprintable() or ":" in name:
            raise _fail(name, "the name must be non-empty printable text without ':'")
        if any(c.isspace() for c in name):
            raise _fail(name, "the name may not contain spaces")
        if not isinstance(workflow, str) or not workflow:
            raise _fail(name, "the workflow type must be a non-empty name")
        if (cron is None) == (every is None):
            raise _fail(name, "give exactly one of cron= and every=")
        if every is not None and (not _number(every) or every < MIN_EVERY_S):
            raise _fail(name, f"every= must be a number of seconds >= {MIN_EVERY_S}, not {every!r}")
        if not isinstance(tz, str):
            raise _fail(name, f"tz must be an IANA zone name, not {tz!r}")
        try:
            zone = ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError, OSError):
            raise _fail(
                name, f"unknown time zone {tz!r} (an IANA name like 'Europe/Berlin')"
            ) from None
        if every is not None and tz != "UTC":
            raise _fail(name, "tz applies to cron= only; every= counts seconds in UTC")
        if cron is not None:
            _check_cron(name, cron)
        if input is not None and not (
            isinstance(input, dict) and all(isinstance(k, str) for k in input)
        ):
            raise _fail(name, "input must be a dict of field names to values")
        if catchup not in CATCHUPS:
            raise _fail(name, f"catchup must be one of {', '.join(CATCHUPS)}, not {catchup!r}")
        if not _number(catchup_window_s) or catchup_window_s < 0:
            raise _fail(name, f"catchup_window_s must be a number >= 0, not {catchup_window_s!r}")
        if not _number(jitter_s) or jitter_s < 0:
            raise _fail(name, f"jitter_s must be a number >= 0, not {jitter_s!r}")
        if overlap not in OVERLAPS:
            raise _fail(name, f"overlap must be one of {', '.join(OVERLAPS)}, not {overlap!r}")
        self.name, self.workflow, self.tz = name, workflow, tz
        self.cron = " ".join(cron.split()) if cron is not None else None
        self.every = float(every) if every is not None else None
        self.input: dict[str, Any] = dict(input or {})
        self.catchup, self.catchup_window_s = catchup, float(catchup_window_s)
        self.jitter_s, self.overlap = float(jitter_s), overlap
        self._zone: tzinfo = UTC if tz == "UTC" else zone

    def fires_like(self, other: Schedule) -> bool:
        """Tell whether `other` fires as this one does: same times, workflow, input, policy."""
        return (
            self.name, self.workflow, self.tz, self.cron, self.every, self.jitter_s,
            self.overlap, self.catchup, self.catchup_window_s,
        ) == (
            other.name, other.workflow, other.tz, other.cron, other.every, other.jitter_s,
            other.overlap, other.catchup, other.catchup_window_s,
        ) and self.input == other.input  # fmt: skip

    def __repr__(self) -> str:
        return f"Schedule({self.name!r}, {self.workflow!r}, {self.spec!r}, tz={self.tz!r})"

    @property
    def spec(self) -> str:
        """Return the cron expression, or `every Ns`."""
        return self.cron if self.cron is not None else f"every {self.every:g}s"

    # -- nominal times ----------------------------------------------------------------------

    def next_fire(self, after: datetime) -> datetime:
        """Return the first nominal fire time strictly after `after` (aware), in UTC.

        Jitter delays the start of a fire, not its nominal time (the one in the workflow id).
        """
        if after.tzinfo is None or after.utcoffset() is None:
            raise ValueError("next_fire needs an aware datetime (say, with tzinfo=UTC)")
        at = self.next_nominal(after.timestamp())
        if math.isinf(at):
            raise ValueError(f"schedule {self.name!r} never fires after {after.isoformat()}")
        return datetime.fromtimestamp(at, UTC)

    def next_nominal(self, after: float) -> float:
        """Return the first nominal time strictly after `after` (epoch seconds; inf: never)."""
        if self.every is not None:
            k = math.floor(after / self.every) + 1
            while k * self.every <= after:
                k += 1
            while (k - 1) * self.every > after:
                k -= 1
            return k * self.every
        assert self.cron is not None
        # Whole seconds: cron times are, and a float a hair below one must not round past it.
        start = datetime.fromtimestamp(math.floor(after), self._zone).replace(tzinfo=None)
        candidates = CronSim(self.cron, start)
        for _ in range(_MAX_SKIPPED):
            try:
                at = _instant(next(candidates), self._zone)
            except StopIteration:  # cronsim looks 50 years ahead
                return math.inf
            if at > after:  # a candidate in the second pass of a repeated hour resolves earlier
                return at
        return math.inf

    def prev_nominal(self, before: float) -> float | None:
        """Return the last nominal time strictly before `before` (None: none in 50 years)."""
        if self.every is not None:
            k = math.ceil(before / self.every) - 1
            while k * self.every >= before:
                k -= 1
            while (k + 1) * self.every < before:
                k += 1
            return k * self.every
        assert self.cron is not None
        local = datetime.fromtimestamp(before, self._zone)
        start = local.replace(tzinfo=None)
        if local.fold:  # the second pass of a repeated hour: its first pass is earlier
            shift = local.replace(fold=0).utcoffset() or timedelta()
            start += shift - (local.utcoffset() or timedelta())
        candidates = CronSim(self.cron, start, reverse=True)
        for _ in range(_MAX_SKIPPED):
            try:
                at = _instant(next(candidates), self._zone)
            except StopIteration:
                return None
            if at < before:
                return at
        return None

    def count(self, after: float, before: float) -> tuple[int, bool]:
        """Count the nominal times strictly between `after` and `before`; True if capped."""
        if before <= after:
            return 0, False
        if self.every is not None:
            first, last = self.next_nominal(after), self.prev_nominal(before)
            if last is None or last < first:
                return 0, False
            return round((last - first) / self.every) + 1, False
        n, at = 0, self.next_nominal(after)
        while at < before:
            if n == COUNT_CAP:
                return n, True
            n, at = n + 1, self.next_nominal(at)
        return n, False

    def jitter(self, nominal: float) -> float:
        """Return the delay in [0, jitter_s) of the fire at `nominal`, the same every time."""
        if not self.jitter_s:
            return 0.0
        key = f"{self.name}\0{nominal:.3f}".encode()
        draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
        return self.jitter_s * draw / 2**64


def _check_cron(name: str, cron: object) -> None:
    if not isinstance(cron, str) or len(cron.split()) not in (5, 6):
        raise _fail(name, f"cron= takes 5 fields, or 6 with seconds first, not {cron!r}")
    try:
        next(CronSim(cron, datetime(2000, 1, 1)))
    except (CronSimError, StopIteration, ValueError, KeyError) as e:
        raise _fail(name, f"invalid cron {cron!r}: {e or 'it never fires'}") from None


def _instant(naive: datetime, zone: tzinfo) -> float:
    """Return the instant a local wall-clock time stands for, by our DST rules."""
    first = naive.replace(tzinfo=zone)  # fold=0: the first of a repeated time
    at = first.timestamp()
    if zone is UTC or datetime.fromtimestamp(at, zone).replace(tzinfo=None) == naive:
        return at
    # In a spring-forward gap: fold=1 reads it with the offset after the change, so it lands
    # before the transition, fold=0 after. The first valid instant after the gap is the
    # transition itself: the first whole second whose offset is the new one.
    lo, hi = math.floor(naive.replace(tzinfo=zone, fold=1).timestamp()), math.ceil(at)
    new = datetime.fromtimestamp(hi, zone).utcoffset()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, zone).utcoffset() == new:
            hi = mid
        else:
            lo = mid
    return float(hi)


def iso(at: float, *, millis: bool = False) -> str:
    """Return an epoch time as ISO 8601 UTC with a `Z`; milliseconds if asked or not whole."""
    t = datetime.fromtimestamp(at, UTC)
    if millis or t.microsecond:
        return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def workflow_id(name: str, nominal: float, at: str | None = None) -> str:
    """Return the id of the workflow a schedule starts for a nominal time (`at`: its `iso`)."""
    return f"{name}:{at or iso(nominal)}"


def manual_id(name: str, now: float) -> str:
    """Return the id of a workflow started by `schedule trigger` at `now`."""
    return f"{name}:manual:{iso(now, millis=True)}"


@dataclass(frozen=True, slots=True)
class Plan:
    """What a schedule does next: start `nominal` at `at`, give up missed times, or both."""

    #: The nominal time to start next; None when the plan only gives missed ones up.
    nominal: float | None
    #: When to start it (its nominal time plus jitter, or now for a catch-up).
    at: float
    #: Whether `nominal` was missed and is started late by the catch-up policy.
    catch_up: bool = False
    #: Missed nominal times that will never start, before `nominal` (or up to `given_up_until`).
    given_up: int = 0
    #: Whether `given_up` stopped counting at COUNT_CAP.
    capped: bool = False
    #: The newest nominal time given up when nothing starts (the schedule's new `last_nominal`).
    given_up_until: float | None = None


def plan(s: Schedule, *, last: float, now: float, live_since: float) -> Plan:
    """Decide what `s` does after `last` (every nominal time up to it is handled).

    A nominal time before `live_since` was missed: the daemon was stopped, the schedule paused,
    or the machine asleep then. Missed times follow `s.catchup`; the others start on time.
    """
    first = s.next_nominal(last)
    if first >= live_since:
        return Plan(first, first + s.jitter(first))
    newest = s.prev_nominal(live_since)
    assert newest is not None and newest >= first  # `first` itself is a candidate
    if s.catchup == "once" and now - newest <= s.catchup_window_s:
        n, capped = s.count(last, newest)
        return Plan(newest, now, catch_up=True, given_up=n, capped=capped)
    if s.catchup == "all":
        floor = now - s.catchup_window_s
        oldest = first if first >= floor else s.next_nominal(math.nextafter(floor, -math.inf))
        if oldest < live_since:
            n, capped = s.count(last, oldest)
            return Plan(oldest, now, catch_up=True, given_up=n, capped=capped)
    n, capped = s.count(last, newest)
    return Plan(None, now, given_up=n + 1, capped=capped, given_up_until=newest)
