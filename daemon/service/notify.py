"""sd_notify: tell systemd we are ready, reloading, stopping or still alive."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, MutableMapping
from typing import Self

import anyio
import structlog

from daemon.service.log import flush_logs

log = structlog.get_logger(__name__)

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """Sends sd_notify messages to `address`; with no address every method does nothing."""

    def __init__(
        self, address: str | None, watchdog_usec: int | None = None, pid: int | None = None
    ) -> None:
        # A leading "@" names an abstract socket (Linux), spelled with a NUL byte in the address.
        self.address = "\0" + address[1:] if address and address.startswith("@") else address
        self._watchdog_usec = watchdog_usec if pid is None or pid == os.getpid() else None
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, unset: bool = False) -> Notifier:
        """Build from $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID.

        With `unset`, remove them from `environ` (default os.environ) so children do not inherit them.
        """
        env = os.environ if environ is None else environ
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        notifier = cls(
            env.get("NOTIFY_SOCKET") or None,
            int(usec) if usec.isdigit() and int(usec) > 0 else None,
            int(pid) if pid.isdigit() else None,
        )
        if unset and isinstance(env, MutableMapping):
            for key in _ENV_KEYS:
                env.pop(key, None)
        return notifier

    def send(self, message: str) -> bool:
        """Send one raw message; return whether it was sent (errors are logged, not raised)."""
        if not self.address:
            return False
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(message.encode(), self.address)
        except OSError as e:
            log.warning("sd_notify_failed", message=message, error=str(e))
            return False
        return True

    def ready(self) -> bool:
        """Tell systemd start-up (or a reload) is complete."""
        # What was logged before a change of state is in the log before systemd hears of it.
        flush_logs()
        return self.send("READY=1")

    def status(self, text: str) -> bool:
        """Set the one-line status shown by `systemctl status`."""
        return self.send("STATUS=" + " ".join(text.split()))

    def stopping(self) -> bool:
        """Tell systemd we are shutting down."""
        flush_logs()
        return self.send("STOPPING=1")

    def reloading(self) -> bool:
        """Tell systemd a reload started; send `ready()` once it is done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        flush_logs()
        return self.send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def watchdog(self) -> bool:
        """Ping the watchdog."""
        return self.send("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Return how often to ping the watchdog (half its timeout), or None if it is off for us."""
        if not self.address or self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2_000_000

    def close(self) -> None:
        """Close the socket; a later send opens a new one."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def watchdog_loop(notifier: Notifier) -> None:
    """Ping the watchdog forever from the event loop, so a stuck loop stops the pings."""
    interval = notifier.watchdog_interval()
    if interval is None:
        return
    while True:
        notifier.watchdog()
        await anyio.sleep(interval)
