"""workflowd: load the config, recover every workflow, serve the control socket until stopped."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import structlog

from daemon.control.dispatch import version
from daemon.control.server import Server, serve
from daemon.control.sockfile import listener_from_systemd
from daemon.core.schedule import Schedule
from daemon.core.workflow import Workflow
from daemon.errors import ConfigError, StoreLocked, StoreUnusable, Unavailable, ValidationError
from daemon.http.dashboard import Dashboard
from daemon.http.scrape import metrics_handler
from daemon.http.server import listening, serve_http
from daemon.http.token import load_token
from daemon.identity import refuse_foreign
from daemon.observe.hooks import HookRow, Hooks, HookSettings
from daemon.observe.metrics import Metrics
from daemon.ops.backup import BackupPolicy, Backups
from daemon.ops.modules import load_registry, schedules_of
from daemon.ops.reload import Reloader, settings_of
from daemon.ops.repairs import Repairs
from daemon.runtime.cache import Cache
from daemon.runtime.fires import BatchStart
from daemon.runtime.runtime import Runtime
from daemon.runtime.schedules import Schedules
from daemon.runtime.steps import ABANDONED
from daemon.runtime.supervise import supervise
from daemon.service.config import Config, load_config
from daemon.service.gcwatch import LOOK_S, NEVER, GcWatch, QuietCollector
from daemon.service.journal import JOURNAL_SOCKET
from daemon.service.journal import attached as journal_attached
from daemon.service.log import LogHub, close_logging, configure_logging
from daemon.service.notify import Notifier, watchdog_loop
from daemon.store.base import Store
from daemon.store.postgres import PostgresStore
from daemon.store.postgres_schema import redact
from daemon.store.schema import FINAL, make_folder
from daemon.store.sqlite import SQLiteStore

log = structlog.get_logger()
STATUS_EVERY_S = 1.0
#: How long, at shutdown, answers still being written may take.
ANSWER_GRACE_S = 1.0
#: Allocations between young-generation collections (CPython's default is 700).
GC_THRESHOLD = 10_000
#: gc.set_threshold's three figures. A middle collection every 3rd young one (not 11th)
#: scans a third of the survivors at a time, and a full one waits for 50 of those: in the
#: 10,000-timer burst the longest pause went from 150-650 ms of CPU (middle and full
#: collections) to 50-80 ms, for the same total (README, "Garbage collection"). The full
#: one runs at a quiet moment (`QuietCollector`), not where CPython's count lands.
GC_THRESHOLDS = (GC_THRESHOLD, 2, 50)


class DaemonOps:
    """The control socket's `reload` and `backup`, and the nodes `ping` and `show` name."""

    def __init__(self, reloader: Reloader, backups: Backups, store: Store) -> None:
        self.reloader, self.backups, self.store = reloader, backups, store
        # On PostgreSQL every daemon runs its share (`show` names each workflow's owner).
        self.node_id = store.node_id if isinstance(store, PostgresStore) else _hostname()

    async def nodes(self) -> list[dict[str, Any]]:
        """List the daemons on this database, the leader first."""
        if isinstance(self.store, PostgresStore):
            found = await self.store.nodes()
            return sorted(found, key=lambda n: n["role"] != "leader")
        return [{"node_id": self.node_id, "role": "holder", "seen_s_ago": 0.0}]

    def owner(self, status: str) -> str | None:
        """Name the node that runs a workflow in `status` (none once it ended)."""
        return None if status in FINAL else self.node_id

    def role(self) -> str:
        """Say what this daemon is to `ping`: on PostgreSQL the leader or a member."""
        if isinstance(self.store, PostgresStore):
            return "leader" if self.store.leads() else "member"
        return "holder"

    async def reload(self) -> dict[str, Any]:
        """Reload as SIGHUP does."""
        return await self.reloader.reload()

    async def backup(self, name: str) -> dict[str, Any]:
        """Copy the database to `<[store] backup_dir>/<name>.db` (SQLite only)."""
        if isinstance(self.store, PostgresStore):
            await self.store.backup(Path(name))  # refuses, naming pg_dump
        return await self.backups.backup(name)


class LeaderQueue:
    """The hook queue of a shared database as the hook runner sees it: empty but on the leader.

    Hooks are a singleton duty: only the daemon holding the leader row runs them (it is woken
    by every ending, on any daemon); a new leader takes up the endings whose hooks had not run.
    """

    def __init__(self, store: PostgresStore) -> None:
        self._store = store

    async def hooks_pending(self, *, after: int = 0, limit: int = 100) -> list[HookRow]:
        """Return the queued endings, or none if another daemon leads."""
        if not self._store.leads():
            return []
        return await self._store.hooks_pending(after=after, limit=limit)

    async def hook_claim(self, hook_id: int) -> None:
        """Mark an ending's hook as started."""
        await self._store.hook_claim(hook_id)

    async def hooks_done(self, hook_ids: Sequence[int]) -> None:
        """Forget endings whose hooks ran."""
        await self._store.hooks_done(hook_ids)

    async def add_history(self, workflow_id: str, kind: str, detail: dict[str, Any]) -> None:
        """Append one history entry to a workflow."""
        await self._store.add_history(workflow_id, kind, detail)


def backup_policy(cfg: Config) -> BackupPolicy:
    """Map the `[store]` backup keys onto the backup policy."""
    s = cfg.store
    return BackupPolicy(dir=s.backups, keep=s.backup_keep, min_free_bytes=s.min_free_bytes)


async def run_daemon(
    cfg: Config,
    registry: dict[str, type[Workflow]],
    hub: LogHub | None = None,
    *,
    hold: bool = False,
    schedules: Mapping[str, Schedule] | None = None,
    gc_watch: GcWatch | None = None,
    quiet_gc: QuietCollector | None = None,
    task_status: anyio.abc.TaskStatus[Runtime] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon until SIGTERM/SIGINT; reports readiness once recovered and listening.

    With `hold`, no workflow runs until `workflowctl resume-all` (or `resume ID`).
    """
    notifier = Notifier.from_env(unset=True)
    metrics = Metrics(version())
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with (
            # Bound first: an address that cannot be bound stops the start, before READY.
            listening(cfg.metrics.listen) as scrape_on,
            listening(cfg.http.listen) as dashboard_on,
            open_store(cfg, metrics) as store,
            _dashboard_token(dashboard_on, cfg.store.path.parent) as token,
            Runtime.open(
                store,
                registry,
                replace(settings_of(cfg), hold=hold),
                logs=hub,
                metrics=metrics,
                shared=store if isinstance(store, PostgresStore) else None,
                lease_s=cfg.store.lease_s,
            ) as rt,
            anyio.create_task_group() as tg,
        ):
            d = cfg.daemon
            reloader = Reloader(
                cfg,
                store=store,
                cache=rt.cache,
                running=rt.scheduler.running,
                unfit=rt.unfit,
                configure=rt.configure,
                refit=rt.refit,
                notifier=notifier,
            )
            repairs = Repairs(
                store=store,
                cache=rt.cache,
                scheduler=rt.scheduler,
                arms=rt.arms,
                recover=rt.recover_one,
                gc=rt.gc,
                keep_days=lambda: rt.settings.keep_finished_days,
                deadline=rt.deadlines.add,
                now=rt.clock.now,
            )
            timetable = Schedules(
                store=store,
                clock=rt.clock,
                start=rt.start,
                cancel=rt.cancel,
                status=rt.status_of,
                running=rt.scheduler.running,
                held=lambda: rt.scheduler.hold.held,
                schedules=schedules,
                metrics=metrics,
                batch=BatchStart(
                    rt.prepare_many, rt.launch_many, rt.release, rt.withdraw, rt.hold_turns
                ),
            )
            hooks = Hooks(
                queue=LeaderQueue(store) if isinstance(store, PostgresStore) else store,
                settings=lambda: hook_settings(reloader.cfg),
                of_type=partial(_type_hook, rt.cache),
            )
            rt.on_ended = hooks.wake
            tg.start_soon(hooks.run, tg)
            if scrape_on is not None:
                scrape = metrics_handler(metrics, gauges=store, waits=rt.arms.kinds)
                tg.start_soon(partial(serve_http, scrape_on, scrape, name="metrics"))
            if dashboard_on is not None:
                dashboard = Dashboard(
                    token=token,
                    workflows=rt,
                    tools=repairs,
                    timetable=timetable,
                    types=lambda: sorted(rt.cache.registry),
                )
                tg.start_soon(partial(serve_http, dashboard_on, dashboard, name="dashboard"))
            rt.on_exit = timetable.workflow_exited
            reloader.on_schedules = timetable.configure
            firing = anyio.CancelScope()

            async def run_schedules(*, task_status: anyio.abc.TaskStatus[None]) -> None:
                with firing:
                    await timetable.run(task_status=task_status)

            await tg.start(run_schedules)
            # Everything recovery and the schedules loaded (re-armed waits, cached workflows,
            # 10,000 schedules' entries) lives long: keep the cyclic GC from rescanning it on
            # every full collection.
            gc.freeze()
            listener = await listener_from_systemd()
            serve_control = partial(
                serve,
                rt,
                socket_path=None if listener else d.socket,
                listener=listener,
                socket_mode=d.socket_mode,
                socket_group=d.socket_group,
                allowed_uids=d.allowed_uids,
                allowed_groups=d.allowed_groups,
                max_request_bytes=d.max_request_bytes,
                max_connections=d.max_connections,
                idle_timeout=d.idle_timeout_s,
                max_in_flight=d.max_in_flight,
                max_buffered_bytes=d.max_buffered_bytes,
                repairs=repairs,
                ops=DaemonOps(
                    reloader,
                    Backups(store=store, policy=lambda: backup_policy(reloader.cfg)),
                    store,
                ),
                schedules=timetable,
                dashboard=partial(dashboard_url, cfg.http.listen, token),
            )
            control = anyio.CancelScope()

            async def run_control(*, task_status: anyio.abc.TaskStatus[Any]) -> None:
                with control:
                    await serve_control(task_status=task_status)

            server = await tg.start(run_control)
            reloader.on_config = partial(_configure_control, server)
            tg.start_soon(watchdog_loop, notifier)
            tg.start_soon(_report_status, rt, notifier)
            leads = store.leads if isinstance(store, PostgresStore) else lambda: True
            tg.start_soon(_collect_garbage, rt, reloader, leads)
            if gc_watch is not None:
                tg.start_soon(_report_gc_pauses, gc_watch)
            if quiet_gc is not None:
                due = (rt.arms.next_due, rt.deadlines.next_due)
                quiet_gc.until_due = partial(_until_due, rt.clock.now, *due)
                quiet_gc.in_flight = rt.busy
                tg.start_soon(_collect_when_quiet, quiet_gc)
            log.info("daemon_started", pid=os.getpid(), socket=str(d.socket), db=store_name(cfg))
            notifier.ready()
            task_status.started(rt)
            async for signum in signals:
                if signum == signal.SIGHUP:
                    await reloader.reload()
                    continue
                break
            log.info("daemon_stopping", signal=signal.Signals(signum).name)
            notifier.stopping()
            firing.cancel()  # no schedule starts a workflow once shutdown began
            # The socket stays open while steps finish, so requests get `unavailable` rather
            # than a hang-up; then the answers still in flight are written out.
            with anyio.CancelScope() as drain:
                tg.start_soon(_second_signal, signals, drain)
                finished = await rt.drain(reloader.cfg.daemon.shutdown_grace_s)
                await server.wind_down(ANSWER_GRACE_S)
                if gc_watch is not None:
                    # What is left is counted too (`collected`): the interpreter's exit would
                    # run this collection anyway.
                    gc_watch.collect_rest()
                    _log_gc_pauses(gc_watch)
                    log.info("gc_stats", **gc_watch.summary())
                log.info("daemon_stopped", steps_finished=finished)
            control.cancel()
            tg.cancel_scope.cancel()
    # Leaving the receiver put the default handlers back, and the default for SIGTERM ends the
    # process at once: a second stop request during the last steps of exiting (a supervisor
    # repeating its SIGTERM) would turn a clean exit 0 into death by signal.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    notifier.close()


def _hostname() -> str:
    return socket.gethostname()


def open_store(
    cfg: Config, metrics: Metrics | None = None
) -> AbstractAsyncContextManager[SQLiteStore | PostgresStore]:
    """Open the configured backend: the SQLite file, or the PostgreSQL database."""
    s = cfg.store
    if s.backend == "postgres":
        return PostgresStore.open(
            s.dsn,
            passfile=s.passfile,
            history_keep=s.history_keep,
            node_id=s.node_id,
            lease_s=s.lease_s,
            pin_timeout_s=s.pin_timeout_s,
            metrics=metrics,
        )
    return SQLiteStore.open(
        s.path, synchronous=s.synchronous, history_keep=s.history_keep, metrics=metrics
    )


def store_name(cfg: Config) -> str:
    """Name the configured database for a log record, without a password."""
    return redact(cfg.store.dsn) if cfg.store.backend == "postgres" else str(cfg.store.path)


async def _second_signal(signals: AsyncIterator[int], drain: anyio.CancelScope) -> None:
    async for signum in signals:
        log.warning("daemon_stopping_now", signal=signal.Signals(signum).name)
        drain.cancel()
        return


def _configure_control(control: Server, cfg: Config) -> None:
    d = cfg.daemon
    control.configure(
        allowed_uids=d.allowed_uids,
        allowed_groups=d.allowed_groups,
        max_request_bytes=d.max_request_bytes,
        max_connections=d.max_connections,
        idle_timeout=d.idle_timeout_s,
        max_in_flight=d.max_in_flight,
        max_buffered_bytes=d.max_buffered_bytes,
    )


@asynccontextmanager
async def _dashboard_token(listener: object, folder: Path) -> AsyncIterator[str]:
    """Yield the dashboard's token ("" when it is off); a bad token file stops the start."""
    # A context of the start-up chain, not a call inside the task group: there an error
    # would come out wrapped in an ExceptionGroup instead of as one line and exit code 2.
    if listener is not None:
        make_folder(folder)  # on PostgreSQL no database file made the state folder
    yield load_token(folder) if listener is not None else ""


def dashboard_url(listen: str, token: str) -> dict[str, Any]:
    """Return what `workflowctl dashboard` prints: the URL with the token (and the socket)."""
    if not listen:
        raise Unavailable("the dashboard is off: set [http] listen in config.toml")
    if "/" in listen:  # a Unix socket: a proxy (or curl --unix-socket) reaches it
        return {"url": f"http://localhost/?token={token}", "socket": listen}
    return {"url": f"http://{listen}/?token={token}"}


def hook_settings(cfg: Config) -> HookSettings:
    """Map the `[hooks]` section onto the hook runner's settings (read at every ending)."""
    h = cfg.hooks
    return HookSettings(on_failure=h.on_failure, on_finish=h.on_finish, timeout_s=h.timeout_s)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Return the first exception that is not a group itself."""
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _type_hook(cache: Cache, workflow: str, status: str) -> Sequence[str] | None:
    """Return the argv a workflow type sets for this ending, or None to use `[hooks]`."""
    cls = cache.registry.get(workflow)
    if cls is None:
        return None
    return cls.on_failure if status == "Failed" else cls.on_finish


def status_line(counts: dict[str, int], busy: int) -> str:
    """Return the one-line summary `systemctl status` shows."""
    waiting, failed = counts.get("Waiting", 0), counts.get("Failed", 0)
    return f"{waiting} waiting, {busy} running, {failed} failed"


async def _report_status(rt: Runtime, notifier: Notifier) -> None:
    """Keep STATUS= current: look every STATUS_EVERY_S, send only what changed."""
    if not notifier.address:
        return
    last = ""

    async def refresh() -> None:
        nonlocal last
        line = status_line(await rt.counts(), rt.busy())
        if line != last:
            notifier.status(line)
            last = line

    await supervise("status", refresh, partial(anyio.sleep, STATUS_EVERY_S))


async def _collect_garbage(
    rt: Runtime, reloader: Reloader, leads: Callable[[], bool] = lambda: True
) -> None:
    """Run retention at start, then every `[store] retention_interval_s` (both live on reload).

    On a database several daemons share, only the leader runs it.
    """

    async def collect() -> None:
        keep_days = reloader.cfg.store.keep_finished_days
        deleted = await rt.gc(keep_days) if keep_days > 0 and leads() else 0
        if deleted:
            log.info("workflows_deleted", count=deleted, older_than_days=keep_days)

    async def pause() -> None:
        await anyio.sleep(reloader.cfg.store.retention_interval_s)

    await supervise("retention", collect, pause)


def _log_gc_pauses(watch: GcWatch) -> None:
    for at, generation, ms, collected in watch.take_slow():
        log.info("gc_pause", generation=generation, ms=round(ms, 2), collected=collected, at=at)


async def _report_gc_pauses(watch: GcWatch) -> None:
    """Log the slow collections (`gc_pause`) every STATUS_EVERY_S, from the loop."""

    async def report() -> None:
        _log_gc_pauses(watch)

    await supervise("gc_pauses", report, partial(anyio.sleep, STATUS_EVERY_S))


def _until_due(now: Callable[[], float], *next_due: Callable[[], float]) -> float:
    """Return the seconds until the earliest of the timers and deadlines is due."""
    return min(due() for due in next_due) - now()


async def _collect_when_quiet(collector: QuietCollector) -> None:
    """Run the full collections at quiet moments (`QuietCollector.look` every LOOK_S)."""

    async def look() -> None:
        ran = collector.look()
        if ran is not None and ran.generation == 2:
            log.info(
                "gc_full",
                ms=round(ran.ms, 2),
                collected=ran.collected,
                forced=ran.forced,
                busy=round(ran.busy, 3),
                at=time.time(),
            )

    await supervise("gc_quiet", look, partial(anyio.sleep, LOOK_S))


def _lingering_threads(grace_s: float = 2.0) -> list[threading.Thread]:
    """Return the threads that would keep the interpreter from exiting.

    Idle worker threads end on their own once the event loop has closed, just not at once:
    when no step was abandoned they are all idle, so they get `grace_s` to go. A thread that
    runs an abandoned step may hang for ever and is not waited for.
    """
    main_thread = threading.main_thread()

    def others() -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t is not main_thread and t.is_alive() and not t.daemon
        ]

    if ABANDONED.running == 0:
        deadline = time.monotonic() + grace_s
        for t in others():
            t.join(max(deadline - time.monotonic(), 0.0))
    return others()


def gc_thresholds(override: str) -> tuple[int, ...]:
    """Return gc.set_threshold's figures: GC_THRESHOLDS, or `override` ("a,b,c") if it parses.

    An override that does not parse (or is empty) is ignored: tuning must not stop a start.
    """
    try:
        figures = tuple(int(x) for x in override.split(","))
    except ValueError:
        return GC_THRESHOLDS
    return figures if 1 <= len(figures) <= 3 and all(f >= 0 for f in figures) else GC_THRESHOLDS


def default_config() -> Path:
    """Return the config file used without --config, in the order workflowctl looks too."""
    if os.environ.get("WORKFLOWD_CONFIG"):
        return Config.default_path()
    return Path("config.toml") if Path("config.toml").is_file() else Config.default_path()


def main(argv: list[str] | None = None) -> int:
    """Run workflowd; exit 2 on a bad configuration or database, 1 if another daemon holds it."""
    refused = refuse_foreign("workflowd")
    if refused is not None:
        return refused
    # A burst of due timers or callbacks makes many short-lived objects; with the default
    # threshold (700) full collections of a large heap dominated such bursts (measured).
    figures = gc_thresholds(os.environ.get("WORKFLOWD_GC_THRESHOLD", ""))
    figures += gc.get_threshold()[len(figures) :]  # CPython's own for those not given
    young, middle, full = figures
    # CPython's full collections are left to the daemon, which runs them at quiet moments.
    gc.set_threshold(young, middle, NEVER)
    # Threshold 0 turns the collector off: then so is this one.
    quiet_gc = QuietCollector(due_after=full, young_after=young // 10) if young else None
    gc_watch = GcWatch()
    gc_watch.threshold = figures
    gc_watch.install()
    parser = argparse.ArgumentParser(prog="workflowd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"workflowd {version()}")
    default = default_config()
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="config file (default: $WORKFLOWD_CONFIG, else ./config.toml, else the checkout's "
        f"config.toml, else /etc/workflowd/config.toml; here and now: {default})",
    )
    parser.add_argument(
        "--hold",
        action="store_true",
        help="start with every workflow paused, to inspect and repair them; "
        "`workflowctl resume-all` releases them",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config or default)
        hub = LogHub()
        # Under systemd, records go to journald natively, with fields (see daemon/journal.py).
        native = JOURNAL_SOCKET if journal_attached(sys.stdout) else None
        configure_logging(cfg.log.level, cfg.log.format, hub=hub, journal=native)
        registry = load_registry(cfg)
        schedules = schedules_of(cfg, registry)
    except (ConfigError, ValidationError) as e:
        print(f"workflowd: {e}", file=sys.stderr)
        return 2
    try:
        daemon = partial(
            run_daemon, hold=args.hold, schedules=schedules, gc_watch=gc_watch, quiet_gc=quiet_gc
        )
        anyio.run(daemon, cfg, registry, hub)
    except StoreLocked as e:
        print(f"workflowd: {e}", file=sys.stderr)
        return 1
    except (StoreUnusable, ConfigError) as e:  # raised before READY (a newer schema, say)
        print(f"workflowd: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except ExceptionGroup as group:
        # A part that could not start (the control socket is another live daemon's) fails
        # inside the task group; it is still a start-up error: one line and exit 2.
        startup, rest = group.split((Unavailable, StoreUnusable, ConfigError))
        if startup is None or rest is not None:
            raise
        print(f"workflowd: {_first_leaf(startup)}", file=sys.stderr)
        return 2
    if _lingering_threads():
        # A sync step still hangs in a worker thread past the grace period; the interpreter
        # would wait for it forever. Everything durable is already committed.
        log.warning("daemon_exit_abandoning_threads")
        close_logging()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
