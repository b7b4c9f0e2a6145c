"""The Python client for workflowd's control socket: `Client` (blocking), errors, discovery.

    with Client() as c:
        c.start("Approval", workflow_id="deploy-42", input={"request": "deploy 42"})
        c.send("deploy-42", "decide", {"approve": True, "by": "ann"})
        c.wait("deploy-42", timeout=60)

Every error answer raises the `ClientError` subclass of its protocol code (`NotFound`,
`Conflict`, `BadInput`, ...), with `.code` and `.message`. `workflowctl` is built on `Client`;
`AsyncClient` (daemon.control.aclient) has the same methods, awaitable.
"""

from __future__ import annotations

import builtins
import itertools
import os
import socket as socketlib
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self, overload

from daemon.control import protocol as proto

#: The socket the shipped units listen on; the last place looked for one.
SERVICE_SOCKET = Path("/run/workflowd/workflowd.sock")
#: What `$RUNTIME_DIRECTORY` and `$STATE_DIRECTORY` are under the shipped unit, when unset.
UNIT_DIRECTORIES = {"RUNTIME_DIRECTORY": "/run/workflowd", "STATE_DIRECTORY": "/var/lib/workflowd"}
DEFAULT_SOCKET = "state/workflowd.sock"  # the [daemon] socket default of config.toml
#: Seconds a `wait` answer may lag its own timeout before the client gives up on the daemon.
WAIT_GRACE_S = 10.0


class ClientError(Exception):
    """The daemon answered with an error, or could not be reached."""

    code = "client"

    def __init__(self, message: str = "", code: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())
        self.message = str(self)
        if code is not None:
            self.code = code


class BadRequest(ClientError):
    """The request is malformed: not JSON, a missing or ill-typed field."""

    code = "bad_request"


class UnknownOp(ClientError):
    """The daemon does not know the op."""

    code = "unknown_op"


class NotFound(ClientError):
    """No such workflow, workflow type, schedule or waiting event."""

    code = "not_found"


class BadInput(ClientError):
    """The value was rejected (by the event's handler or the workflow's types); nothing changed."""

    code = "bad_input"


class Stale(ClientError):
    """The event's pc belongs to an earlier wait."""

    code = "stale"


class Conflict(ClientError):
    """The request does not fit the workflow's state."""

    code = "conflict"


class TooLarge(ClientError):
    """The request line is over the daemon's limit."""

    code = "too_large"


class Forbidden(ClientError):
    """Your uid and groups may not use the socket."""

    code = "forbidden"


class Unavailable(ClientError):
    """The daemon is busy or shutting down."""

    code = "unavailable"


class InvalidDefinition(ClientError):
    """The workflow's definition is broken."""

    code = "invalid_definition"


class Internal(ClientError):
    """A bug in workflowd; its log has the traceback."""

    code = "internal"


class Unreachable(ClientError):
    """The daemon could not be reached, or hung up or stayed silent before answering."""

    code = "unreachable"

    def __init__(self, message: str = "", *, timed_out: bool = False) -> None:
        super().__init__(message)
        #: True when the daemon stayed silent past the call's timeout.
        self.timed_out = timed_out


class NoSocket(ClientError):
    """The arguments, environment and config files do not say where the socket is."""

    code = "no_socket"


class WaitTimeout(ClientError, TimeoutError):
    """`wait` gave up before the workflows ended; `.result` holds where each one stood."""

    code = "timeout"

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


#: The exception class of each protocol error code.
ERRORS: dict[str, type[ClientError]] = {
    cls.code: cls
    for cls in (
        BadRequest, UnknownOp, NotFound, BadInput, Stale, Conflict, TooLarge, Forbidden,
        Unavailable, InvalidDefinition, Internal,
    )
}  # fmt: skip


def error_of(response: dict[str, Any]) -> ClientError:
    """Return the exception an error response stands for."""
    err = response.get("error")
    err = err if isinstance(err, dict) else {}
    code, message = str(err.get("code", "internal")), str(err.get("message", ""))
    return ERRORS.get(code, ClientError)(message, code)


def find_socket(
    socket: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | None = None,
    *,
    service_socket: Path = SERVICE_SOCKET,
) -> Path:
    """Return the control socket's path, looked for as `workflowctl` does.

    In order: `socket`, `$WORKFLOWD_SOCKET`, the `[daemon] socket` of `config`, of
    `$WORKFLOWD_CONFIG`, of `./config.toml`, then /run/workflowd/workflowd.sock if it exists.
    """
    if socket:
        return Path(socket)
    if os.environ.get("WORKFLOWD_SOCKET"):
        return Path(os.environ["WORKFLOWD_SOCKET"])
    if config:
        return socket_of(Path(config))
    if os.environ.get("WORKFLOWD_CONFIG"):
        return socket_of(Path(os.environ["WORKFLOWD_CONFIG"]))
    if Path("config.toml").is_file():
        return socket_of(Path("config.toml"))
    if service_socket.exists():
        return service_socket
    raise NoSocket(
        "no socket found: pass --socket PATH or --config FILE, set WORKFLOWD_SOCKET or "
        f"WORKFLOWD_CONFIG, or run where config.toml is (no ./config.toml, no {service_socket})"
    )


def socket_of(config: Path) -> Path:
    """Return the `[daemon] socket` of a config file (relative to the file's folder)."""
    try:
        table = tomllib.loads(config.read_text()).get("daemon", {})
    except FileNotFoundError:
        raise NoSocket(f"no {config}; pass --socket PATH or set WORKFLOWD_SOCKET") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise NoSocket(f"cannot read {config}: {e}") from None
    value = table.get("socket", DEFAULT_SOCKET) if isinstance(table, dict) else None
    if not isinstance(value, str) or not value:
        raise NoSocket(f"{config}: [daemon] socket must be a path")
    if value.startswith("$"):  # $RUNTIME_DIRECTORY/..., as the daemon's config allows
        var, _, rest = value[1:].partition("/")
        where = os.environ.get(var) or UNIT_DIRECTORIES.get(var)
        if not where:
            raise NoSocket(f"{config}: the socket is under ${var}, which is not set")
        return Path(where.split(":")[0]) / rest
    return Path(os.path.normpath(config.parent / value))


def encode_request(rid: int, op: str, fields: dict[str, Any]) -> bytes:
    """Encode one request, leaving out the fields that are None."""
    return proto.encode({"id": rid, "op": op, **{k: v for k, v in fields.items() if v is not None}})


def wait_fields(ids: Sequence[str], any: bool, timeout: float | None) -> dict[str, Any]:
    """Return the fields of a `wait` request."""
    return {"workflow_ids": list(ids), "any": any or None, "timeout_s": timeout}


def wait_deadline(timeout: float | None) -> float | None:
    """How long to wait for a `wait` answer: its own timeout plus a grace, else forever."""
    return None if timeout is None else timeout + WAIT_GRACE_S


def wait_outcome(ids: str | Sequence[str], result: dict[str, Any]) -> Any:
    """Return what `wait` returns for `ids` (one entry, or the list); raise WaitTimeout."""
    if result.get("timed_out"):
        pending = [w["workflow_id"] for w in result.get("workflows", []) if not w.get("ended")]
        raise WaitTimeout(f"still running: {', '.join(pending)}", result)
    if isinstance(ids, str):
        return result["workflows"][0]
    return result["workflows"]


class _Link:
    """One blocking connection; `timeout` bounds each whole call from its start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        self.lines = self.sock.makefile("rb")
        self.deadline: float | None = None
        self.limit: float | None = None

    def arm(self, timeout: float | None) -> None:
        """Start a deadline of `timeout` seconds (None: none) for what follows."""
        self.limit = timeout
        endless = timeout is None or timeout == float("inf")
        self.deadline = None if timeout is None or endless else time.monotonic() + timeout

    def _left(self) -> None:
        if self.deadline is not None:
            self.sock.settimeout(max(self.deadline - time.monotonic(), 1e-3))
        else:
            self.sock.settimeout(None)

    def fail(self, e: OSError) -> Unreachable:
        if isinstance(e, TimeoutError):
            return Unreachable(f"no answer within {self.limit:g} s", timed_out=True)
        return Unreachable(e.strerror or str(e))

    def connect(self) -> None:
        try:
            self._left()
            self.sock.connect(str(self.path))
        except OSError as e:
            raise self.fail(e) from None

    def send(self, line: bytes) -> None:
        try:
            self._left()
            self.sock.sendall(line)
        except BrokenPipeError:
            pass  # the daemon refused us at once; its reply, still to be read, says why
        except OSError as e:
            raise self.fail(e) from None

    def read(self) -> dict[str, Any]:
        try:
            self._left()
            line = self.lines.readline()
        except OSError as e:
            raise self.fail(e) from None
        if not line:
            raise Unreachable("workflowd closed the connection")
        try:
            return proto.decode_response(line)
        except proto.ProtocolError as e:
            raise Unreachable(e.message) from None

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


class Client:
    """A blocking client; one connection, opened on first use and again after a failure.

    `socket` is found as `workflowctl` finds it when not given (see `find_socket`);
    `timeout` (None: none) bounds each call's whole answer, else `Unreachable` is raised.
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | None = None,
        timeout: float | None = 60.0,
    ) -> None:
        self.path = find_socket(socket, config)
        self.timeout = timeout
        self._link: _Link | None = None
        self._ids = itertools.count(1)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (the next call opens a new one)."""
        if self._link is not None:
            self._link.close()
            self._link = None

    def _open(self, timeout: float | None) -> _Link:
        link = self._link
        if link is None:
            link = _Link(self.path)
            link.arm(timeout)
            try:
                link.connect()
            except Unreachable:
                link.close()
                raise
            self._link = link
        link.arm(timeout)
        return link

    def stream(
        self, op: str, *, timeout: float | None = None, first_only: bool = False, **fields: Any
    ) -> Iterator[dict[str, Any]]:
        """Send one request and yield each of its responses, the final one included.

        An error response raises its `ClientError`; with `first_only`, `timeout` bounds only
        the wait for the first response (a followed log may then pause for hours).
        """
        rid = next(self._ids)
        try:
            link = self._open(timeout)
            link.send(encode_request(rid, op, fields))
            while True:
                response = link.read()
                if response.get("id") not in (rid, None):
                    continue  # an answer to a request given up on earlier
                if first_only:
                    link.arm(None)
                if not response.get("ok"):
                    raise error_of(response)
                yield response
                if "log" not in response:
                    return
        except Unreachable:
            self.close()  # the connection's state is unknown: never reuse it
            raise
        except GeneratorExit:
            self.close()  # left mid-stream: the rest would arrive on the next call
            raise

    def call(self, op: str, *, timeout: float | None = None, **fields: Any) -> Any:
        """Send one request (fields that are None left out) and return its result."""
        return self.response(op, timeout=timeout, **fields).get("result")

    def response(self, op: str, *, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and return its whole final response (`result`, and `cursor`)."""
        limit = self.timeout if timeout is None else timeout
        last: dict[str, Any] = {}
        for response in self.stream(op, timeout=limit, **fields):
            last = response
        return last

    def ping(self) -> dict[str, Any]:
        """Return the daemon's version and workflow counts."""
        result: dict[str, Any] = self.call("ping")
        return result

    def start(
        self, workflow: str, workflow_id: str | None = None, input: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Start a workflow; return `{"workflow_id", "status", "created"}`."""
        result: dict[str, Any] = self.call(
            "start", workflow=workflow, workflow_id=workflow_id, input=input
        )
        return result

    def send(
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
        return self.call(
            "send",
            workflow_id=workflow_id,
            event=event,
            input=input,
            thread_id=thread_id,
            pc=pc,
            wait=None if wait else False,
        )

    @overload
    def wait(  # type: ignore[overload-overlap]  # a str is a Sequence[str] too: str comes first
        self,
        workflow_ids: str,
        *,
        any: bool = False,
        timeout: float | None = None,
    ) -> dict[str, Any]: ...
    @overload
    def wait(
        self,
        workflow_ids: Sequence[str],
        *,
        any: bool = False,
        timeout: float | None = None,
    ) -> builtins.list[dict[str, Any]]: ...
    def wait(
        self,
        workflow_ids: str | Sequence[str],
        *,
        any: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Block until the workflows end (all, or one with `any`); WaitTimeout after `timeout` s.

        Returns, for one id, `{"workflow_id", "workflow", "status", "result", "error"}`; for a
        list, one such dict per id.
        """
        ids = [workflow_ids] if isinstance(workflow_ids, str) else list(workflow_ids)
        limit = wait_deadline(timeout)
        result = self.call(
            "wait",
            timeout=limit if limit is not None else float("inf"),
            **wait_fields(ids, any, timeout),
        )
        return wait_outcome(workflow_ids, result)

    def list(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        limit: int | None = None,
        parent: str | None = None,
        cursor: str | None = None,
    ) -> builtins.list[dict[str, Any]]:
        """Return workflow summaries, newest first (one page: `limit` at most 1000)."""
        rows, _ = self.page(
            status=status, workflow=workflow, limit=limit, parent=parent, cursor=cursor
        )
        return rows

    def page(
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
        response = self.response("list", parent=parent, cursor=cursor, **fields)
        return response.get("result") or [], response.get("cursor")

    def show(self, workflow_id: str) -> dict[str, Any]:
        """Return one workflow's data and state."""
        result: dict[str, Any] = self.call("show", workflow_id=workflow_id)
        return result

    def history(
        self, workflow_id: str, *, limit: int | None = None
    ) -> builtins.list[dict[str, Any]]:
        """Return a workflow's history records, oldest first."""
        result: builtins.list[dict[str, Any]] = self.call(
            "history", workflow_id=workflow_id, limit=limit
        )
        return result

    def cancel(self, workflow_id: str) -> dict[str, Any]:
        """Cancel a workflow; a finished one raises Conflict."""
        result: dict[str, Any] = self.call("cancel", workflow_id=workflow_id)
        return result

    def types(self) -> builtins.list[dict[str, Any]]:
        """Return the registered workflow types with their input fields."""
        result: builtins.list[dict[str, Any]] = self.call("types")
        return result

    def logs(
        self, *, follow: bool = False, workflow_id: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Yield log records: the recent ones, then with `follow` each new one (on its own line)."""
        own = Client(self.path, timeout=self.timeout)
        try:
            for response in own.stream(
                "logs",
                timeout=self.timeout,
                first_only=follow,
                follow=follow or None,
                workflow_id=workflow_id,
            ):
                if "log" in response:
                    yield response["log"]
        finally:
            own.close()
