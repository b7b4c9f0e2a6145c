"""workflowctl: start, signal, wait for and inspect workflows through workflowd's socket."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

from daemon.control import protocol as proto
from daemon.control import render
from daemon.control.client import Client, ClientError, NoSocket, Unreachable, find_socket
from daemon.identity import refuse_foreign

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
#: `wait`: a workflow ended Cancelled, or the wait timed out (as coreutils' `timeout` exits).
EXIT_CANCELLED, EXIT_TIMEOUT = 4, 124
#: Seconds a command waits for its answer unless --timeout says otherwise (`logs -f` waits on).
DEFAULT_TIMEOUT_S = 60.0
#: How long `start` lets a new workflow run before it says what the workflow waits for.
SETTLE_S = 2.0
#: The statuses `list --status` takes (any case).
STATUSES = ("Resuming", "Waiting", "Finished", "Failed", "Cancelled")
#: The most rows one `list` asks for.
MAX_LIMIT = 1000
#: `workflowctl schedule ACTION` -> the op it sends.
SCHEDULE_OPS = {
    "list": "schedules",
    "show": "schedule_show",
    "pause": "schedule_pause",
    "resume": "schedule_resume",
    "trigger": "schedule_trigger",
}
#: How bad each end of a waited-for workflow is: with several, the worst sets the exit status.
WAIT_EXITS = {"Finished": EXIT_OK, "Cancelled": EXIT_CANCELLED, "Failed": EXIT_ERROR}
_SEVERITY = [EXIT_OK, EXIT_CANCELLED, EXIT_ERROR, EXIT_TIMEOUT]


def version() -> str:
    """Return the installed workflowd version."""
    try:
        return importlib.metadata.version("workflowd")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def status_name(text: str) -> str:
    """Parse --status: one of the real statuses, in any case."""
    for s in STATUSES:
        if s.lower() == text.lower():
            return s
    raise argparse.ArgumentTypeError(f"no status {text!r}; one of: {', '.join(STATUSES)}")


def limit(text: str) -> int:
    """Parse list --limit: 1 to MAX_LIMIT."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of rows, not {text!r}") from None
    if not 1 <= value <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_LIMIT}, not {value}")
    return value


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)?")
_UNIT_S = {None: 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def duration(text: str) -> float:
    """Parse --since: `90`, `30s`, `15m`, `2h`, `1d`, `1w` (seconds ago)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a duration like 30s, 15m, 2h, 1d; not {text!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def seconds(text: str) -> float:
    """Parse --timeout: seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (0 waits forever), not {text!r}")
    return value


def deadline_seconds(text: str) -> float:
    """Parse `start --timeout`: seconds, more than 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("a deadline must be more than 0 seconds")
    return value


def answer_timeout(args: argparse.Namespace) -> float | None:
    """Return how long to wait for the daemon's answer: --timeout, else the command's default."""
    if waits(args):
        return None  # --timeout is the wait's own; the client adds a grace for the answer
    if args.timeout is not None:
        return args.timeout or None  # 0: wait forever
    if args.command == "logs" and args.follow:
        return None
    return DEFAULT_TIMEOUT_S


def waits(args: argparse.Namespace) -> bool:
    """Tell whether the command waits for workflows to end (`wait`, `start --wait`)."""
    return args.command == "wait" or (args.command == "start" and bool(args.wait))


def json_value(text: str) -> Any:
    """Parse a JSON command-line argument."""
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError as e:
        raise argparse.ArgumentTypeError(f"invalid JSON: {e}") from None


def json_object(text: str) -> dict[str, Any]:
    """Parse a JSON object command-line argument."""
    value = json_value(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('expected a JSON object, like \'{"name": "x"}\'')
    return value


def field_value(text: str) -> tuple[str, Any]:
    """Parse one `FIELD=JSON` of `edit --set`."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError("expected FIELD=JSON, like count=3 or 'who=\"ann\"'")
    return name, json_value(value)


class SetFields(argparse.Action):
    """Collect every `--set FIELD=JSON` into one dict."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        fields = getattr(namespace, self.dest, None) or {}
        name, value = values
        setattr(namespace, self.dest, {**fields, name: value})


def add_global_options(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add --socket, --config, --json and --timeout with the given defaults."""
    parser.add_argument("--socket", default=defaults["socket"], help="the control socket's path")
    parser.add_argument(
        "--config",
        default=defaults["config"],
        help="read [daemon] socket of this file (else $WORKFLOWD_CONFIG, ./config.toml)",
    )
    parser.add_argument("--json", action="store_true", default=defaults["json"], help="print JSON")
    if "timeout" not in defaults:  # `start --timeout` is the workflow's deadline instead
        return
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=defaults["timeout"],
        metavar="S",
        help=f"give up (exit 3) after S seconds without an answer; 0 waits forever "
        f"(default {DEFAULT_TIMEOUT_S:g}; `logs -f`: no limit, S bounds its first record; "
        "`wait`, `start --wait`: exit 124 if the workflows have not ended after S seconds)",
    )


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = argparse.ArgumentParser(prog="workflowctl", description=__doc__, epilog=SOCKET_HELP)
    parser.add_argument("--version", action="version", version=f"workflowctl {version()}")
    add_global_options(parser, socket=None, config=None, json=False, timeout=None)
    # Global options also work after the command; SUPPRESS keeps the command's parser from
    # overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    add_global_options(
        common,
        socket=argparse.SUPPRESS,
        config=argparse.SUPPRESS,
        json=argparse.SUPPRESS,
        timeout=argparse.SUPPRESS,
    )
    no_timeout = argparse.ArgumentParser(add_help=False)
    add_global_options(
        no_timeout, socket=argparse.SUPPRESS, config=argparse.SUPPRESS, json=argparse.SUPPRESS
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, within: Any = None, **kw: Any) -> argparse.ArgumentParser:
        parents = kw.pop("parents", [common])
        return (within or sub).add_parser(name, help=help, description=help, parents=parents, **kw)

    command("ping", "check that workflowd answers; show its version and workflow counts")
    # After `start`, --timeout is the workflow's deadline: the answer's (and --wait's) limit
    # goes before the command, `workflowctl --timeout S start ...`.
    p = command(
        "start",
        "start a workflow; print what it waits for (or, with --wait, its end)",
        parents=[no_timeout],
    )
    complete(p.add_argument("workflow", metavar="NAME"), type_names)
    p.add_argument("--id", dest="workflow_id", help="the workflow id (default: generated)")
    p.add_argument("--input", type=json_object, help="the input, a JSON object")
    p.add_argument(
        "--timeout",
        dest="timeout_s",
        type=deadline_seconds,
        metavar="S",
        help="cancel the workflow (error `deadline passed`) S seconds after it starts; "
        "`workflowctl --timeout S start ...` bounds the wait for the answer instead",
    )
    p.add_argument("--wait", action="store_true", help="wait until it ends, as `wait` does")
    p = command("wait", "wait until workflows end; print each one's status and result")
    complete(p.add_argument("workflow_ids", metavar="ID", nargs="+"), workflow_ids)
    p.add_argument("--any", action="store_true", help="return when the first one ends")
    command("types", "list the workflow types with their input fields and defaults")
    p = command("completion", "print a shell completion script (bash, zsh or fish)")
    p.add_argument("shell", choices=("bash", "zsh", "fish"))
    p = command("send", "send an event to a waiting workflow and print the handler's reply")
    complete(p.add_argument("workflow_id", metavar="ID"), workflow_ids)
    p.add_argument("event", metavar="EVENT")
    p.add_argument("--input", type=json_value, help="the event's input, any JSON")
    p.add_argument("--no-wait", dest="wait", action="store_false", help="return once queued")
    p.add_argument("--thread", dest="thread_id", help="the waiting thread")
    p.add_argument("--pc", type=int, help="the wait's pc (rejects a stale event)")
    p = command("list", "list workflows, most recently changed first")
    p.add_argument("--status", type=status_name, help=f"one of {', '.join(STATUSES)}")
    complete(p.add_argument("--workflow", metavar="NAME"), type_names)
    p.add_argument("--limit", type=limit, default=100, help=f"rows, 1 to {MAX_LIMIT} (100)")
    p.add_argument("--since", type=duration, metavar="AGE", help="changed within AGE: 1d, 2h")
    p.add_argument("--parent", metavar="ID", help="only the children this workflow started")
    p.add_argument("--cursor", help="the next page of a cut list (the cursor it printed)")
    for name, help in [("show", "describe a workflow"), ("cancel", "cancel a workflow")]:
        complete(command(name, help).add_argument("workflow_id", metavar="ID"), workflow_ids)
    p = command("history", "show a workflow's history")
    complete(p.add_argument("workflow_id", metavar="ID"), workflow_ids)
    p.add_argument("--limit", type=int, default=1000)
    p = command("logs", "print the daemon's recent log records")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new records")
    only = p.add_argument("--workflow", dest="workflow_id", metavar="ID", help="only this workflow")
    complete(only, workflow_ids)
    command("reload", "load new workflow code and settings; refused if live workflows do not fit")
    p = command("backup", "copy the database, consistently, to NAME.db in [store] backup_dir")
    p.add_argument("name", metavar="NAME", help="a file name, no '/' (e.g. nightly-2026-12-01)")
    p.set_defaults(path=None)  # the request's retired field: never sent
    add_repair_commands(command)
    add_schedule_commands(command)
    return parser


def add_schedule_commands(command: Any) -> None:
    """Add `schedule list|show|pause|resume|trigger`."""
    p = command("schedule", "list, show, pause, resume or trigger schedules")
    sub = p.add_subparsers(dest="schedule_command", required=True, metavar="ACTION")
    command("list", "list the schedules: next and last fire, paused", sub)
    for name, help in [
        ("show", "show a schedule's settings, state and last 100 fires"),
        ("pause", "stop a schedule firing (kept across restarts)"),
        ("resume", "let a paused schedule fire; what it missed follows its catch-up policy"),
        ("trigger", "start the schedule's workflow now, once"),
    ]:
        command(name, help, sub).add_argument("name", metavar="NAME")


def add_repair_commands(command: Any) -> None:
    """Add the commands that draw, check and repair workflows."""
    p = command("graph", "draw a workflow type's definition; with ID, where that workflow is")
    complete(p.add_argument("workflow", metavar="NAME"), type_names)
    complete(p.add_argument("workflow_id", metavar="ID", nargs="?"), workflow_ids)
    formats = ("mermaid", "dot", "svg")
    p.add_argument(
        "--format",
        choices=formats,
        default="mermaid",
        help="svg is drawn by workflowd itself, no Graphviz needed",
    )
    p = command("lint", "check a workflow type's definition; exit 1 if it has errors")
    complete(p.add_argument("workflow", metavar="NAME"), type_names)
    p = command("goto", "move a thread of a waiting or failed workflow to a statement")
    complete(p.add_argument("workflow_id", metavar="ID"), workflow_ids)
    p.add_argument("thread_id", metavar="THREAD", help="_main_, or a Go thread's id")
    p.add_argument("statement", metavar="STATEMENT", help="a step, wait, event, loop or branch")
    p = command("edit", "set data fields of a waiting or failed workflow")
    complete(p.add_argument("workflow_id", metavar="ID"), workflow_ids)
    p.add_argument("--set", metavar="FIELD=JSON", type=field_value, action=SetFields, required=True)
    for name, help in [
        ("undo", "revert the last goto or edit of a workflow"),
        ("retry", "resume a failed workflow from its failing step"),
        ("resume", "let a workflow held by `workflowd --hold` run"),
    ]:
        complete(command(name, help).add_argument("workflow_id", metavar="ID"), workflow_ids)
    command("resume-all", "end the hold of `workflowd --hold`: every workflow runs")
    command("dashboard", "print the dashboard's address, with its access token")
    p = command("gc", "delete finished workflows older than the retention now")
    p.add_argument("--keep-days", type=float, help="default: [store] keep_finished_days")


SOCKET_HELP = (
    "The socket is --socket, else $WORKFLOWD_SOCKET, else [daemon] socket of --config, of "
    "$WORKFLOWD_CONFIG or of ./config.toml, else /run/workflowd/workflowd.sock if it exists."
)


def complete(action: argparse.Action, completer: Callable[..., list[str]]) -> None:
    """Give an argument its shell completer (argcomplete reads the attribute)."""
    action.completer = completer  # type: ignore[attr-defined]


def _ask(args: argparse.Namespace, op: str, **fields: Any) -> Any:
    """Ask the daemon, briefly, for completions; nothing if it does not answer."""
    try:
        with Client(args.socket, args.config, timeout=1.0) as c:
            return c.call(op, **fields)
    except ClientError:
        return []


def workflow_ids(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """Complete workflow ids from the daemon's most recent ones."""
    rows = _ask(parsed_args, "list", limit=MAX_LIMIT)
    ids = [r.get("workflow_id") for r in rows if isinstance(r, dict)]
    return [i for i in ids if isinstance(i, str) and i.startswith(prefix)]


def type_names(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """Complete workflow type names from the daemon."""
    names = [r.get("workflow") for r in _ask(parsed_args, "types") if isinstance(r, dict)]
    return [n for n in names if isinstance(n, str) and n.startswith(prefix)]


def build_request(args: argparse.Namespace) -> proto.AnyRequest:
    """Turn the parsed command line into a request (each option's dest is the field's name)."""
    op = SCHEDULE_OPS[args.schedule_command] if args.command == "schedule" else args.command
    cls = proto.REQUESTS[op]
    fields = {name: getattr(args, name) for name in cls.__struct_fields__ if name != "id"}
    return cls(id=1, **fields)


def fields_of(req: proto.AnyRequest) -> dict[str, Any]:
    """Return a request's fields as the client sends them (op and id are its own)."""
    return {k: v for k, v in msgspec.structs.asdict(req).items() if k != "id"}


def command_of(args: argparse.Namespace) -> str:
    """Return the command as `show` knows it (`schedule list` for a subcommand)."""
    if args.command == "schedule":
        return f"schedule {args.schedule_command}"
    return str(args.command)


class Output:
    """Prints results: exact JSON with --json, else text for people (coloured on a terminal)."""

    def __init__(self, as_json: bool, style: render.Style) -> None:
        self.json, self.style = as_json, style

    def result(self, command: str, result: Any) -> None:
        """Print one command's result."""
        print(render.compact(result) if self.json else render.show(command, result, self.style))


def run(args: argparse.Namespace, client: Client, out: Output) -> int:
    """Send the command's request(s), print the answer and return the exit code."""
    match args.command:
        case "wait":
            return wait(client, out, args.workflow_ids, any=args.any, timeout=args.timeout)
        case "start":
            return start(args, client, out)
        case "list":
            return list_workflows(args, client, out)
        case "logs":
            return logs(args, client, out)
    req = build_request(args)
    result = client.call(req.__struct_config__.tag, **fields_of(req))  # type: ignore[arg-type]
    out.result(command_of(args), result)
    if args.command == "lint" and any(f.get("level") == "error" for f in result or []):
        return EXIT_ERROR
    if args.command == "reload" and not (result or {}).get("reloaded"):
        return EXIT_ERROR
    return EXIT_OK


def start(args: argparse.Namespace, client: Client, out: Output) -> int:
    """Start a workflow; say what it waits for once it stopped moving, or wait for its end."""
    req = build_request(args)
    result = client.call("start", **fields_of(req))
    wid = result["workflow_id"]
    if args.wait:
        return wait(client, out, [wid], any=False, timeout=args.timeout)
    if out.json:
        print(render.compact(result))
        return EXIT_OK
    client.call("wait", workflow_ids=[wid], until="blocked", timeout_s=SETTLE_S)
    shown = client.call("show", workflow_id=wid)
    print(render.started_text(result, shown, out.style))
    return EXIT_OK


def wait(client: Client, out: Output, ids: list[str], *, any: bool, timeout: float | None) -> int:
    """Wait for workflows to end; exit 0 Finished, 1 Failed, 4 Cancelled, 124 timed out."""
    limit = timeout or None  # 0: no limit, as everywhere
    grace = None if limit is None else limit + 10.0
    fields = {"workflow_ids": ids, "any": any or None, "timeout_s": limit}
    result = client.call("wait", timeout=grace or float("inf"), **fields)
    print(render.compact(result) if out.json else render.wait_result(result, out.style, any=any))
    if result.get("timed_out"):
        return EXIT_TIMEOUT
    codes = [WAIT_EXITS.get(w.get("status"), EXIT_ERROR) for w in result["workflows"] if w["ended"]]
    return max(codes, key=_SEVERITY.index, default=EXIT_OK)


def list_workflows(args: argparse.Namespace, client: Client, out: Output) -> int:
    """List workflows; a cut list says so on stderr, with the command for its next page."""
    fields = {
        "status": args.status,
        "workflow": args.workflow,
        "limit": args.limit,
        "parent": args.parent,
        "cursor": args.cursor,
    }
    rows, cursor = client.page(**fields)
    if args.since is not None:  # rows come newest first: the recent ones are a prefix
        cutoff = time.time() - args.since
        kept = [r for r in rows if (r.get("updated_at") or 0) >= cutoff]
        cursor = cursor if len(kept) == len(rows) else None  # the rest are older still
        rows = kept
    out.result("list", rows)
    if cursor is not None and not out.json:  # --json prints the rows exactly, and only them
        total = ""
        if args.workflow is None and args.since is None and args.parent is None:
            counts = client.call("ping").get("workflows", {})
            n = counts.get(args.status, 0) if args.status else sum(counts.values())
            total = f" of {n}" if n > len(rows) and args.cursor is None else ""
        print(
            f"… {len(rows)}{total} shown; more: workflowctl list --cursor {cursor}",
            file=sys.stderr,
        )
    return EXIT_OK


def logs(args: argparse.Namespace, client: Client, out: Output) -> int:
    """Print log records; `--workflow ID` first checks that the workflow exists."""
    if args.workflow_id is not None:
        client.call("show", workflow_id=args.workflow_id)  # NotFound: exit 1, says so
    for record in client.logs(follow=args.follow, workflow_id=args.workflow_id):
        print(render.compact(record) if out.json else render.log_text(record), flush=True)
    return EXIT_OK


def completion(shell: str) -> str:
    """Return the completion script for `shell` (argcomplete asks workflowctl as you type)."""
    import argcomplete.shell_integration  # only this command and completions need it

    return str(argcomplete.shell_integration.shellcode(["workflowctl"], shell=shell))


def colour_wanted() -> bool:
    """Colour only on a terminal, and never with NO_COLOR set (https://no-color.org)."""
    return (
        sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    )


def main(argv: list[str] | None = None) -> None:
    """Run workflowctl and exit with its status."""
    refused = refuse_foreign("workflowctl")
    if refused is not None:
        sys.exit(refused)
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions: answer and exit
        import argcomplete  # imported only when completing: it costs start-up time

        argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    if args.command == "completion":
        print(completion(args.shell), end="")
        sys.exit(EXIT_OK)
    path = None
    try:
        path = find_socket(args.socket, args.config)
        with Client(path, timeout=answer_timeout(args)) as client:
            code = run(args, client, Output(args.json, render.Style(colour_wanted())))
    except NoSocket as e:
        print(f"workflowctl: {render.escape(e.message)}", file=sys.stderr)
        code = EXIT_USAGE
    except Unreachable as e:
        why = f"{e.message} (--timeout)" if e.timed_out else e.message
        print(f"workflowctl: cannot reach workflowd at {path}: {why}", file=sys.stderr)
        code = EXIT_UNREACHABLE
    except ClientError as e:
        print(f"error: {e.code}: {render.escape(e.message, lines=False)}", file=sys.stderr)
        code = EXIT_ERROR
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BrokenPipeError:  # our reader went away (`workflowctl logs | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_OK
    sys.exit(code)


if __name__ == "__main__":
    main()
