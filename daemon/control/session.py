"""One client connection: reads request lines, answers each, writes the replies."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from daemon.control import protocol as proto
from daemon.control.dispatch import Pending
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
#: Queues a waited-for `send` at once and returns its answer to come (None: dispatch it).
SendNow = Callable[[proto.Send], "Pending | None"]


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
        #: Set once the count is back at 0, made only while shutdown waits for that.
        self._quiet: anyio.Event | None = None

    def started(self) -> None:
        """Count a request being answered."""
        self.count += 1

    def done(self) -> None:
        """Count a request answered."""
        self.count -= 1
        if not self.count and self._quiet is not None:
            self._quiet.set()

    async def quiet(self, grace_s: float) -> None:
        """Wait up to `grace_s` until no request is being answered."""
        try:
            with anyio.move_on_after(grace_s):
                while self.count:
                    self._quiet = anyio.Event()
                    await self._quiet.wait()
        finally:
            self._quiet = None


class Session:
    """One connection: reads request lines and answers each in a task of its own.

    A task that has answered waits for the next request instead of ending: handing a request
    to it costs a fraction of starting a task, and a client waiting for each answer before it
    sends again is served by the same task throughout. A `send` to a workflow in memory needs
    no task at all: it is queued as it is read, and its answer is written by whoever makes it
    durable (`_answer_pending`), so the reader goes on to the next line of a pipelined client.
    """

    def __init__(
        self,
        wire: Wire,
        uid: int | None = None,
        *,
        dispatch: Dispatch,
        limits: Limits,
        in_flight: InFlight,
        send_now: SendNow | None = None,
    ) -> None:
        self.wire, self.uid = wire, uid
        self._dispatch, self._limits, self._all = dispatch, limits, in_flight
        self._send_now = send_now
        #: Answers to come from `send_now`, and the wait of a session ending until they are in.
        self._owed = 0
        self._settled: asyncio.Future[None] | None = None
        #: A task waits for the peer to take what was written; the slots it holds till then.
        self._flushing = False
        self._held = 0
        self._ended = False
        self.in_flight = 0
        self.eof = False
        self.parked: list[Parked] = []
        self.closing = False
        self.room: anyio.Event | None = None
        self._line_since = wire.loop.time()
        self._deadline = self._line_since + limits.idle
        #: What `_read_now` read and left for the reader: a line, or a request it counted.
        self._taken: bytes | proto.AnyRequest | proto.ProtocolError | None = None

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
        try:
            async with anyio.create_task_group() as self.tg:
                async with anyio.create_task_group() as follows:
                    await self._read_requests(follows)
                    # The client stopped talking: stop streaming logs to it.
                    follows.cancel_scope.cancel()
                    self.closing = True
                    while self.parked:
                        self._hand_over(None)
                # A client that half-closed after its last send still waits for the answer (out
                # of `follows`, whose cancelling would end this wait too).
                while self._owed:
                    self._settled = asyncio.get_running_loop().create_future()
                    await self._settled
        finally:
            self._ended = True  # answers still to come find no one to write to

    async def _read_requests(self, follows: anyio.abc.TaskGroup) -> None:
        """Read and start answering each request until EOF, idleness or an oversized line."""
        while True:
            taken, self._taken = self._taken, None
            if isinstance(taken, bytes | None):  # else `_read_now` read and counted it
                line = taken
                if line is None and (self.eof or (line := await self._next_line()) is None):
                    return
                if len(line) > self._limits.max_bytes:
                    message = f"request line over {self._limits.max_bytes} bytes"
                    await self.reply(error(None, "too_large", message))
                    # A client still sending would get EPIPE before reading why: drop the
                    # rest of its line first (a lingering close, as web servers do for 413).
                    if b"\n" not in line and not self.wire.lost:
                        await self.wire.drain_line(DRAIN_BYTES, DRAIN_S)
                    self.tg.cancel_scope.cancel()
                    return
                if not line.strip():
                    continue
                taken = _decode(line)
                while self.in_flight >= self._limits.max_in_flight:
                    self.room = anyio.Event()
                    await self.room.wait()
                self.in_flight += 1
                self._all.started()
                if isinstance(taken, proto.Send) and self._queued(taken):
                    continue
            if isinstance(taken, proto.Logs) and taken.follow:
                follows.start_soon(self._answer, taken)
            else:
                self._hand_over(taken)

    def _read_now(self) -> bool:
        """Queue the sends that arrived while the reader waits, right in the data callback.

        The common request (a waited-for `send` to a workflow in memory) then costs no task
        wake-up and no loop turn before it is queued. Lines are taken in order while they
        are such sends and slots are free. True: the reader may sleep on (at most a line
        begun is left); False: it wakes for the rest, the line or request `_taken` first.
        """
        wire, limits = self.wire, self._limits
        took = False
        try:
            while not wire.lost:
                if took and not wire.data:
                    line = None  # all taken
                elif self.in_flight >= limits.max_in_flight:
                    return False  # the reader waits for room, as for any request
                else:
                    line = wire.line(limits.max_bytes)
                if line is None:
                    if took:  # a new line begins: the idle timeout bounds it from now on
                        self._line_since = now = wire.loop.time()
                        self._deadline = wire.read_deadline = now + limits.idle
                    return True
                took = True
                if len(line) > limits.max_bytes:
                    self._taken = line  # the reader answers that it is too long
                    return False
                if not line.strip():
                    continue
                req = _decode(line)
                self.in_flight += 1
                self._all.count += 1  # `started`, inline on the common path
                if not (type(req) is proto.Send and self._queued(req)):
                    self._taken = req
                    return False
        except Exception:  # never into the transport; the reader goes on
            log.exception("control_request_failed", op="send")
        return False

    def _queued(self, req: proto.Send) -> bool:
        """Queue `req` without a task if it can be; False: it goes to an answering task."""
        if self._send_now is None:
            return False
        try:
            pending = self._send_now(req)
        except WorkflowdError as e:
            self._answer_now(error(req.id, e.code, e.message))
            return True
        except Exception:  # noqa: BLE001 - the task's path answers (and logs) what this was
            return False
        if pending is None:
            return False
        self._owed += 1
        pending.then(partial(self._answer_pending, req.id, pending))
        return True

    def _answer_pending(self, req_id: int | str | None, pending: Pending) -> None:
        """Write the answer of a request queued by `_queued`; runs inside whoever answered it.

        The common answer (a result, to a client that has read what it was sent before) is
        encoded once and handed to the kernel right here, in one frame.
        """
        try:
            try:
                # proto.ok's dict, built here: a send's result is never a Page.
                data = _encode({"id": req_id, "ok": True, "result": pending.result()})
            except Exception as e:  # noqa: BLE001 - every outcome is an answer
                data = _encode(_failure(req_id, e, "send"))
            wire = self.wire
            if self._ended or not wire.flushed_now:
                self._answer_line(data)  # unread output: its size is checked there
            elif not wire.write(data) or wire.lost:
                self.tg.cancel_scope.cancel()  # as `_write_line` does
                self._answered()
            elif wire.flushed_now:
                self._answered()
            else:
                self._held_back()  # the peer has yet to take it
        except Exception:  # never into the actor that made the answer
            log.exception("control_request_failed", op="send")
            self._answered()
        finally:
            self._owed -= 1
            if not self._owed and self._settled is not None and not self._settled.done():
                self._settled.set_result(None)

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
        and no line is begun, the connection is not idle. Sends that arrive during the wait
        may be queued by `_read_now` without waking this reader (it moves the deadline).
        """
        wire = self.wire
        self._line_since = wire.loop.time()
        self._deadline = self._line_since + self._limits.idle
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
            left = self._deadline - wire.loop.time()
            if left > 0:
                wire.on_data = self._read_now
                try:
                    readable = await wire.readable(left)
                finally:
                    wire.on_data = None
                if self._taken is not None:
                    return b""  # `_read_requests` takes `_taken` before reading on
                if readable:
                    continue
            if wire.data or not self.in_flight:
                if wire.data:
                    log.info("control_request_timeout", buffered=len(wire.data))
                return None
            self._line_since = wire.loop.time()
            self._deadline = self._line_since + self._limits.idle

    async def _answer(self, req: proto.AnyRequest | proto.ProtocolError) -> None:
        try:
            if isinstance(req, proto.ProtocolError):
                await self.reply(error(req.id, req.code, req.message))
            else:
                await self.reply(await self._respond(req))
        finally:
            self._answered()

    def _answered(self) -> None:
        """Count one request answered (or given up with its connection)."""
        self.in_flight -= 1
        self._all.done()
        room = self.room
        if room is not None:  # the reader waits for a slot: this one
            self.room = None
            room.set()

    async def _respond(self, req: proto.AnyRequest) -> dict[str, Any]:
        try:
            return proto.ok(req.id, await self._dispatch(req, self.reply, self.uid))
        except Exception as e:  # noqa: BLE001 - every outcome is an answer
            return _failure(req.id, e, type(req).__name__.lower())

    async def reply(self, response: dict[str, Any]) -> None:
        """Write one response line; a peer that stops reading or goes away is dropped."""
        if self._write(response):
            await self._flush()

    def _answer_now(self, response: dict[str, Any]) -> None:
        """Write the answer to one request and count it answered, without waiting."""
        self._answer_line(_encode(response))

    def _answer_line(self, data: bytes) -> None:
        """Write one encoded answer and count its request answered, without waiting.

        An answer the peer has yet to take keeps its request's slot until it does, as an
        awaited `reply` would (a client that sends but never reads is read no further); one
        task per connection waits for that.
        """
        if self._ended or not self._write_line(data):
            self._answered()
            return
        self._held_back()

    def _held_back(self) -> None:
        """Keep an answer's slot until the peer has taken what was written."""
        self._held += 1
        if not self._flushing:
            self._flushing = True
            self.tg.start_soon(self._flush_later)

    async def _flush_later(self) -> None:
        try:
            await self._flush()
        finally:
            self._flushing = False
            held, self._held = self._held, 0
            for _ in range(held):
                self._answered()

    async def _flush(self) -> None:
        """Wait until the peer has taken what was written; one that never does is dropped."""
        wire = self.wire
        with anyio.move_on_after(self._limits.idle) as stalled:
            await wire.flushed()
        if stalled.cancelled_caught or wire.lost:
            self.tg.cancel_scope.cancel()

    def _write(self, response: dict[str, Any]) -> bool:
        """Queue one response line for the peer; True if it is not with the kernel yet."""
        # A client slow to read holds only the bytes not yet sent, not copies.
        return self._write_line(_encode(response))

    def _write_line(self, data: bytes) -> bool:
        """Queue one encoded response line for the peer; True if it is not with the kernel yet."""
        wire = self.wire
        # Bytes wait in the transport only while it is not flushed (no buffer at all is kept
        # above zero bytes): the usual answer costs no look at the buffer.
        unread = 0 if wire.is_flushed() else wire.unread()
        written = wire.write(data)
        size = len(data)
        del data
        if not written:
            self.tg.cancel_scope.cancel()
            return False
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
            return False
        if wire.lost:
            self.tg.cancel_scope.cancel()
            return False
        return not wire.is_flushed()


def _encode(response: dict[str, Any]) -> bytes:
    """Return one response line; a result JSON cannot hold is answered as an internal error."""
    try:
        return encode(response)
    except Exception:
        log.exception("control_encode_failed")
        message = "the result cannot be encoded as JSON"
        return encode(error(response.get("id"), "internal", message))


def _failure(req_id: int | str | None, e: Exception, op: str) -> dict[str, Any]:
    """Return the answer to a request whose handling raised `e` (logged unless it is a refusal)."""
    if isinstance(e, WorkflowdError):
        return error(req_id, e.code, e.message)
    if isinstance(e, sqlite3.Error | OSError):
        # Disk full, database locked: nothing was acknowledged, the client may retry.
        log.error("control_storage_error", error=f"{type(e).__name__}: {e}")
        return error(req_id, "unavailable", f"storage error: {type(e).__name__}: {e}")
    log.exception("control_request_failed", op=op)
    return error(req_id, "internal", f"{type(e).__name__}: {e}")


def _decode(line: bytes) -> proto.AnyRequest | proto.ProtocolError:
    """Return the request on `line`, or the error to answer it with; never raises."""
    try:
        request: proto.AnyRequest = _requests.decode(line)
        proto.check(line, request)
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
