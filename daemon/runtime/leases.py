"""Sharing the work with the other daemons of a PostgreSQL database: claim, renew, drop.

Each daemon claims workflows nobody holds, a batch at a time, every `lease_s / 3` and when
notified (a start, a release, a dead daemon's leases running out); renews what it holds on
the same beat; and drops what it lost. Requests for a workflow another daemon runs go to its
inbox (durable, then a NOTIFY); the answer comes back through the `replies` table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import structlog

from daemon.core.handler import CallbackRequest
from daemon.errors import Unavailable, WorkflowdError
from daemon.runtime.supervise import supervise
from daemon.runtime.work import Item, Reply
from daemon.store.base import Shared, Taken, WorkflowRow

log = structlog.get_logger()
#: Workflows claimed per transaction: small, so that daemons woken together share a burst.
CLAIM_BATCH = 16
#: How long a wake-up for new work waits for more of it before claiming.
COALESCE_S = 0.005
#: Answers kept for requests whose inbox id this daemon has not seen back yet.
EARLY_KEPT = 1000
#: How long a request through this daemon waits at least for the owner's answer.
ANSWER_MIN_S = 30.0


class RemoteError(WorkflowdError):
    """The workflow's owner refused the request."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Leases:
    """Claims, renews and drops this daemon's workflows; carries requests to their owners."""

    def __init__(
        self,
        *,
        shared: Shared,
        lease_s: float,
        recover: Callable[[WorkflowRow, bool], Awaitable[str]],
        submit: Callable[[str, Item], None],
        lose: Callable[[str], None],
        ended: Callable[[str], None],
        waited: Callable[[], list[str]],
        stopping: Callable[[], bool],
        pinned: Callable[[], set[str]],
    ) -> None:
        self._shared, self._lease_s = shared, lease_s
        self._recover, self._submit, self._lose = recover, submit, lose
        self._ended, self._waited, self._stopping = ended, waited, stopping
        #: The workflows with a node-local wait armed here, and those pinned in the store.
        self._pinned_now, self._pinned = pinned, set[str]()
        self._wake = anyio.Event()
        self._claim = self._inbox = self._answers = True
        #: Requests sent through this daemon waiting for their answers, by inbox id.
        self._waiting: dict[int, asyncio.Future[tuple[bool, Any]]] = {}
        #: Answers that came before their request's inbox id was known here.
        self._early: dict[int, tuple[bool, Any]] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        #: What the first claims took up (logged as `recovered`); None after them.
        self._counts: dict[str, int] | None = None
        #: When (anyio time) the first lease another daemon holds runs out, as last seen.
        self._next_expiry: float | None = None

    @property
    def every_s(self) -> float:
        """Return the beat: renewals, and the sweep that catches lost notifications."""
        return self._lease_s / 3

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Claim a first batch, report started, then keep claiming and renewing until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            # What a restart's recovery logs: what this daemon took up before it serves.
            self._counts = dict.fromkeys(("resumed", "armed", "broken", "incompatible", "held"), 0)
            try:
                await self._round()
            except Exception as e:  # noqa: BLE001 - the loop below retries it
                log.warning("claim_failed", error=f"{type(e).__name__}: {e}")
            log.info("recovered", **self._counts)
            self._counts = None
            task_status.started()
            quick = {"initial_s": self.every_s / 4, "max_s": self.every_s}
            tg.start_soon(partial(supervise, "lease_renewal", self._renew, self._beat, **quick))
            tg.start_soon(
                partial(supervise, "lease_claims", self._round, self._until_woken, **quick)
            )
            tg.start_soon(self._shared.listen, self._heard)

    def _heard(self, channel: str, payload: str) -> None:
        """Note what a notification asks for, and wake the claim loop."""
        if channel == "workflowd_status":  # it waits or ended: wake `wait`
            self._ended(payload)
            return
        if channel == "workflowd_work":
            self._claim = True
        elif channel == "workflowd_inbox":
            self._inbox = self._inbox or self._shared.owns(payload)
            self._claim = self._claim or not self._shared.owns(payload)
        elif channel == "workflowd_reply":
            self._answers = self._answers or payload == self._shared.holder
        else:  # (re)connected: notifications may have been missed meanwhile
            self._claim = self._inbox = self._answers = True
            for wid in self._waited():
                self._ended(wid)
        self._wake.set()

    async def _beat(self) -> None:
        await anyio.sleep(self.every_s)

    async def _until_woken(self) -> None:
        wait = self.every_s
        if self._next_expiry is not None:  # another daemon's lease runs out sooner: be there
            wait = max(min(wait, self._next_expiry - anyio.current_time()), 0.01)
        with anyio.move_on_after(wait):
            await self._wake.wait()
        if not self._wake.is_set():  # the sweep: whatever a lost notification missed
            self._claim = self._inbox = self._answers = True
        elif not (self._inbox or self._answers):
            # New work only: a burst of starts is one claim, not one claim per NOTIFY.
            await anyio.sleep(COALESCE_S)
        self._wake = anyio.Event()

    async def _renew(self) -> None:
        for wid in await self._shared.renew():
            self._lose(wid)
        # Pins follow the waits armed here within a beat (a node that dies in that beat has its
        # workflow moved at once rather than after pin_timeout_s).
        now = {wid for wid in self._pinned_now() if self._shared.owns(wid)}
        pin, unpin = now - self._pinned, {w for w in self._pinned - now if self._shared.owns(w)}
        if pin or unpin:
            await self._shared.pin(sorted(pin), sorted(unpin))
        self._pinned = now

    async def _round(self) -> None:
        """Claim while there is work nobody holds; take new inbox rows; read answers."""
        if self._stopping():
            return
        if self._claim:
            self._claim = False
            while True:
                claimed = await self._shared.claim(CLAIM_BATCH)
                for row in claimed.rows:
                    moved = row.id in claimed.moved
                    if moved:
                        log.info("wait_moved", workflow_id=row.id, workflow=row.name)
                    done = await self._recover(row, moved)
                    if self._counts is not None:
                        self._counts[done] = self._counts.get(done, 0) + 1
                self._take(claimed.taken)
                expiry = claimed.next_expiry_s
                self._next_expiry = None if expiry is None else anyio.current_time() + expiry
                if len(claimed.rows) < CLAIM_BATCH:
                    break
                await anyio.lowlevel.checkpoint()  # the actors just started get a turn
        if self._inbox:
            self._inbox = False
            self._take(await self._shared.take_inbox())
        if self._answers:
            self._answers = False
            for inbox_id, ok, value in await self._shared.answers():
                future = self._waiting.pop(inbox_id, None)
                if future is None:
                    self._early[inbox_id] = (ok, value)
                    while len(self._early) > EARLY_KEPT:  # answers to requests that timed out
                        del self._early[next(iter(self._early))]
                elif not future.done():
                    future.set_result((ok, value))

    def _take(self, taken: list[Taken]) -> None:
        """Queue taken inbox rows for their workflows' actors, in order."""
        for t in taken:
            row = t.row
            reply = Reply() if t.reply_to is not None else None
            if t.kind == "cancel":
                # Its row is dropped once it is done, with the answer (a cancel always has one).
                reply = reply or Reply()
                t.reply_to = t.reply_to or ""
                item = Item("cancel", input=row.input, reply=reply)
            else:
                req = CallbackRequest(row.workflow_id, row.thread_id, row.event, row.pc)
                item = Item("callback", req=req, input=row.input, reply=reply, inbox_id=row.id)
            self._submit(row.workflow_id, item)
            if reply is not None and self._tg is not None:
                self._tg.start_soon(self._answer, t, reply)

    async def _answer(self, t: Taken, reply: Reply) -> None:
        """Store the answer for the daemon that received the request, once the actor gave it."""
        try:
            ok, value = True, await reply.wait()
        except Unavailable:
            # Not applied, and still in the inbox: whoever runs the workflow next answers.
            return
        except WorkflowdError as e:
            ok, value = False, {"code": e.code, "message": str(e)}
        except Exception as e:  # noqa: BLE001 - the sender must hear of it
            ok, value = False, {"code": "internal", "message": f"{type(e).__name__}: {e}"}
        try:
            await self._shared.answer(
                t.row.id, t.reply_to or "", ok, value, done=t.kind == "cancel"
            )
        except Exception as e:  # noqa: BLE001 - the sender times out and says so
            log.warning("answer_failed", inbox_id=t.row.id, error=f"{type(e).__name__}: {e}")

    # -- requests through this daemon for workflows it does not run -------------------------

    async def send(
        self, workflow_id: str, event: str, input: Any, *, thread_id: str, pc: int, wait: bool
    ) -> Any:
        """Store an event for the workflow's owner; with `wait`, return the handler's answer."""
        inbox_id = await self._shared.request(
            workflow_id, "callback", event, input, thread_id=thread_id, pc=pc, reply=wait
        )
        if not wait:
            return {"queued": True}
        return await self._answer_of(inbox_id)

    async def cancel(self, workflow_id: str, asked: dict[str, Any]) -> Any:
        """Have the workflow's owner cancel it; return once it did."""
        inbox_id = await self._shared.request(workflow_id, "cancel", "", asked, reply=True)
        return await self._answer_of(inbox_id)

    async def _answer_of(self, inbox_id: int) -> Any:
        future: asyncio.Future[tuple[bool, Any]] = asyncio.get_running_loop().create_future()
        if inbox_id in self._early:
            future.set_result(self._early.pop(inbox_id))
        else:
            self._waiting[inbox_id] = future
        limit = max(ANSWER_MIN_S, 4 * self._lease_s)
        try:
            with anyio.fail_after(limit):
                ok, value = await future
        except TimeoutError:
            raise Unavailable(
                f"no answer from the daemon running the workflow within {limit:g} s;"
                " the request is stored and will be applied"
            ) from None
        finally:
            self._waiting.pop(inbox_id, None)
        if ok:
            return value
        raise RemoteError(str(value.get("code", "internal")), str(value.get("message", "")))
