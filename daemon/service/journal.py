"""journald's native protocol: each log line goes with fields such as WORKFLOW_ID= and STEP=."""

from __future__ import annotations

import os
import socket
import struct
import sys
import weakref
from collections.abc import Mapping
from typing import Any, TextIO

from structlog.typing import EventDict, Processor, WrappedLogger

#: Where journald reads native messages.
JOURNAL_SOCKET = "/run/systemd/journal/socket"
#: Log record keys sent as journal fields too, so `journalctl WORKFLOW_ID=...` finds them.
FIELDS = {"workflow_id": "WORKFLOW_ID", "workflow": "WORKFLOW", "step": "STEP", "event": "EVENT"}
_IDENTIFIER = b"SYSLOG_IDENTIFIER=workflowd\n"
_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3}


def attached(stream: TextIO) -> bool:
    """Tell whether `stream` is connected to journald (systemd names it in $JOURNAL_STREAM)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):  # no real file behind it (tests)
        return False
    return bool(want) and want == f"{st.st_dev}:{st.st_ino}"


def encode(fields: Mapping[str, str | bytes]) -> bytes:
    """Encode fields as one native journal message."""
    out = bytearray()
    for key, value in fields.items():
        data = value.encode() if isinstance(value, str) else value
        if b"\n" in data:  # a value with newlines goes as length-prefixed binary
            out += key.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


class JournalRenderer:
    """Renders with `renderer` and passes the record's journal fields on to JournalLogger."""

    def __init__(self, renderer: Processor) -> None:
        self.renderer = renderer

    def __call__(self, logger: WrappedLogger, method: str, event_dict: EventDict) -> Any:
        fields = journal_fields(event_dict, method)
        line = self.renderer(logger, method, event_dict)
        return (line,), {"fields": fields}


def journal_fields(event_dict: EventDict, method: str = "info") -> dict[str, str]:
    """Return a record's native journal fields: WORKFLOW_ID=, STEP=, ..., and its PRIORITY=."""
    fields = {name: str(event_dict[key]) for key, name in FIELDS.items() if key in event_dict}
    level = str(event_dict.get("level", method))
    fields["PRIORITY"] = str(_PRIORITY.get(level, 2 if level in ("critical", "fatal") else 6))
    return fields


class JournalLogger:
    """Sends each line to journald with its fields; writes it to `fallback` if that fails."""

    def __init__(self, fallback: TextIO | None = None, address: str = JOURNAL_SOCKET) -> None:
        self.fallback = fallback or sys.stdout
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        weakref.finalize(self, self.sock.close)  # a reconfigure drops us; the socket goes too

    def msg(self, line: str, fields: dict[str, str] | None = None) -> None:
        """Send one record: MESSAGE is the line exactly as it would go to stdout."""
        message = {"MESSAGE": line, "SYSLOG_IDENTIFIER": "workflowd", **(fields or {})}
        try:
            self.sock.sendto(encode(message), self.address)
        except OSError:  # too big for a datagram, or no journald: stdout still reaches it
            print(line, file=self.fallback, flush=True)

    def send(self, line: bytes, fields: dict[str, str]) -> None:
        """Send one record already rendered as UTF-8 JSON (no decoding and encoding it again)."""
        message = b"MESSAGE=" + line + b"\n" if b"\n" not in line else encode({"MESSAGE": line})
        try:
            self.sock.sendto(message + _IDENTIFIER + encode(fields), self.address)
        except OSError:  # too big for a datagram, or no journald: stdout still reaches it
            print(line.decode(), file=self.fallback, flush=True)

    debug = info = warning = warn = error = critical = exception = fatal = log = msg

    def __call__(self, *args: Any) -> JournalLogger:
        """Act as its own logger factory."""
        return self
