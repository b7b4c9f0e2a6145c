"""The control protocol: request shapes, error codes and newline-delimited JSON framing."""

from __future__ import annotations

import array
import itertools
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

#: The longest request line the daemon accepts, newline excluded.
MAX_REQUEST_BYTES = 1 << 20
#: How deeply a request's free-form values (`input`, `set`) may nest: `[[1]]` nests 2 deep.
#: Workflow code, the store's encoder and error messages all recurse over such a value, so a
#: deeper one is refused as `bad_input` up front, whatever depth the JSON decoder accepts.
MAX_NESTING = 64

#: Every error code a response can carry; clients may rely on them.
ERROR_CODES = frozenset(
    {
        "bad_request",  # invalid JSON, a missing or ill-typed field
        "unknown_op",  # the op is not one of the requests below
        "not_found",  # no such workflow, workflow type or waiting event
        "bad_input",  # the event's handler rejected the input
        "stale",  # the callback's pc belongs to an earlier wait
        "conflict",  # the request conflicts with the workflow's state
        "too_large",  # the line is over the size limit; the connection is closed
        "forbidden",  # the peer's uid/gid is not allowed; the connection is closed
        "unavailable",  # the daemon is busy or shutting down
        "invalid_definition",  # the workflow's definition is broken
        "internal",  # a bug in workflowd; the daemon log has the traceback
    }
)

Id = int | str | None
Limit = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
#: The most rows one `list` answers; a `cursor` fetches the next page.
MAX_LIST = 1000
ListLimit = Annotated[int, msgspec.Meta(ge=1, le=MAX_LIST)]


class ProtocolError(Exception):
    """A request could not be read; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str, id: Id = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id


class Request(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    """Fields every request has; `id` is echoed in each of its responses."""

    id: Id = None


class Ping(Request, tag="ping"):
    """Ask for the daemon's version and workflow counts by status."""


class Start(Request, tag="start"):
    """Start a workflow of type `workflow`."""

    workflow: str
    workflow_id: str | None = None
    input: dict[str, Any] | None = None
    # issue 19: a whole-workflow deadline in seconds, overriding the class's `timeout_s`.
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


class Send(Request, tag="send"):
    """Deliver an event to a waiting workflow; the result is the handler's output."""

    workflow_id: str
    event: str
    input: Any = None
    thread_id: str | None = None
    pc: Annotated[int, msgspec.Meta(ge=0)] | None = None
    wait: bool = True


class List(Request, tag="list"):
    """List workflows, newest first, optionally filtered."""

    status: str | None = None
    workflow: str | None = None
    limit: ListLimit = 100
    #: The `cursor` of the previous page's response: this page goes on after it.
    cursor: str | None = None
    # issue 19: only the children of this workflow (started by its Child cases).
    parent: str | None = None


class Show(Request, tag="show"):
    """Return one workflow's data and state."""

    workflow_id: str


class History(Request, tag="history"):
    """Return one workflow's history records, oldest first."""

    workflow_id: str
    limit: Limit = 1000


class Cancel(Request, tag="cancel"):
    """Cancel a workflow and tear down its pending waits."""

    workflow_id: str


class Logs(Request, tag="logs"):
    """Stream log records: the recent ones, then (with follow) new ones as they come."""

    follow: bool = False
    workflow_id: str | None = None


class Reload(Request, tag="reload"):
    """Re-read the config and swap in new workflow code if every live workflow fits it."""


class Backup(Request, tag="backup"):
    """Copy the database to `<[store] backup_dir>/<name>.db` (a new file) with SQLite's backup."""

    name: str = ""
    #: No longer accepted: a client picks a name, never a path (the daemon may run as root).
    path: str | None = None

    def __post_init__(self) -> None:
        if self.path is not None:
            raise ValueError(
                "field `path` is no longer accepted: give `name`, a file name for [store] backup_dir"
            )


class Graph(Request, tag="graph"):
    """Draw a workflow type's definition; with `workflow_id`, where that workflow is."""

    workflow: str
    workflow_id: str | None = None
    format: Literal["mermaid", "dot", "svg"] = "mermaid"


class Lint(Request, tag="lint"):
    """Check a workflow type's definition; the result lists errors and warnings."""

    workflow: str


class Goto(Request, tag="goto"):
    """Move a thread of a waiting or failed workflow to a statement, then resume it."""

    workflow_id: str
    thread_id: str
    statement: str


class Edit(Request, tag="edit"):
    """Set data fields (name -> JSON value) of a waiting or failed workflow."""

    workflow_id: str
    set: dict[str, Any]


class Undo(Request, tag="undo"):
    """Revert the last goto or edit of a waiting or failed workflow."""

    workflow_id: str


class Retry(Request, tag="retry"):
    """Resume a failed workflow from its failing step."""

    workflow_id: str


class Resume(Request, tag="resume"):
    """Let one workflow held by `workflowd --hold` run."""

    workflow_id: str


class ResumeAll(Request, tag="resume-all"):
    """End the hold of `workflowd --hold`: every workflow runs."""


class Gc(Request, tag="gc"):
    """Delete finished workflows older than `keep_days` (default: the configured retention)."""

    keep_days: Annotated[float, msgspec.Meta(ge=0)] | None = None


class Schedules(Request, tag="schedules"):
    """List the schedules: spec, next and last fire, paused."""


class ScheduleShow(Request, tag="schedule_show"):
    """Return one schedule's settings, state and last fires."""

    name: str


class SchedulePause(Request, tag="schedule_pause"):
    """Stop a schedule firing until resumed (kept across restarts)."""

    name: str


class ScheduleResume(Request, tag="schedule_resume"):
    """Let a paused schedule fire again; what it missed follows its catch-up policy."""

    name: str


class ScheduleTrigger(Request, tag="schedule_trigger"):
    """Start a schedule's workflow now, once (id `<schedule>:manual:<ISO now>`)."""

    name: str


class Dashboard(Request, tag="dashboard"):
    """Return the dashboard's address with its access token (`unavailable` when it is off)."""


# -- waiting for workflows to end, and the registered types (issue 17) -------------------------


class Wait(Request, tag="wait"):
    """Answer once the workflows end (all, or the first with `any`), or after `timeout_s`."""

    workflow_ids: Annotated[list[str], msgspec.Meta(min_length=1, max_length=1000)]
    any: bool = False
    timeout_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
    #: "blocked": answer as soon as each workflow has stopped moving (it waits, is held or ended).
    until: Literal["ended", "blocked"] = "ended"


class Types(Request, tag="types"):
    """List the registered workflow types with their input fields and defaults."""


ScheduleRequest = Schedules | ScheduleShow | SchedulePause | ScheduleResume | ScheduleTrigger
AnyRequest = (
    Ping | Start | Send | List | Show | History | Cancel | Logs | Reload | Backup
    | Graph | Lint | Goto | Edit | Undo | Retry | Resume | ResumeAll | Gc
    | Schedules | ScheduleShow | SchedulePause | ScheduleResume | ScheduleTrigger
    | Dashboard
    | Wait | Types
)  # fmt: skip
#: Each op's request type.
REQUESTS: dict[str, type[AnyRequest]] = {t.__struct_config__.tag: t for t in AnyRequest.__args__}
OPS = frozenset(REQUESTS)

# Values JSON cannot hold (a Path in a log record, say) are sent as their str().
_encoder = msgspec.json.Encoder(enc_hook=str)


def encode(obj: Any) -> bytes:
    """Return `obj` as one JSON line, newline included."""
    return _encoder.encode(obj) + b"\n"


def decode_request(line: bytes) -> AnyRequest:
    """Parse one request line; raise ProtocolError with a clear message if it is not valid."""
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError as e:
        raise ProtocolError("bad_request", f"invalid JSON: {e}") from None
    except msgspec.ValidationError as e:
        raise ProtocolError("bad_request", f"invalid JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("bad_request", "invalid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_request", "a request must be a JSON object")
    raw_id = obj.get("id")
    id = raw_id if isinstance(raw_id, int | str) and not isinstance(raw_id, bool) else None
    op = obj.get("op")
    if not isinstance(op, str):
        raise ProtocolError("bad_request", "field `op` must be a string", id)
    if op not in OPS:
        raise ProtocolError("unknown_op", f"unknown op {op!r}", id)
    try:
        request: AnyRequest = msgspec.convert(obj, AnyRequest)
    except msgspec.ValidationError as e:
        raise ProtocolError("bad_request", str(e), id) from None
    except RecursionError:
        raise ProtocolError("bad_input", f"a value nests deeper than {MAX_NESTING}", id) from None
    check(line, request)
    return request


def check(line: bytes, request: AnyRequest) -> None:
    """Raise ProtocolError unless `request`, read from `line`, passes check_nesting and check_names.

    A `send`, the request sent most, is passed in one look at its three names and the line's
    brackets; whatever that look cannot pass goes through both checks, which say why.
    """
    if type(request) is Send:
        workflow_id, event, thread_id = request.workflow_id, request.event, request.thread_id
        names = workflow_id + event if thread_id is None else workflow_id + event + thread_id
        if (
            0 < len(workflow_id) <= MAX_NAME
            and 0 < len(event) <= MAX_NAME
            and (thread_id is None or 0 < len(thread_id) <= MAX_NAME)
            and _CONTROL.search(names) is None
            and line.count(b"[") + line.count(b"{") <= MAX_NESTING + 1
        ):
            return
    check_nesting(line, request)
    check_names(request)


#: Fields naming a workflow, an event or a thread: shown in operators' terminals and logs.
NAME_FIELDS = ("workflow_id", "event", "thread_id")
#: The longest workflow id, event name or thread id.
MAX_NAME = 200
#: A C0 or C1 control character, or DEL: none may be in a name.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def check_names(request: AnyRequest) -> None:
    """Raise ProtocolError (`bad_request`) if a workflow id, event or thread id is ill-formed.

    Each is 1 to MAX_NAME characters with no control character. The message never repeats the
    value: it is what could carry escape sequences to a terminal.
    """
    for name in NAME_FIELDS:
        value = getattr(request, name, None)
        if value is None:
            continue
        if not 1 <= len(value) <= MAX_NAME:
            message = f"`{name}` must be 1 to {MAX_NAME} characters, not {len(value)}"
            raise ProtocolError("bad_request", message, request.id)
        if _CONTROL.search(value):
            message = f"`{name}` must not contain control characters"
            raise ProtocolError("bad_request", message, request.id)


def check_nesting(line: bytes, request: AnyRequest) -> None:
    """Raise ProtocolError (`bad_input`) if a value of the request nests deeper than MAX_NESTING.

    Measured on `line`, the request as read (its own object is one level), at C speed: a
    walk over the decoded value costs ten times as much, on the event loop.
    """
    if line.count(b"[") + line.count(b"{") <= MAX_NESTING + 1:
        return  # too few brackets to nest that deep
    steps = _STRING.sub(b"", line).translate(_STEPS, _NOT_BRACKETS)
    if max(itertools.accumulate(array.array("b", steps)), default=0) > MAX_NESTING + 1:
        message = f"a value nests deeper than {MAX_NESTING} levels"
        raise ProtocolError("bad_input", message, request.id)


#: A JSON string (the line decoded, so it is well formed): brackets inside do not count.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
#: Opening brackets become +1, closing ones -1 (as signed bytes); all else is dropped.
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(slots=True)
class Page:
    """A result cut at its limit: the response carries `cursor`, to ask for the rest with."""

    rows: list[Any]
    cursor: str | None


def ok(id: Id, result: Any) -> dict[str, Any]:
    """Build a success response (a Page's cursor goes beside its rows)."""
    if isinstance(result, Page):
        paged = {"id": id, "ok": True, "result": result.rows}
        if result.cursor is not None:
            paged["cursor"] = result.cursor
        return paged
    return {"id": id, "ok": True, "result": result}


def error(id: Id, code: str, message: str) -> dict[str, Any]:
    """Build an error response."""
    return {"id": id, "ok": False, "error": {"code": code, "message": message}}


def log_line(id: Id, record: dict[str, Any]) -> dict[str, Any]:
    """Build one response of a `logs` stream."""
    return {"id": id, "ok": True, "log": record}


def decode_response(line: bytes) -> dict[str, Any]:
    """Parse one response line (for clients); raise ProtocolError if it is not an object."""
    try:
        obj = msgspec.json.decode(line)
    except msgspec.MsgspecError as e:
        raise ProtocolError("bad_request", f"invalid response: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_request", "invalid response: not a JSON object")
    return obj
