"""One client connection: reads request lines, answers each in a task, writes the replies."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog

from daemon.control import protocol as proto
from daemon.control.protocol import encode, error
from daemon.control.wire import Wire
from daemon.errors import WorkflowdError

log = structlog.get_logger()

#: What follows an oversized line is read and dropped for up to this long, then closed.
DRAIN_S = 1.0
#: ... or until this many bytes were dropped.
DRAIN_BYTES = 16 << 20

#: Decodes a valid request in one pass; anything it refuses goes through decode_request,
#: whose errors explain what is wrong (converting a decoded dict costs ~20 µs a request).
_requests = msgspec.json.Decoder(proto.AnyRequest)

Parked = asyncio.Future["proto.AnyRequest | proto.ProtocolError | None"]
#: Writes one response line.
Reply = Callable[[dict[str, Any]], Awaitable[None]]
#: Runs one request from the peer with uid `who` and returns its result.
Dispatch = Callable[[proto.AnyRequest, Reply, "int | None"], Awaitable[Any]]


@dataclass(slots=True)
class Limits:
    """What a connection may do; the server changes these in place on reload."""

    #: The longest request line.
    max_bytes: int = proto.MAX_REQUEST_BYTES
    #: Seconds a connection may sit idle, take to send a whole request line, or take to read
    #: an answer.
    idle: float = 300.0
    #: Requests one connection may have in flight; the reader waits (backpressure) beyond that.
    max_in_flight: int = 16
    #: Unread output past which a connection is dropped (one answer alone may be larger).
    max_buffered: int = 4 << 20


class InFlight:
    """Counts the requests being answered across every connection, so shutdown can wait."""

    def __init__(self) -> None:
        self.count = 0
        self._quiet = anyio.Event()

    def started(self) -> None:
        """Count a request being answered."""
        self.count += 1

    def done(self) -> None:
        """Count a request answered."""
        self.count -= 1
        if not self.count:
            self._quiet.set()

    async def quiet(self, grace_s: float) -> None:
        """Wait up to `grace_s` until no request is being answered."""
        with anyio.move_on_after(grace_s):
            while self.count:
                self._quiet = anyio.Event()
                await self._quiet.wait()


class Session:
    """One connection: reads request lines and answers each in a task of its own.

    A task that has answered waits for the next request instead of ending: handing a request
    to it costs a fraction of starting a task, and a client waiting for each answer before it
    sends again is served by the same task throughout.
    """

    def __init__(
        self,
        wire: Wire,
        uid: int | None = None,
        *,
        dispatch: Dispatch,
        limits: Limits,
        in_flight: InFlight,
    ) -> None:
        self.wire, self.uid = wire, uid
        self._dispatch, self._limits, self._all = dispatch, limits, in_flight
        self.in_flight = 0
        self.eof = False
        self.parked: list[Parked] = []
        self.closing = False
        self.room: anyio.Event | None = None
        self._line_since = wire.loop.time()

    def stalled_for(self) -> float:
        """Return how long this client has been sending one line, owed nothing (else 0).

        That is what a client trickling bytes to hold a slot looks like.
        """
        data = self.wire.data
        if self.in_flight or not data or b"\n" in data:
            return 0.0
        return self.wire.loop.time() - self._line_since

    async def run(self) -> None:
        """Answer every request until EOF, idleness or an oversized line."""
        async with anyio.create_task_group() as self.tg, anyio.create_task_group() as follows:
            while not self.eof and (line := await self._next_line()) is not None:
                if len(line) > self._limits.max_bytes:
                    message = f"request line over {self._limits.max_bytes} bytes"
                    await self.reply(error(None, "too_large", message))
                    # A client still sending would get EPIPE before reading why: drop the
                    # rest of its line first (a lingering close, as web servers do for 413).
                    if b"\n" not in line and not self.wire.lost:
                        await self.wire.drain_line(DRAIN_BYTES, DRAIN_S)
                    self.tg.cancel_scope.cancel()
                    return
                if line.strip():
                    req = _decode(line)
                    while self.in_flight >= self._limits.max_in_flight:
                        self.room = anyio.Event()
                        await self.room.wait()
                    self.in_flight += 1
                    self._all.started()
                    if isinstance(req, proto.Logs) and req.follow:
                        follows.start_soon(self._answer, req)
                    else:
                        self._hand_over(req)
            follows.cancel_scope.cancel()  # the client stopped talking: stop streaming logs to it
            self.closing = True
            while self.parked:
                self._hand_over(None)

    def _hand_over(self, req: proto.AnyRequest | proto.ProtocolError | None) -> None:
        while self.parked:
            parked = self.parked.pop()
            if not parked.done():
                parked.set_result(req)
                return
        if req is not None:
            self.tg.start_soon(self._answerer, req)

    async def _answerer(self, req: proto.AnyRequest | proto.ProtocolError | None) -> None:
        loop = asyncio.get_running_loop()
        while req is not None:
            await self._answer(req)
            if self.closing:
                return
            parked: Parked = loop.create_future()
            self.parked.append(parked)
            req = await parked

    async def _next_line(self) -> bytes | None:
        """Return the next line (too long if over the limit), or None once idle or gone.

        The idle timeout bounds the whole line, not the gap between its bytes: a client that
        trickles a byte at a time is closed as one that sends nothing. While answers are owed
        and no line is begun, the connection is not idle.
        """
        wire = self.wire
        self._line_since = wire.loop.time()
        deadline = self._line_since + self._limits.idle
        while True:
            line = wire.line(self._limits.max_bytes)
            if line is not None:
                return line
            if wire.eof:
                self.eof = True
                return wire.rest()  # a last request may lack its newline
            if wire.lost:
                self.tg.cancel_scope.cancel()  # the peer is gone: nobody to answer
                return None
            left = deadline - wire.loop.time()
            if left > 0 and await wire.readable(left):
                continue
            if wire.data or not self.in_flight:
                if wire.data:
                    log.info("control_request_timeout", buffered=len(wire.data))
                return None
            self._line_since = wire.loop.time()
            deadline = self._line_since + self._limits.idle

    async def _answer(self, req: proto.AnyRequest | proto.ProtocolError) -> None:
        try:
            if isinstance(req, proto.ProtocolError):
                await self.reply(error(req.id, req.code, req.message))
            else:
                await self.reply(await self._respond(req))
        finally:
            self.in_flight -= 1
            self._all.done()
            if self.room is not None:
                self.room.set()

    async def _respond(self, req: proto.AnyRequest) -> dict[str, Any]:
        try:
            return proto.ok(req.id, await self._dispatch(req, self.reply, self.uid))
        except WorkflowdError as e:
            return error(req.id, e.code, e.message)
        except (sqlite3.Error, OSError) as e:
            # Disk full, database locked: nothing was acknowledged, the client may retry.
            log.error("control_storage_error", error=f"{type(e).__name__}: {e}")
            return error(req.id, "unavailable", f"storage error: {type(e).__name__}: {e}")
        except Exception as e:
            log.exception("control_request_failed", op=type(req).__name__.lower())
            return error(req.id, "internal", f"{type(e).__name__}: {e}")

    async def reply(self, response: dict[str, Any]) -> None:
        """Write one response line; a peer that stops reading or goes away is dropped."""
        try:
            data = encode(response)
        except Exception:
            log.exception("control_encode_failed")
            message = "the result cannot be encoded as JSON"
            data = encode(error(response.get("id"), "internal", message))
        del response  # a client slow to read holds only the bytes not yet sent, not copies
        wire = self.wire
        unread = wire.unread()
        written = wire.write(data)
        size = len(data)
        del data
        if not written:
            self.tg.cancel_scope.cancel()
            return
        if unread and unread + size > self._limits.max_buffered:
            # A client that sends but never reads would cost the daemon its every answer.
            log.warning(
                "control_client_dropped",
                reason="unread output over max_buffered_bytes",
                unread_bytes=unread + size,
                uid=self.uid,
            )
            wire.abort()
            self.tg.cancel_scope.cancel()
            return
        if wire.lost:
            self.tg.cancel_scope.cancel()
        elif not wire.is_flushed():
            with anyio.move_on_after(self._limits.idle) as stalled:
                await wire.flushed()
            if stalled.cancelled_caught or wire.lost:
                self.tg.cancel_scope.cancel()


def _decode(line: bytes) -> proto.AnyRequest | proto.ProtocolError:
    """Return the request on `line`, or the error to answer it with; never raises."""
    try:
        request: proto.AnyRequest = _requests.decode(line)
        proto.check_nesting(line, request)
        proto.check_names(request)
        return request
    except proto.ProtocolError as e:
        return e
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        return proto.decode_request(line)
    except proto.ProtocolError as e:
        return e
    except Exception as e:  # a line that breaks the decoder still gets an answer
        log.exception("control_decode_failed")
        return proto.ProtocolError("internal", f"{type(e).__name__}: {e}")
