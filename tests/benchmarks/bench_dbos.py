"""workflowd side by side with DBOS on SQLite: the same two shapes of trivial sync steps, one run.

DBOS is installed into a virtualenv of its own (cached under ~/.cache/workflowd-bench, or
$WORKFLOWD_BENCH_CACHE), never into workflowd's, and runs a small script there: `n`
workflows started together with `DBOS.start_workflow`, each running `steps` `@DBOS.step`s,
on its SQLite system database (DBOS's defaults: rollback journal, synchronous=FULL). The
same shapes then run in a real workflowd at synchronous=full and normal, and the ratios
workflowd/DBOS are the figures with the issue's targets. Where DBOS cannot be installed or
run, its figures and the ratios are null with a `note` saying why.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from .bench_runtime import through_daemon
from .bench_workflows import SyncSteps
from .common import bench_daemon

#: The DBOS release the issue compares against (pip picks its newest patch), then the
#: nearest ones should the registry not have it.
DBOS_SPECS = ("dbos==3.4.*", "dbos>3.4,<4", "dbos>=3,<3.4")
#: name -> (workflows started together, steps each)
SHAPES: dict[str, tuple[int, int]] = {"many_workflows": (200, 10), "one_workflow": (1, 1_000)}
#: The issue's targets for workflowd/DBOS at synchronous=full (none at normal).
RATIO_TARGETS: dict[str, float] = {"many_workflows": 60.0, "one_workflow": 9.0}
SYNCHRONOUS = ("full", "normal")
REPEATS = 3
INSTALL_S, RUN_S = 600.0, 600.0

#: Runs in DBOS's virtualenv: argv is the database file and the shapes as JSON
#: ([[workflows, steps], ...]); prints one JSON list of results, one per shape.
DBOS_SCRIPT = """\
import json, sys, time
from dbos import DBOS, DBOSConfig

db, shapes, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
config: DBOSConfig = {
    "name": "wfbench",
    "system_database_url": f"sqlite:///{db}",
    "run_admin_server": False,
    "log_level": "WARNING",
}
DBOS(config=config)


@DBOS.step()
def inc(i: int) -> int:
    return i + 1


@DBOS.workflow()
def steps_wf(n: int) -> int:
    i = 0
    for _ in range(n):
        i = inc(i)
    return i


DBOS.launch()
steps_wf(2)  # warm-up: tables, connections, the executor's threads
out = []
for workflows, steps in shapes:
    rates, cpus = [], []
    for _ in range(repeats):
        cpu, start = time.process_time(), time.perf_counter()
        handles = [DBOS.start_workflow(steps_wf, steps) for _ in range(workflows)]
        results = [h.get_result() for h in handles]
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        if results != [steps] * workflows:
            raise SystemExit(f"wrong results: {results[:3]}")
        rates.append(workflows * steps / elapsed)
        cpus.append(cpu / (workflows * steps) * 1e6)
    out.append({"rates": rates, "cpus": cpus})
DBOS.destroy()
print(json.dumps(out))
"""


def cache_dir() -> Path:
    """Return the folder that keeps DBOS's virtualenv between runs."""
    root = os.environ.get("WORKFLOWD_BENCH_CACHE") or Path.home() / ".cache" / "workflowd-bench"
    return Path(root)


def _version(python: Path) -> str | None:
    """Return the DBOS version installed for `python`, or None."""
    probe = "import importlib.metadata as m; print(m.version('dbos'))"
    done = subprocess.run(
        [python, "-c", probe], check=False, capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def install_dbos(venv: Path, install: bool = True) -> tuple[Path | None, str]:
    """Make (or reuse) a virtualenv with DBOS; return its python and version, or a note.

    DBOS 3.4 if the registry has it, else the nearest release (the newest 3.x above, then
    the newest below); the version returned says which.
    """
    python = venv / "bin" / "python"
    if python.exists() and (version := _version(python)):
        return python, version
    if not install:
        return None, f"DBOS is not installed in {venv} and installing was not asked for"
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", venv],
            check=True, capture_output=True, timeout=INSTALL_S,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"no virtualenv for DBOS in {venv}: {type(e).__name__}: {e}"
    why = ""
    for spec in DBOS_SPECS:
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", spec]
        try:
            subprocess.run(pip, check=True, capture_output=True, text=True, timeout=INSTALL_S)
        except subprocess.CalledProcessError as e:
            why = ((e.stderr or "").strip().splitlines() or [f"exit {e.returncode}"])[-1]
            continue
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"{type(e).__name__}: {e}"
            continue
        version = _version(python)
        if version is None:
            return None, f"DBOS installed ({spec}) but does not import"
        return python, version
    return None, f"DBOS could not be installed ({', '.join(DBOS_SPECS)}): {why}"


def run_dbos(
    python: Path, tmp: Path, shapes: dict[str, tuple[int, int]], repeats: int
) -> dict[str, tuple[list[float], list[float]]] | str:
    """Run the shapes in DBOS; return steps/s and CPU µs per step of each, or a note."""
    script, db = tmp / "dbos_bench.py", tmp / "dbos.sqlite"
    script.write_text(DBOS_SCRIPT)
    argv = [str(python), str(script), str(db), json.dumps(list(shapes.values())), str(repeats)]
    try:
        done = subprocess.run(
            argv, check=False, capture_output=True, text=True, timeout=RUN_S, cwd=tmp
        )
    except subprocess.TimeoutExpired:
        return f"the DBOS script ran over {RUN_S:.0f} s"
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return f"the DBOS script failed: {tail[0]}"
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: (r["rates"], r["cpus"]) for name, r in zip(shapes, results, strict=True)}


async def run_workflowd(
    tmp: Path, synchronous: str, shapes: dict[str, tuple[int, int]], repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Run the shapes in a real workflowd at `synchronous`; return steps/s and CPU µs of each."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    async with bench_daemon(tmp / f"daemon-{synchronous}", store={"synchronous": synchronous}) as d:
        for name, (workflows, steps) in shapes.items():
            results = [
                await through_daemon(d, f"{name}-{r}", SyncSteps.name, workflows, steps)
                for r in range(repeats)
            ]
            out[name] = ([rate for rate, _ in results], [cpu for _, cpu in results])
    return out


def _side(
    system: str,
    synchronous: str,
    name: str,
    size: tuple[int, int],
    rates: list[float],
    cpus: list[float],
    context: dict[str, Any],
) -> list[dict[str, Any]]:
    workflows, steps = size
    common = {
        "system": system,
        "synchronous": synchronous,
        "workflows": workflows,
        "steps_each": steps,
        **context,
    }
    tag = f"{system}_{name}" if system == "dbos" else f"{system}_{name}_{synchronous}"
    return [
        {"metric": f"{tag}_steps_per_s", "value": round(statistics.median(rates)), "unit": "1/s",
         "target": None, **common, "runs": [round(r) for r in rates]},
        {"metric": f"{tag}_cpu_per_step_us", "value": round(statistics.median(cpus)), "unit": "us",
         "target": None, **common, "runs": [round(c) for c in cpus]},
    ]  # fmt: skip


async def run(
    tmp: Path,
    shapes: dict[str, tuple[int, int]] | None = None,
    repeats: int = REPEATS,
    venv: Path | None = None,
    install: bool = True,
) -> list[dict[str, Any]]:
    """Measure both shapes in DBOS and in workflowd (full, normal); return the figures and ratios.

    With `install=False`, DBOS runs only if its virtualenv is already there (a smoke test
    must not download anything).
    """
    shapes = shapes or SHAPES
    venv = venv or cache_dir() / "dbos-3.4"
    figures: list[dict[str, Any]] = []
    started = time.perf_counter()
    # pip and the DBOS script take minutes: off the event loop, in a worker thread.
    python, found = await anyio.to_thread.run_sync(install_dbos, venv, install)
    dbos: dict[str, tuple[list[float], list[float]]] | str = found
    if python is not None:
        dbos = await anyio.to_thread.run_sync(run_dbos, python, tmp, shapes, repeats)
    note = dbos if isinstance(dbos, str) else None
    dbos_context = {"version": found} if note is None else {"note": note}
    if note is None and not found.startswith("3.4."):
        dbos_context["note"] = f"DBOS 3.4 could not be installed: the nearest, {found}, ran"
    for name, size in shapes.items():
        if isinstance(dbos, str):
            figures.append({"metric": f"dbos_{name}_steps_per_s", "value": None, "unit": "1/s",
                            "target": None, "system": "dbos", **dbos_context})  # fmt: skip
        else:
            figures += _side("dbos", "full", name, size, *dbos[name], dbos_context)
    for synchronous in SYNCHRONOUS:
        ours = await run_workflowd(tmp, synchronous, shapes, repeats)
        for name, size in shapes.items():
            rates, cpus = ours[name]
            figures += _side("workflowd", synchronous, name, size, rates, cpus, {})
            ratio = (
                None
                if isinstance(dbos, str)
                else statistics.median(rates) / statistics.median(dbos[name][0])
            )
            target = RATIO_TARGETS.get(name) if synchronous == "full" else None
            figures.append(
                {"metric": f"ratio_{name}_{synchronous}", "value": None if ratio is None else round(ratio, 1),
                 "unit": "x", "target": target, "synchronous": synchronous,
                 "of": "workflowd/dbos steps per s", **dbos_context}
            )  # fmt: skip
    said = f"DBOS {found}" if note is None else note
    print(f"# bench_dbos: {said}, {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return figures
