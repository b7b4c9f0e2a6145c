"""workflowctl: start, signal and inspect workflows through workflowd's control socket."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from daemon.control import protocol as proto
from daemon.identity import refuse_foreign

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
DEFAULT_SOCKET = "state/workflowd.sock"  # the [daemon] socket default of config.toml
#: Seconds a command waits for its answer unless --timeout says otherwise (`logs -f` waits on).
DEFAULT_TIMEOUT_S = 60.0
#: `workflowctl schedule ACTION` -> the op it sends.
SCHEDULE_OPS = {
    "list": "schedules",
    "show": "schedule_show",
    "pause": "schedule_pause",
    "resume": "schedule_resume",
    "trigger": "schedule_trigger",
}


class Unreachable(Exception):
    """The daemon could not be reached, or hung up without answering."""


class NoSocket(Exception):
    """The command line, environment and config file do not say where the socket is."""


class NoSvg(Exception):
    """Graphviz's `dot` is missing or failed, so no SVG can be drawn."""


class Connection:
    """A blocking JSON-lines connection to the daemon, with a deadline for its answer.

    `timeout` (None: none) bounds connecting, sending and reading; with `first_only`, it bounds
    only the wait for the first response line (`logs -f`: records may then pause for hours).
    """

    def __init__(self, path: Path, timeout: float | None = None, first_only: bool = False) -> None:
        self.timeout, self.first_only = timeout, first_only
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._arm()
            self.sock.connect(str(path))
        except OSError as e:
            self.sock.close()
            raise self._unreachable(e) from None
        self.lines = self.sock.makefile("rb")

    def _arm(self) -> None:
        """Give the next socket call what is left of the deadline."""
        if self.deadline is not None:
            self.sock.settimeout(max(self.deadline - time.monotonic(), 1e-3))

    def _unreachable(self, e: OSError) -> Unreachable:
        if isinstance(e, TimeoutError):
            return Unreachable(f"no answer within {self.timeout:g} s (--timeout)")
        return Unreachable(e.strerror or str(e))

    def send(self, request: proto.AnyRequest) -> None:
        """Write one request."""
        try:
            self._arm()
            self.sock.sendall(proto.encode(request))
        except BrokenPipeError:
            pass  # the daemon refused us at once; its reply, still to be read, says why
        except OSError as e:
            raise self._unreachable(e) from None

    def responses(self) -> Iterator[dict[str, Any]]:
        """Yield responses until the daemon closes the connection."""
        try:
            while True:
                self._arm()
                line = self.lines.readline()
                if not line:
                    break
                if self.first_only and self.deadline is not None:
                    self.deadline = None
                    self.sock.settimeout(None)
                yield proto.decode_response(line)
        except OSError as e:
            raise self._unreachable(e) from None
        except proto.ProtocolError as e:
            raise Unreachable(e.message) from None
        raise Unreachable("workflowd closed the connection")


def seconds(text: str) -> float:
    """Parse --timeout: seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (0 waits forever), not {text!r}")
    return value


def answer_timeout(args: argparse.Namespace) -> float | None:
    """Return how long to wait for the daemon's answer: --timeout, else the command's default."""
    if args.timeout is not None:
        return args.timeout or None  # 0: wait forever
    if args.command == "logs" and args.follow:
        return None
    return DEFAULT_TIMEOUT_S


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
        "--config", default=defaults["config"], help="read [daemon] socket here (./config.toml)"
    )
    parser.add_argument("--json", action="store_true", default=defaults["json"], help="print JSON")
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=defaults["timeout"],
        metavar="S",
        help=f"give up (exit 3) after S seconds without an answer; 0 waits forever "
        f"(default {DEFAULT_TIMEOUT_S:g}; `logs -f`: no limit, S bounds its first record)",
    )


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser."""
    parser = argparse.ArgumentParser(prog="workflowctl", description=__doc__)
    add_global_options(parser, socket=None, config="config.toml", json=False, timeout=None)
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, within: Any = None) -> argparse.ArgumentParser:
        return (within or sub).add_parser(name, help=help, description=help, parents=[common])

    command("ping", "check that workflowd answers; show its version and workflow counts")
    p = command("start", "start a workflow")
    p.add_argument("workflow", metavar="NAME")
    p.add_argument("--id", dest="workflow_id", help="the workflow id (default: generated)")
    p.add_argument("--input", type=json_object, help="the input, a JSON object")
    p = command("send", "send an event to a waiting workflow and print the handler's reply")
    p.add_argument("workflow_id", metavar="ID")
    p.add_argument("event", metavar="EVENT")
    p.add_argument("--input", type=json_value, help="the event's input, any JSON")
    p.add_argument("--no-wait", dest="wait", action="store_false", help="return once queued")
    p.add_argument("--thread", dest="thread_id", help="the waiting thread")
    p.add_argument("--pc", type=int, help="the wait's pc (rejects a stale event)")
    p = command("list", "list workflows")
    p.add_argument("--status")
    p.add_argument("--workflow", metavar="NAME")
    p.add_argument("--limit", type=int, default=100)
    for name, help in [("show", "show a workflow"), ("cancel", "cancel a workflow")]:
        command(name, help).add_argument("workflow_id", metavar="ID")
    p = command("history", "show a workflow's history")
    p.add_argument("workflow_id", metavar="ID")
    p.add_argument("--limit", type=int, default=1000)
    p = command("logs", "print the daemon's recent log records")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new records")
    p.add_argument("--workflow", dest="workflow_id", metavar="ID", help="only this workflow")
    command("reload", "load new workflow code and settings; refused if live workflows do not fit")
    p = command("backup", "copy the database, consistently, to a new file PATH the daemon writes")
    p.add_argument("path", metavar="PATH", type=os.path.abspath)
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
    p.add_argument("workflow", metavar="NAME")
    p.add_argument("workflow_id", metavar="ID", nargs="?")
    formats = ("mermaid", "dot", "svg")
    p.add_argument("--format", choices=formats, default="mermaid", help="svg needs Graphviz")
    p = command("lint", "check a workflow type's definition; exit 1 if it has errors")
    p.add_argument("workflow", metavar="NAME")
    p = command("goto", "move a thread of a waiting or failed workflow to a statement")
    p.add_argument("workflow_id", metavar="ID")
    p.add_argument("thread_id", metavar="THREAD", help="_main_, or a Go thread's id")
    p.add_argument("statement", metavar="STATEMENT", help="a step, wait, event, loop or branch")
    p = command("edit", "set data fields of a waiting or failed workflow")
    p.add_argument("workflow_id", metavar="ID")
    p.add_argument("--set", metavar="FIELD=JSON", type=field_value, action=SetFields, required=True)
    for name, help in [
        ("undo", "revert the last goto or edit of a workflow"),
        ("retry", "resume a failed workflow from its failing step"),
        ("resume", "let a workflow held by `workflowd --hold` run"),
    ]:
        command(name, help).add_argument("workflow_id", metavar="ID")
    command("resume-all", "end the hold of `workflowd --hold`: every workflow runs")
    p = command("gc", "delete finished workflows older than the retention now")
    p.add_argument("--keep-days", type=float, help="default: [store] keep_finished_days")


def socket_path(args: argparse.Namespace) -> Path:
    """Return --socket, else $WORKFLOWD_SOCKET, else [daemon] socket of the config file."""
    if args.socket:
        return Path(args.socket)
    if os.environ.get("WORKFLOWD_SOCKET"):
        return Path(os.environ["WORKFLOWD_SOCKET"])
    config = Path(args.config)
    hint = "pass --socket PATH or set WORKFLOWD_SOCKET"
    try:
        table = tomllib.loads(config.read_text()).get("daemon", {})
    except FileNotFoundError:
        raise NoSocket(f"no {config}; {hint}") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise NoSocket(f"cannot read {config}: {e}") from None
    value = table.get("socket", DEFAULT_SOCKET) if isinstance(table, dict) else None
    if not isinstance(value, str) or not value:
        raise NoSocket(f"{config}: [daemon] socket must be a path")
    if value.startswith("$"):  # $RUNTIME_DIRECTORY/..., as the daemon's config allows
        var, _, rest = value[1:].partition("/")
        if not os.environ.get(var):
            raise NoSocket(f"{config}: the socket is under ${var}; {hint}")
        return Path(os.environ[var].split(":")[0]) / rest
    return Path(os.path.normpath(config.parent / value))


def build_request(args: argparse.Namespace) -> proto.AnyRequest:
    """Turn the parsed command line into a request (each option's dest is the field's name)."""
    op = SCHEDULE_OPS[args.schedule_command] if args.command == "schedule" else args.command
    cls = proto.REQUESTS[op]
    fields = {name: getattr(args, name) for name in cls.__struct_fields__ if name != "id"}
    return cls(id=1, **fields)


def compact(value: Any) -> str:
    """Return one-line JSON."""
    return proto.encode(value).decode().rstrip()


def pretty(value: Any) -> str:
    """Return indented JSON."""
    return msgspec.json.format(proto.encode(value), indent=2).decode().rstrip()


def cell(value: Any, column: str = "") -> str:
    """Return a value as one table cell; times (`at`, `*_at`) in seconds become local time."""
    if value is None:
        return ""
    is_time = column == "at" or column.endswith("_at")
    if is_time and isinstance(value, int | float) and not isinstance(value, bool):
        return datetime.fromtimestamp(value).strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ", ".join(value)
    text = value if isinstance(value, str) else compact(value)
    return text.replace("\n", "\\n")


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Return rows as an aligned text table with a header."""
    grid = [[c.upper() for c in columns]] + [[cell(r.get(c), c) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(columns))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in grid
    )


def log_text(record: dict[str, Any]) -> str:
    """Return a log record as one human-readable line."""
    rest = {k: v for k, v in record.items() if k not in ("timestamp", "level", "event")}
    head = f"{record.get('timestamp', '')} {record.get('level', ''):<7} {record.get('event', '')}"
    return " ".join([head.strip(), *(f"{k}={cell(v)}" for k, v in rest.items())])


def show(command: str, result: Any) -> str:
    """Return a command's result as text for people."""
    match command, result:
        case "ping", {"version": version, "workflows": dict(counts)}:
            summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no workflows"
            nodes = result.get("nodes") or []
            if len(nodes) > 1:  # several daemons share a PostgreSQL database: name them all
                summary += "; nodes: " + ", ".join(
                    f"{cell(n.get('node_id'))} ({cell(n.get('role'))})" for n in nodes
                )
            return f"workflowd {version}: {summary}"
        case "start" | "cancel", {"workflow_id": wid, "status": status}:
            return f"{wid}: {status}"
        case "list", list(rows):
            columns = ["workflow_id", "workflow", "status", "updated_at", "waiting_for"]
            return table(rows, columns) if rows else "no workflows"
        case "history", list(rows):
            # A repair's before-image (for undo) is too big for a table; --json shows it.
            rows = [
                {k: v for k, v in r.items() if k != "undo"} if isinstance(r, dict) else r
                for r in rows
            ]
            columns = list(dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r))
            return table(rows, columns) if rows else "no history"
        case "send", str(text):
            return text
        case "graph", str(text):
            return text.rstrip("\n")
        case "lint", list(rows):
            return table(rows, ["level", "code", "statement", "message"]) if rows else "no findings"
        case "reload", {"reloaded": bool()}:
            return reload_text(result)
        case "backup", {"path": str(path), "bytes": int(size)}:
            return f"backed up to {path} ({size} bytes)"
        case "schedule list", list(rows):
            return schedules_table(rows) if rows else "no schedules"
        case "schedule show", {"name": str(), "fires": list()}:
            return schedule_text(result)
        case "schedule pause" | "schedule resume", {"name": name, "paused": bool(paused)}:
            return f"{name}: {'paused' if paused else 'resumed'}"
        case "schedule trigger", {"workflow_id": wid, "status": status}:
            return f"{wid}: {status}"
    return pretty(result)


def schedules_table(rows: list[dict[str, Any]]) -> str:
    """Return `schedule list` rows as a table (times in local time)."""
    shown = [
        {
            "name": r.get("name"),
            "workflow": r.get("workflow"),
            "spec": r.get("spec"),
            "tz": r.get("tz"),
            "next": cell(r.get("next_fire_at"), "next_fire_at"),
            "last": cell(r.get("last_fire_at"), "last_fire_at"),
            "last_result": r.get("last_status") or "",
            "paused": "yes" if r.get("paused") else "no",
        }
        for r in rows
    ]
    return table(shown, list(shown[0]))


def schedule_text(result: dict[str, Any]) -> str:
    """Return `schedule show`: its settings and state, then its fires oldest first."""
    last = result.get("last_workflow_id")
    lines = [
        f"name:      {result['name']}",
        f"workflow:  {result.get('workflow')}  input: {compact(result.get('input') or {})}",
        f"spec:      {result.get('spec')} ({result.get('tz')})",
        f"catchup:   {result.get('catchup')} (window {result.get('catchup_window_s')} s)",
        f"overlap:   {result.get('overlap')}  jitter: {result.get('jitter_s')} s",
        f"next fire: {cell(result.get('next_fire_at'), 'at') or '-'}",
        f"last fire: {cell(result.get('last_fire_at'), 'at') or '-'}"
        + (f"  {last} ({result.get('last_status') or 'deleted'})" if last else ""),
        f"paused:    {'yes' if result.get('paused') else 'no'}",
    ]
    if result.get("buffered_at") is not None:
        lines.append(f"buffered:  {cell(result['buffered_at'], 'at')}")
    fires = result["fires"]
    columns = ["at", "kind", "nominal_at", "workflow_id", "reason", "count"]
    return "\n".join([*lines, "", table(fires, columns) if fires else "no fires yet"])


def reload_text(result: dict[str, Any]) -> str:
    """Return a reload's outcome, one blocking workflow per line."""
    if result["reloaded"]:
        lines = [f"reloaded: {cell(result.get('workflows', []))}"]
        if result.get("needs_restart"):
            lines.append(f"needs a restart: {cell(result['needs_restart'])}")
        held = result.get("incompatible") or []
        if held:
            count = result.get("incompatible_count", len(held))
            lines.append(f"still held, {count} workflow(s) do not fit the new code:")
            for h in held:
                lines.append(
                    f"  {cell(h.get('workflow_id'))} ({cell(h.get('workflow'))}): "
                    f"{cell(h.get('reason'))}"
                )
        return "\n".join(lines)
    lines = [f"reload refused: {result.get('error', '')}; still running the old code"]
    for b in result.get("blocked", []):
        lines.append(f"  {b.get('workflow_id')} ({b.get('workflow')}): {cell(b.get('reasons'))}")
    return "\n".join(lines)


def run(args: argparse.Namespace, path: Path) -> int:
    """Send the request, print the response(s) and return the exit code."""
    svg = args.command == "graph" and args.format == "svg"
    if svg:
        if shutil.which("dot") is None:
            raise NoSvg("--format svg needs Graphviz's `dot` (install graphviz); try --format dot")
        args.format = "dot"
    follow = args.command == "logs" and args.follow
    conn = Connection(path, answer_timeout(args), first_only=follow)
    conn.send(build_request(args))
    for response in conn.responses():
        if not response.get("ok"):
            err = response.get("error") or {}
            print(f"error: {err.get('code', '?')}: {err.get('message', '')}", file=sys.stderr)
            return EXIT_ERROR
        if "log" in response:
            record = response["log"]
            print(compact(record) if args.json else log_text(record), flush=True)
            continue
        if args.command != "logs":  # the end marker of `logs` is not worth printing
            result = response.get("result")
            if svg:
                result = to_svg(str(result))
            print(compact(result) if args.json else show(command_of(args), result))
            if args.command == "lint" and any(f.get("level") == "error" for f in result or []):
                return EXIT_ERROR
            if args.command == "reload" and not (result or {}).get("reloaded"):
                return EXIT_ERROR
        return EXIT_OK
    return EXIT_OK  # not reached: responses() raises when the daemon hangs up


def command_of(args: argparse.Namespace) -> str:
    """Return the command as `show` knows it (`schedule list` for a subcommand)."""
    if args.command == "schedule":
        return f"schedule {args.schedule_command}"
    return str(args.command)


def to_svg(dot: str) -> str:
    """Render Graphviz text as SVG with the `dot` program."""
    done = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NoSvg(f"dot failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def main(argv: list[str] | None = None) -> None:
    """Run workflowctl and exit with its status."""
    refused = refuse_foreign("workflowctl")
    if refused is not None:
        sys.exit(refused)
    args = build_parser().parse_args(argv)
    try:
        path = socket_path(args)
        code = run(args, path)
    except NoSocket as e:
        print(f"workflowctl: {e}", file=sys.stderr)
        code = EXIT_USAGE
    except NoSvg as e:
        print(f"workflowctl: {e}", file=sys.stderr)
        code = EXIT_ERROR
    except Unreachable as e:
        print(f"workflowctl: cannot reach workflowd at {path}: {e}", file=sys.stderr)
        code = EXIT_UNREACHABLE
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BrokenPipeError:  # our reader went away (`workflowctl logs | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_OK
    sys.exit(code)


if __name__ == "__main__":
    main()
