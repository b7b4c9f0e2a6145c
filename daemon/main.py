"""workflowd: load the config, recover every workflow, serve the control socket until stopped."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import anyio
import anyio.abc
import structlog

from .config import Config, load_config
from .control import listener_from_systemd, serve
from .errors import ConfigError, StoreLocked, ValidationError
from .log import LogHub, configure_logging
from .notify import Notifier, watchdog_loop
from .reload import Reloader
from .runtime import Runtime, Settings
from .store import Store
from .workflow import Workflow

log = structlog.get_logger()
STATUS_EVERY_S = 5.0
GC_EVERY_S = 3600.0


def settings_of(cfg: Config) -> Settings:
    """Map the `[runtime]` section onto the runtime's settings."""
    r = cfg.runtime
    return Settings(
        max_concurrent_steps=r.max_concurrent_steps,
        retry_initial_s=r.retry_initial_s,
        retry_max_s=r.retry_max_s,
        retry_max_attempts=r.retry_max_attempts,
    )


async def run_daemon(
    cfg: Config,
    registry: dict[str, type[Workflow]],
    hub: LogHub | None = None,
    *,
    task_status: anyio.abc.TaskStatus[Runtime] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon until SIGTERM/SIGINT; reports readiness once recovered and listening."""
    notifier = Notifier.from_env(unset=True)
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with (
            Store.open(
                cfg.store.path,
                synchronous=cfg.store.synchronous,
                history_keep=cfg.store.history_keep,
            ) as store,
            Runtime.open(store, registry, settings_of(cfg), logs=hub) as rt,
            anyio.create_task_group() as tg,
        ):
            d = cfg.daemon
            listener = await listener_from_systemd()
            server = partial(
                serve,
                rt,
                socket_path=None if listener else d.socket,
                listener=listener,
                socket_mode=d.socket_mode,
                allowed_uids=d.allowed_uids,
                allowed_groups=d.allowed_groups,
                max_request_bytes=d.max_request_bytes,
                max_connections=d.max_connections,
                idle_timeout=d.idle_timeout_s,
            )
            control = anyio.CancelScope()

            async def run_control(*, task_status: anyio.abc.TaskStatus[None]) -> None:
                with control:
                    await server(task_status=task_status)

            await tg.start(run_control)
            tg.start_soon(watchdog_loop, notifier)
            tg.start_soon(_report_status, rt, notifier)
            tg.start_soon(_collect_garbage, rt, cfg.store.keep_finished_days)
            log.info("daemon_started", pid=os.getpid(), socket=str(d.socket), db=str(store.path))
            notifier.ready()
            task_status.started(rt)
            reloader = Reloader(cfg, rt, notifier)
            async for signum in signals:
                if signum == signal.SIGHUP:
                    await reloader.reload()
                    continue
                break
            log.info("daemon_stopping", signal=signal.Signals(signum).name)
            notifier.stopping()
            control.cancel()
            with anyio.CancelScope() as drain:
                tg.start_soon(_second_signal, signals, drain)
                finished = await rt.drain(cfg.daemon.shutdown_grace_s)
                log.info("daemon_stopped", steps_finished=finished)
            tg.cancel_scope.cancel()
    notifier.close()


async def _second_signal(signals: AsyncIterator[int], drain: anyio.CancelScope) -> None:
    async for signum in signals:
        log.warning("daemon_stopping_now", signal=signal.Signals(signum).name)
        drain.cancel()
        return


async def _report_status(rt: Runtime, notifier: Notifier) -> None:
    if not notifier.address:
        return
    while True:
        counts = await rt.counts()
        busy = len(rt.actors)
        notifier.status(
            f"{counts.get('Waiting', 0)} waiting, {busy} running, {counts.get('Failed', 0)} failed"
        )
        await anyio.sleep(STATUS_EVERY_S)


async def _collect_garbage(rt: Runtime, keep_days: int) -> None:
    if keep_days <= 0:
        return
    while True:
        deleted = await rt.gc(keep_days)
        if deleted:
            log.info("workflows_deleted", count=deleted, older_than_days=keep_days)
        await anyio.sleep(GC_EVERY_S)


def main(argv: list[str] | None = None) -> int:
    """Run workflowd; exit 2 on a bad configuration, 1 if another daemon holds the store."""
    parser = argparse.ArgumentParser(prog="workflowd", description=__doc__)
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="config file (default: ./config.toml, else $WORKFLOWD_CONFIG or /etc/workflowd)",
    )
    args = parser.parse_args(argv)
    path = args.config or (Path("config.toml") if Path("config.toml").is_file() else None)
    try:
        cfg = load_config(path or Config.default_path())
        hub = LogHub()
        configure_logging(cfg.log.level, cfg.log.format, hub=hub)
        registry = Reloader.load_registry(cfg)
    except (ConfigError, ValidationError) as e:
        print(f"workflowd: {e}", file=sys.stderr)
        return 2
    try:
        anyio.run(run_daemon, cfg, registry, hub)
    except StoreLocked as e:
        print(f"workflowd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
