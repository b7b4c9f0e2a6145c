"""The async Python client: `AsyncClient`, the methods of `Client` awaitable (on anyio)."""

from __future__ import annotations

import builtins
import itertools
import os
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Self, overload

import anyio
import anyio.abc

from daemon.control import protocol as proto
from daemon.control.client import (
    Unreachable,
    encode_request,
    error_of,
    find_socket,
    wait_deadline,
    wait_fields,
    wait_outcome,
)


class AsyncClient:
    """The same methods as `Client`, awaitable; calls on one client take turns on its connection."""

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | None = None,
        timeout: float | None = 60.0,
    ) -> None:
        self.path = find_socket(socket, config)
        self.timeout = timeout
        self._stream: anyio.abc.SocketStream | None = None
        self._buffer = b""
        self._turn = anyio.Lock()
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection (the next call opens a new one)."""
        stream, self._stream, self._buffer = self._stream, None, b""
        if stream is not None:
            await stream.aclose()

    async def _readline(self, stream: anyio.abc.SocketStream) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            try:
                chunk = await stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                raise Unreachable("workflowd closed the connection") from None
            self._buffer += chunk
            if len(self._buffer) > 64 * proto.MAX_REQUEST_BYTES:
                raise Unreachable("an answer line is too long")
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return proto.decode_response(line)
        except proto.ProtocolError as e:
            raise Unreachable(e.message) from None

    async def _exchange(self, op: str, fields: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        rid = next(self._ids)
        if self._stream is None:
            try:
                self._stream = await anyio.connect_unix(self.path)
            except OSError as e:
                raise Unreachable(e.strerror or str(e)) from None
        stream = self._stream
        try:
            await stream.send(encode_request(rid, op, fields))
        except (anyio.BrokenResourceError, OSError) as e:
            raise Unreachable(str(e) or "workflowd closed the connection") from None
        while True:
            response = await self._readline(stream)
            if response.get("id") not in (rid, None):
                continue
            if not response.get("ok"):
                raise error_of(response)
            yield response
            if "log" not in response:
                return

    async def call(
        self,
        op: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - bounds the answer, as in Client
        **fields: Any,
    ) -> Any:
        """Send one request (fields that are None left out) and return its result."""
        return (await self.response(op, timeout=timeout, **fields)).get("result")

    async def response(
        self,
        op: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - bounds the answer, as in Client
        **fields: Any,
    ) -> dict[str, Any]:
        """Send one request and return its whole final response (`result`, and `cursor`)."""
        limit = self.timeout if timeout is None else timeout
        async with self._turn:
            try:
                with anyio.fail_after(limit):
                    last: dict[str, Any] = {}
                    async for response in self._exchange(op, fields):
                        last = response
                    return last
            except TimeoutError:
                await self.aclose()
                raise Unreachable(f"no answer within {limit:g} s", timed_out=True) from None
            except Unreachable:
                await self.aclose()
                raise

    async def ping(self) -> dict[str, Any]:
        """Return the daemon's version and workflow counts."""
        result: dict[str, Any] = await self.call("ping")
        return result

    async def start(
        self, workflow: str, workflow_id: str | None = None, input: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Start a workflow; return `{"workflow_id", "status", "created"}`."""
        result: dict[str, Any] = await self.call(
            "start", workflow=workflow, workflow_id=workflow_id, input=input
        )
        return result

    async def send(
        self,
        workflow_id: str,
        event: str,
        input: Any = None,
        *,
        thread_id: str | None = None,
        pc: int | None = None,
        wait: bool = True,
    ) -> Any:
        """Send an event; return the handler's reply (`{"queued": true}` with wait=False)."""
        return await self.call(
            "send",
            workflow_id=workflow_id,
            event=event,
            input=input,
            thread_id=thread_id,
            pc=pc,
            wait=None if wait else False,
        )

    # `timeout` is the daemon's: it is sent in the request (the op's own `timeout_s`).
    @overload
    async def wait(  # type: ignore[overload-overlap]  # a str is a Sequence[str]: str comes first
        self,
        workflow_ids: str,
        *,
        any: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> dict[str, Any]: ...
    @overload
    async def wait(
        self,
        workflow_ids: Sequence[str],
        *,
        any: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> builtins.list[dict[str, Any]]: ...
    async def wait(
        self,
        workflow_ids: str | Sequence[str],
        *,
        any: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """Wait until the workflows end, as `Client.wait` does."""
        ids = [workflow_ids] if isinstance(workflow_ids, str) else list(workflow_ids)
        limit = wait_deadline(timeout)
        result = await self.call(
            "wait", timeout=limit if limit is not None else float("inf"),
            **wait_fields(ids, any, timeout),
        )  # fmt: skip
        return wait_outcome(workflow_ids, result)

    async def list(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int | None = None,
        parent: str | None = None,
        cursor: str | None = None,
    ) -> builtins.list[dict[str, Any]]:
        """Return workflow summaries, newest first (one page: `limit` at most 1000)."""
        rows, _ = await self.page(
            status=status, workflow=workflow, limit=limit, parent=parent, cursor=cursor
        )
        return rows

    async def page(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int | None = None,
        parent: str | None = None,
        cursor: str | None = None,
    ) -> tuple[builtins.list[dict[str, Any]], str | None]:
        """Return one page of summaries and the cursor of the next (None after the last)."""
        fields: dict[str, Any] = {"status": status, "workflow": workflow, "limit": limit}
        response = await self.response("list", parent=parent, cursor=cursor, **fields)
        return response.get("result") or [], response.get("cursor")

    async def show(self, workflow_id: str) -> dict[str, Any]:
        """Return one workflow's data and state."""
        result: dict[str, Any] = await self.call("show", workflow_id=workflow_id)
        return result

    async def history(
        self, workflow_id: str, *, limit: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        """Return a workflow's history records, oldest first."""
        result: builtins.list[dict[str, Any]] = await self.call(
            "history", workflow_id=workflow_id, limit=limit
        )
        return result

    async def cancel(self, workflow_id: str) -> dict[str, Any]:
        """Cancel a workflow; a finished one raises Conflict."""
        result: dict[str, Any] = await self.call("cancel", workflow_id=workflow_id)
        return result

    async def types(self) -> builtins.list[dict[str, Any]]:
        """Return the registered workflow types with their input fields."""
        result: builtins.list[dict[str, Any]] = await self.call("types")
        return result

    async def logs(
        self, *, follow: bool = False, workflow_id: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield log records, on a connection of their own (see `Client.logs`)."""
        own = AsyncClient(self.path, timeout=self.timeout)
        fields = {"follow": follow or None, "workflow_id": workflow_id}
        try:
            async for response in own._exchange("logs", fields):
                if "log" in response:
                    yield response["log"]
        finally:
            await own.aclose()
