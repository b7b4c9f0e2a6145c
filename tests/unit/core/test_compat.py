"""May stored state run under a (new) class: `blockers` and `misfit`."""

from __future__ import annotations

from dataclasses import dataclass

from daemon import On, S, Section, Step, Wait, Workflow
from daemon.core.compat import blockers, misfit
from daemon.core.engine import release_waits
from daemon.core.state import EventStatus
from tests.helpers.support import Driver, Recorder


@dataclass
class Before(Workflow):
    name = "Doc"

    def definition(self) -> Section:
        return S(Wait("approval", On("approve", Recorder())), Step("after", lambda: None))


@dataclass
class After(Workflow):
    name = "Doc"

    def definition(self) -> Section:
        return S(Wait("sign_off", On("sign", Recorder())), Step("after", lambda: None))


async def waiting() -> Driver[Before]:
    d = Driver(Before())
    await d.resume()
    return d


class TestBlockers:
    async def test_a_renamed_wait_and_event_block(self) -> None:
        """A thread waiting at a Wait whose name and event are gone does not fit."""
        d = await waiting()
        data, new = d.wf.to_json(), dict[str, type[Workflow]](Doc=After)
        assert blockers({"Doc": Before}, "Doc", data, d.state) == []
        assert misfit({"Doc": Before}, "Doc", data, d.state) is None
        assert blockers(new, "Doc", data, d.state) == [
            "thread _main_: statement 'approval' is gone",
            "thread _main_: event 'approve' is gone",
        ]
        assert misfit(new, "Doc", data, d.state) == (
            "thread _main_: statement 'approval' is gone; thread _main_: event 'approve' is gone"
        )
        assert misfit({}, "Doc", data, d.state) == "workflow type 'Doc' is gone"

    async def test_a_wait_let_go_of_does_not_block(self) -> None:
        """A wait only awaiting its teardown does not keep the thread, even with its event gone."""
        d = await waiting()
        (ev,) = d.state.threads[0].wait_events
        assert ev.status is EventStatus.SETUP
        release_waits(d.state)
        d.state.threads[0].cur_step = "sign_off"  # as a goto to the new Wait leaves it
        assert blockers({"Doc": After}, "Doc", d.wf.to_json(), d.state) == []
