"""OneShot: serves a listener's clients until one message is delivered and answered.

Clients are served concurrently. The first one that sends a line (at most
1 MiB) hands it to the workflow: the line parsed as JSON, or the raw text if it
is not JSON. It gets back one JSON line, `{"ok": true, "result": ...}`, and the
exchange ends. If the workflow rejects the input, the client gets
`{"ok": false, "error": {"code", "message"}}` and the next client may try,
unless the error says the wait is gone (another case won): then it ends too. A
client that sends nothing for `timeout` seconds is dropped without holding up
the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from anyio.abc import Listener, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from daemon.core.handler import Deliver
from daemon.errors import BadRequest, CallbackNotFound, StaleCallback, WorkflowdError

MAX_LINE = 1 << 20


class OneShot:
    """One exchange: serves clients, one delivery at a time, until one succeeds."""

    def __init__(
        self, deliver: Deliver, timeout: float, release: Callable[[], None] | None = None
    ) -> None:
        self.deliver, self.timeout, self._release = deliver, timeout, release
        self.turn = anyio.Lock()
        self.fired = False
        self.done = anyio.Event()
        self.failure: Exception | None = None

    async def serve(self, listener: Listener[SocketStream]) -> None:
        """Accept clients until one message is delivered and answered (or delivery crashed)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, self.client, tg)
            await self.done.wait()
            tg.cancel_scope.cancel()
        if self.failure is not None:
            raise self.failure

    def release(self) -> None:
        """Run `release` once: after it, no new client can reach this listener."""
        release, self._release = self._release, None
        if release is not None:
            release()

    async def client(self, stream: SocketStream) -> None:
        """Serve one client; its errors never stop the listener."""
        async with stream:
            try:
                await self._serve(stream)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # the client went away; the wait stays open
            except Exception as e:  # noqa: BLE001 - serve re-raises it
                self.failure = e
                self.done.set()

    async def _serve(self, stream: SocketStream) -> None:
        """Read one line from a client, deliver it and answer."""
        reader = BufferedByteReceiveStream(stream)
        try:
            with anyio.fail_after(self.timeout):
                line = await reader.receive_until(b"\n", MAX_LINE)
        except anyio.IncompleteRead:
            line = reader.buffer  # the client closed its side after a message without "\n"
            if not line:
                return
        except anyio.DelimiterNotFound:
            return await self._reply(stream, _error(BadRequest(f"message over {MAX_LINE} bytes")))
        except TimeoutError:
            error = {"code": "timeout", "message": f"no message within {self.timeout} s"}
            return await self._reply(stream, {"ok": False, "error": error})
        async with self.turn:  # only the first successful delivery fires the wait
            if self.fired:
                return await self._reply(stream, _error(StaleCallback("the wait has fired")))
            try:
                out = await self.deliver(_parse(line))
            except (CallbackNotFound, StaleCallback) as e:
                # Another case won: the wait is gone, so stop listening once this client knows.
                self.release()
                try:
                    return await self._reply(stream, _error(e))
                finally:
                    self.done.set()
            except WorkflowdError as e:
                return await self._reply(stream, _error(e))
            except Exception:
                await self._reply(stream, _error(WorkflowdError()))
                raise
            self.fired = True
            self.release()  # the next wait may bind this path while we answer
            try:
                await self._reply(stream, {"ok": True, "result": out})
            finally:
                self.done.set()

    async def _reply(self, stream: SocketStream, message: dict[str, Any]) -> None:
        """Send one JSON line, giving up after the timeout on a client that does not read."""
        try:
            data = msgspec.json.encode(message)
        except (TypeError, msgspec.EncodeError) as e:
            data = msgspec.json.encode(_error(WorkflowdError(f"reply is not JSON: {e}")))
        with anyio.move_on_after(self.timeout):
            await stream.send(data + b"\n")


def _error(e: WorkflowdError) -> dict[str, Any]:
    return {"ok": False, "error": {"code": e.code, "message": str(e)}}


def _parse(line: bytes) -> Any:
    """Return the line as JSON, or as text when it is not JSON."""
    line = line.removesuffix(b"\r")
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError:
        return line.decode("utf-8", "replace")
