"""The registry of workflow classes and the workflows loaded in memory (a bounded LRU)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec

from daemon.core.definition import Definition
from daemon.core.state import State
from daemon.core.workflow import Workflow
from daemon.errors import Conflict, UnknownWorkflowType, WorkflowNotFound
from daemon.store.base import Store, WorkflowRow

Registry = dict[str, type[Workflow]]


@dataclass(slots=True)
class Loaded:
    """A workflow in memory: its data, its state and its retry bookkeeping."""

    wf: Workflow
    state: State
    attempt: int = 0
    error: str | None = None
    next_run_at: float | None = None
    #: The Definition built from `wf`'s data as it is now, with the object and the class it
    #: was built for (a repair replaces the object, a reload its class), or None.
    built: tuple[Workflow, type[Workflow], Definition] | None = None

    def definition(self) -> Definition | None:
        """Return the Definition built from the data as it is now, if one is kept."""
        built = self.built
        if built is not None and built[0] is self.wf and built[1] is type(self.wf):
            return built[2]
        return None

    def keep(self, definition: Definition | None) -> None:
        """Keep `definition`, built from the data as it is now (None forgets the one kept)."""
        self.built = None if definition is None else (self.wf, type(self.wf), definition)


class Cache:
    """Turns stored rows into live workflows and keeps the recently used ones."""

    def __init__(
        self, store: Store, registry: Registry, size: int, *, pinned: Callable[[str], bool]
    ) -> None:
        self._store = store
        #: The workflow classes by name; a reload replaces it.
        self.registry = registry
        self.size = size
        # A workflow whose actor runs stays cached: the actor reads its object back.
        self._pinned = pinned
        self._loaded: OrderedDict[str, Loaded] = OrderedDict()
        #: Workflows recovery armed from their stored waits without checking them against the
        #: code; the first load checks one (`vet`) before anything runs it.
        self.unchecked: set[str] = set()
        #: Checks a workflow against the code at its first load; False: it is held (the
        #: runtime sets it).
        self.vet: Callable[[WorkflowRow, Loaded], bool] = lambda row, loaded: True
        #: Workflows just written that wait for their turn to run, as they were written: the
        #: first load takes its one from here instead of reading the store (kept out of the
        #: LRU, which would drop the oldest, the next to run, first).
        self.fresh: dict[str, Callable[[str], Loaded]] = {}

    def workflow_type(self, name: str) -> type[Workflow]:
        """Return the registered class called `name`, or raise UnknownWorkflowType."""
        cls = self.registry.get(name)
        if cls is None:
            known = ", ".join(sorted(self.registry)) or "none"
            raise UnknownWorkflowType(f"no workflow type {name!r} (known: {known})")
        return cls

    def get(self, workflow_id: str) -> Loaded | None:
        """Return the cached workflow, or None."""
        return self._loaded.get(workflow_id)

    def touch(self, workflow_id: str) -> Loaded | None:
        """Return the cached workflow, marked as just used, or None (`load` without the read)."""
        loaded = self._loaded.get(workflow_id)
        if loaded is not None:
            self._loaded.move_to_end(workflow_id)
        return loaded

    def items(self) -> Iterator[tuple[str, Loaded]]:
        """Yield every cached workflow (a snapshot: the cache may change meanwhile)."""
        yield from list(self._loaded.items())

    async def load(self, workflow_id: str) -> Loaded:
        """Return the workflow from the cache, or load it from the store."""
        loaded = self._loaded.get(workflow_id)
        if loaded is not None:
            self._loaded.move_to_end(workflow_id)
            return loaded
        make = self.fresh.pop(workflow_id, None)
        if make is not None:
            loaded = make(workflow_id)
            # Made with the class of its start: one a reload replaced since reads the store.
            if type(loaded.wf) is self.registry.get(loaded.state.workflow):
                self.remember(loaded)
                return loaded
        row = await self._store.get(workflow_id)
        if row is None:
            raise WorkflowNotFound(f"no workflow {workflow_id!r}")
        loaded = self.decode(row)
        if workflow_id in self.unchecked:
            self.unchecked.discard(workflow_id)
            if not self.vet(row, loaded):
                return loaded  # held: not kept, so code it fits later decodes it afresh
        self.remember(loaded)
        return loaded

    async def reload(self, workflow_id: str) -> Loaded:
        """Drop the cached copy and load the durable one."""
        self.forget(workflow_id)
        return await self.load(workflow_id)

    def decode(self, row: WorkflowRow) -> Loaded:
        """Turn a stored row into a live workflow; a row that cannot be one raises Conflict."""
        cls = self.registry.get(row.name)
        if cls is None:
            raise Conflict(f"workflow {row.id}: its type {row.name!r} is not registered")
        try:
            state = State.from_json(row.state)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise Conflict(f"corrupt row {row.id}: its state does not decode: {e}") from e
        try:
            wf = cls.from_json(row.data)
        except Exception as e:  # msgspec, or the class's own __post_init__
            raise Conflict(
                f"corrupt row {row.id}: its data does not load into {row.name}: {e}"
            ) from e
        return Loaded(wf, state, attempt=row.attempt, error=row.error, next_run_at=row.next_run_at)

    def remember(self, loaded: Loaded) -> None:
        """Put a workflow in the bounded cache."""
        self._loaded[loaded.state.id] = loaded
        self._loaded.move_to_end(loaded.state.id)
        while len(self._loaded) > self.size:
            oldest = next(iter(self._loaded))
            if self._pinned(oldest):
                break
            del self._loaded[oldest]

    def forget(self, workflow_id: str) -> None:
        """Drop a workflow from the cache so the next load reads the store."""
        self._loaded.pop(workflow_id, None)
        self.fresh.pop(workflow_id, None)
