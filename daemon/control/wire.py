"""One client connection as an asyncio transport: buffered lines in, backpressured bytes out."""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import Callable, Iterable


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


#: Bytes one receive may take: asyncio's own transports receive into a new 256 KiB bytes
#: object each time, which glibc maps and unmaps per call (~18 µs, as much as the rest of the
#: read); this buffer is made once per connection.
RECEIVE_BYTES = 1 << 16


class Wire(asyncio.BufferedProtocol):
    """One client connection as an asyncio transport: buffers its bytes and wakes the reader.

    anyio's socket streams register the socket with the selector on every receive that would
    block; a transport stays registered, which makes a request several times cheaper. Bytes
    are received into one buffer of the connection's own (`get_buffer`), not a fresh one per
    receive.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport
        self.data = bytearray()
        self._buffer = bytearray(RECEIVE_BYTES)
        self._view = memoryview(self._buffer)
        #: The peer half-closed: what is buffered is all there will be.
        self.eof = False
        #: The connection is lost (reset, or closed by us): nothing more can be written.
        self.lost = False
        self._limit = 1 << 16  # buffered bytes beyond which reading pauses
        self._paused = False
        self._readable: asyncio.Future[bool] | None = None
        self._flushed: asyncio.Future[bool] | None = None
        #: Everything written is with the kernel (what `is_flushed` tells, without a call).
        self.flushed_now = True
        #: When the current wait for bytes gives up (on the loop's clock; `on_data` may move
        #: it on), and the one timer that enforces it.
        self.read_deadline = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        #: Called with what arrived while a reader waits; True: it took what it could and the
        #: reader sleeps on (no task wakes for a request handled right in the callback).
        self.on_data: Callable[[], bool] | None = None

    @classmethod
    async def adopt(cls, sock: socket.socket) -> Wire:
        """Wrap an accepted socket (the Wire owns it from now on)."""
        _, wire = await asyncio.get_running_loop().connect_accepted_socket(cls, sock)
        # A write waits until its bytes are with the kernel, as a plain socket send would.
        wire.transport.set_write_buffer_limits(high=0)
        return wire

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport."""
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        """Lend the transport the receive buffer."""
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        """Buffer what arrived in the receive buffer; pause reading while too much waits."""
        data = self.data
        data += self._view[:nbytes]
        if len(data) > self._limit and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        waiter = self._readable
        if waiter is not None:
            on_data = self.on_data
            if on_data is None or not on_data():
                _settle(waiter, True)

    def eof_received(self) -> bool:
        """Note the half-close and keep the connection open for the answers."""
        self.eof = True
        if self._readable is not None:
            _settle(self._readable, True)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        """Wake whoever waits to read or write."""
        self.lost = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        for waiter in (self._readable, self._flushed):
            if waiter is not None:
                _settle(waiter, True)

    def pause_writing(self) -> None:
        """Note that written bytes are not all with the kernel yet."""
        self._flushed = self.loop.create_future()
        self.flushed_now = False

    def resume_writing(self) -> None:
        """Wake the writers: everything written is with the kernel."""
        self.flushed_now = True
        if self._flushed is not None:
            _settle(self._flushed, True)
            self._flushed = None

    def line(self, max_bytes: int) -> bytes | None:
        """Take the next buffered line (longer than `max_bytes` if it is too long), or None."""
        data = self.data
        end = data.find(b"\n", 0, max_bytes + 1)
        line = None
        if end >= 0 or len(data) > max_bytes:
            end = end if end >= 0 else len(data)
            line = bytes(data[:end])
            del data[: end + 1]  # cheap: a bytearray drops bytes from its front in place
        # Room for one whole line, so that a line over the limit is seen before reading pauses.
        self._limit = max_bytes + (1 << 16)
        if self._paused and len(data) <= self._limit:
            self._paused = False
            self.transport.resume_reading()
        return line

    def rest(self) -> bytes:
        """Take whatever is buffered."""
        rest = bytes(self.data)
        self.data.clear()
        return rest

    async def readable(self, idle_s: float) -> bool:
        """Wait up to `idle_s` seconds for more bytes, EOF or loss; False if none came."""
        future: asyncio.Future[bool] = self.loop.create_future()
        self._readable = future
        self.read_deadline = deadline = self.loop.time() + idle_s
        # One timer outlives the waits: each request would otherwise make and cancel a timer
        # (and leave it in the loop's heap) only for the deadline to move on. A timer due
        # before the new deadline is re-armed when it fires; only an earlier one is made now.
        timer = self._idle_timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._idle_timer = self.loop.call_at(deadline, self._idle_due)
        try:
            return await future
        finally:
            self._readable = None

    def _idle_due(self) -> None:
        """Give up the current wait for bytes if its deadline is here; else wait on for it."""
        timer, self._idle_timer = self._idle_timer, None
        waiter = self._readable
        if waiter is None or timer is None:
            return  # nobody waits: the next wait arms a timer of its own
        if self.read_deadline > timer.when():
            self._idle_timer = self.loop.call_at(self.read_deadline, self._idle_due)
        else:
            _settle(waiter, False)

    async def drain_line(self, max_bytes: int, limit_s: float) -> None:
        """Read and drop bytes up to the end of the line, EOF, `max_bytes` or `limit_s`."""
        deadline = self.loop.time() + limit_s
        dropped = 0
        self._limit = 1 << 16
        while not (self.eof or self.lost):
            end = self.data.find(b"\n")
            if end >= 0:
                del self.data[: end + 1]
                return
            dropped += len(self.data)
            self.data.clear()
            if self._paused:
                self._paused = False
                self.transport.resume_reading()
            left = deadline - self.loop.time()
            if dropped >= max_bytes or left <= 0 or not await self.readable(left):
                return

    def unread(self) -> int:
        """Return how many written bytes the kernel has not taken yet (the peer has not read)."""
        return 0 if self.lost else self.transport.get_write_buffer_size()

    def abort(self) -> None:
        """Drop the connection at once, with whatever it has not sent."""
        self.lost = True
        self.transport.abort()

    def write(self, data: bytes) -> bool:
        """Queue `data` for the peer; False if the connection is closing or gone."""
        if self.lost or self.transport.is_closing():
            return False
        self.transport.write(data)
        return True

    def is_flushed(self) -> bool:
        """Tell whether everything written is with the kernel."""
        return self.flushed_now

    async def flushed(self) -> None:
        """Wait until everything written is with the kernel (or the connection is lost)."""
        while (waiter := self._flushed) is not None and not self.lost:
            await waiter

    def close(self) -> None:
        """Close the connection, dropping what a peer that stopped reading never took."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self.transport.get_write_buffer_size():
            self.transport.abort()  # close() would wait for that peer to read, maybe forever
        else:
            self.transport.close()


def hung_up(wires: Iterable[Wire]) -> list[Wire]:
    """Return those of `wires` whose peer has closed its end entirely, with one poll(2).

    A peer that only half-closed still waits for its answers; one that closed is gone (its
    socket reports POLLHUP), even if the loop has not read its last bytes yet.
    """
    by_fd: dict[int, Wire] = {}
    gone = []
    poll = select.poll()
    for wire in wires:
        sock = None if wire.lost else wire.transport.get_extra_info("socket")
        if sock is None:
            gone.append(wire)
            continue
        by_fd[sock.fileno()] = wire
        poll.register(sock.fileno(), select.POLLHUP)
    for fd, events in poll.poll(0) if by_fd else ():
        if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
            gone.append(by_fd[fd])
    return gone
