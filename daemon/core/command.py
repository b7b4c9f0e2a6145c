"""Run: a Step that runs a command (no shell) in its own process group; the runtime runs it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from daemon.core.statements import Retry, Step

#: A command line, or a zero-argument callable building one from the data when the step runs.
Argv = Sequence[str] | Callable[[], Sequence[str]]
#: Seconds between SIGTERM and SIGKILL when a command is stopped (timeout, cancel, shutdown).
KILL_AFTER_S = 5.0


def _in_runtime() -> None:
    raise RuntimeError("a Run step is run by workflowd's runtime, not called")


@dataclass(slots=True, eq=False, init=False)
class Run(Step):
    """Run `argv` without a shell; an exit code not in `ok_codes` fails the step (and retries it).

    `timeout` sends the process group SIGTERM, then SIGKILL after KILL_AFTER_S. The exit code,
    duration and the last `output_max_bytes` of stdout and stderr go into the history; with
    `into`, `{"exit_code", "stdout", "stderr"}` is stored in that data field too.
    """

    argv: Argv = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    ok_codes: tuple[int, ...] = (0,)
    output_max_bytes: int = 65536
    stdin: str | bytes | None = None
    into: str | None = None

    def __init__(
        self,
        name: str,
        argv: Argv,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        ok_codes: Sequence[int] = (0,),
        retry: Retry | None = None,
        output_max_bytes: int = 65536,
        stdin: str | bytes | None = None,
        into: str | None = None,
    ) -> None:
        if not callable(argv):
            argv = check_argv(name, argv)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"Run {name!r}: timeout must be > 0 seconds, not {timeout!r}")
        if not (isinstance(output_max_bytes, int) and output_max_bytes >= 0):
            raise ValueError(f"Run {name!r}: output_max_bytes must be an int >= 0")
        codes = tuple(ok_codes)
        if not codes or not all(isinstance(c, int) for c in codes):
            raise ValueError(f"Run {name!r}: ok_codes must be a non-empty list of ints")
        Step.__init__(self, name, _in_runtime, retry, timeout)
        self.argv, self.env, self.cwd, self.ok_codes = argv, env, cwd, codes
        self.output_max_bytes, self.stdin, self.into = output_max_bytes, stdin, into

    def command(self) -> list[str]:
        """Return the command line, building it from the data if `argv` is a callable."""
        argv = self.argv() if callable(self.argv) else self.argv
        return check_argv(self.name, argv)


def check_argv(name: str, argv: object) -> list[str]:
    """Return `argv` as a list; raise TypeError or ValueError unless it is non-empty strings."""
    if isinstance(argv, str | bytes) or not isinstance(argv, Sequence):
        raise TypeError(f"Run {name!r}: argv must be a list of strings, not {argv!r}")
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"Run {name!r}: argv must be a non-empty list of strings, not {argv!r}")
    return list(argv)
