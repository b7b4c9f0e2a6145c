"""The dashboard in a real browser (headless Chromium) against a real daemon."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.helpers.browser import chromium, need_browser
from tests.helpers.harness import running_daemon
from tests.helpers.http import fetch, free_port
from tests.helpers.wait import wait_status

MODULES = ["tests.workflows.observe"]
#: How long the browser may take to show something (it polls; this is only the ceiling).
SEEN_S = 20


def _wait(driver: Any, check: Any) -> Any:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The live part is replaced while we look: an element may vanish under our feet.
    ignored = (NoSuchElementException, StaleElementReferenceException)
    wait = WebDriverWait(driver, SEEN_S, poll_frequency=0.05, ignored_exceptions=ignored)
    return wait.until(lambda d: check(d))


def _cell(driver: Any, wid: str) -> str | None:
    """Return the status cell of a workflow's row in the list, or None if it has no row."""
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.CSS_SELECTOR, f'#workflows tr[data-id="{wid}"] td.status')
    return str(rows[0].text) if rows else None


async def _ctl(socket: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = await anyio.run_process(
        [sys.executable, "-m", "daemon.control.ctl", "--socket", str(socket), *args], check=False
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
    )


async def test_dashboard_in_a_browser(short_tmp: Path) -> None:
    """List, live changes without a reload, a workflow's SVG with its position, cancel, retry."""
    need_browser()
    from selenium.webdriver.common.by import By

    address = f"127.0.0.1:{free_port()}"
    base = f"http://{address}"
    async with (
        running_daemon(short_tmp, MODULES, http={"listen": address}) as d,
        d.client() as c,
    ):
        await c.call("start", workflow="Gatekeeper", workflow_id="g1")
        await c.call("start", workflow="Doomed", workflow_id="d1")
        await wait_status(c, "g1", "Waiting")
        await wait_status(c, "d1", "Failed")
        url = (await c.call("dashboard"))["url"]
        token = url.split("token=", 1)[1]
        assert url == f"{base}/?token={token}"
        mode = (short_tmp / "dashboard.token").stat().st_mode
        assert stat.S_IMODE(mode) == 0o600
        with chromium() as browser:
            browser.get(f"{base}/")
            assert "401" in browser.find_element(By.TAG_NAME, "h2").text
            browser.get(url)
            assert "token" not in browser.current_url  # moved into the cookie
            (cookie,) = browser.get_cookies()
            assert cookie["httpOnly"] and cookie["value"] == token
            _wait(browser, lambda b: _cell(b, "g1") == "Waiting")
            _wait(browser, lambda b: _cell(b, "d1") == "Failed")
            _wait(
                browser,
                lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "on",
            )
            browser.execute_script("window.notReloaded = true;")
            # Changes arrive live: a new workflow appears, another one's status changes.
            await c.call("start", workflow="Gatekeeper", workflow_id="g2")
            _wait(browser, lambda b: _cell(b, "g2") is not None)
            await c.call("send", workflow_id="g1", event="go", input="by test")
            _wait(browser, lambda b: _cell(b, "g1") == "Finished")
            assert browser.execute_script("return window.notReloaded === true;")
            counts = _wait(browser, lambda b: b.find_element(By.ID, "counts").text)
            assert "Waiting: 1" in counts and "Failed: 1" in counts  # (Blip runs Finish too)
            # One workflow's page: its definition as SVG, the current position marked.
            _wait(browser, lambda b: b.find_element(By.LINK_TEXT, "g2").click() or True)
            here = _wait(
                browser,
                lambda b: b.find_elements(By.CSS_SELECTOR, "#graph svg g.node.here"),
            )
            assert [h.get_attribute("data-name") for h in here] == ["gate"]
            armed = browser.find_elements(By.CSS_SELECTOR, "#graph svg g.node.armed")
            assert {a.get_attribute("data-name") for a in armed} == {"go", "too_late"}
            _wait(browser, lambda b: "workflow_started" in b.find_element(By.ID, "log").text)
            _wait(
                browser,
                lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "on",
            )
            browser.execute_script("window.notReloaded = true;")
            await c.call("send", workflow_id="g2", event="go", input="live")
            _wait(browser, lambda b: b.find_element(By.ID, "status").text == "Finished")
            assert browser.execute_script("return window.notReloaded === true;")
            _wait(browser, lambda b: '"note": "live"' in b.find_element(By.ID, "data").text)
            _wait(browser, lambda b: "callback_received" in b.find_element(By.ID, "log").text)
            # Cancel behind a confirmation: dismissed first (nothing happens), then accepted.
            await c.call("start", workflow="Gatekeeper", workflow_id="g3")
            await wait_status(c, "g3", "Waiting")
            browser.get(f"{base}/workflow?id=g3")
            _wait(browser, lambda b: b.find_element(By.ID, "cancel").click() or True)
            _wait(browser, lambda b: b.switch_to.alert).dismiss()
            assert (await c.call("show", workflow_id="g3"))["status"] == "Waiting"
            _wait(browser, lambda b: b.find_element(By.ID, "cancel").click() or True)
            _wait(browser, lambda b: b.switch_to.alert).accept()
            _wait(browser, lambda b: b.find_element(By.ID, "status").text == "Cancelled")
            history = await c.call("history", workflow_id="g3")
            assert history[-1]["kind"] == "cancelled" and history[-1]["by"] == "dashboard"
            # Retry of a failed one, recorded as done by the dashboard.
            browser.get(f"{base}/workflow?id=d1")
            _wait(browser, lambda b: b.find_element(By.ID, "retry").click() or True)
            _wait(browser, lambda b: b.switch_to.alert).accept()
            _wait(browser, lambda b: "retry" in b.find_element(By.ID, "history").text)
            retried = [h for h in await c.call("history", workflow_id="d1") if h["kind"] == "retry"]
            assert retried and retried[0]["by"] == "dashboard"
            # The schedules page lists the module's schedule.
            browser.get(f"{base}/schedules")
            assert "blip" in browser.find_element(By.ID, "schedules").text


async def test_requests_without_the_token_are_refused(short_tmp: Path) -> None:
    """No cookie, a wrong token or cookie: 401; a form without its key: 403; the rest works."""
    address = f"127.0.0.1:{free_port()}"
    async with (
        running_daemon(short_tmp, MODULES, http={"listen": address}) as d,
        d.client() as c,
    ):
        await c.call("start", workflow="Gatekeeper", workflow_id="g1")
        await wait_status(c, "g1", "Waiting")
        token = (await c.call("dashboard"))["url"].split("token=", 1)[1]
        for path in ("/", "/workflow?id=g1", "/events", "/fragment/list", "/schedules"):
            assert (await fetch(address, path)).status == 401, path
        assert (await fetch(address, "/?token=wrong")).status == 401
        bad = {"Cookie": "workflowd_dashboard=wrong"}
        assert (await fetch(address, "/", headers=bad)).status == 401
        posted = await fetch(
            address,
            "/workflow/cancel",
            method="POST",
            headers={"Cookie": "workflowd_dashboard=wrong"},
            body=b"id=g1",
        )
        assert posted.status == 401
        redirect = await fetch(address, f"/?token={token}")
        assert redirect.status == 303
        assert "HttpOnly" in redirect.headers["set-cookie"]
        good = {"Cookie": redirect.headers["set-cookie"].split(";")[0]}
        assert (await fetch(address, "/", headers=good)).status == 200
        form = {**good, "Content-Type": "application/x-www-form-urlencoded"}
        forged = await fetch(
            address, "/workflow/cancel", method="POST", headers=form, body=b"id=g1"
        )
        assert forged.status == 403
        assert (await c.call("show", workflow_id="g1"))["status"] == "Waiting"
        missing = await fetch(address, "/workflow?id=nope", headers=good)
        assert missing.status == 404
        assert (await fetch(address, "/static/app.js")).status == 200  # no secret in it


async def test_dashboard_off_by_default(short_tmp: Path) -> None:
    """Without [http] listen, `workflowctl dashboard` says it is off (exit 1)."""

    async with running_daemon(short_tmp, MODULES) as d:
        done = await _ctl(d.socket, "dashboard")
        assert done.returncode == 1
        assert "unavailable" in done.stderr and "[http] listen" in done.stderr
        assert not (short_tmp / "dashboard.token").exists()


@pytest.mark.parametrize("unix", [False, True])
async def test_workflowctl_dashboard_prints_the_url(short_tmp: Path, unix: bool) -> None:
    """`workflowctl dashboard` prints the URL with the token (and the socket, for a path)."""

    address = str(short_tmp / "dash.sock") if unix else f"127.0.0.1:{free_port()}"
    async with running_daemon(short_tmp, MODULES, http={"listen": address}) as d:
        done = await _ctl(d.socket, "dashboard")
        assert done.returncode == 0, done.stderr
        token = (short_tmp / "dashboard.token").read_text().strip()
        host = "localhost" if unix else address
        assert done.stdout.startswith(f"http://{host}/?token={token}")
        reply = await fetch(address, f"/?token={token}")
        assert reply.status == 303


async def test_open_event_streams_do_not_hold_up_a_stop(short_tmp: Path) -> None:
    """SIGTERM with live event streams (and a silent half-sent request) still exits 0 quickly."""
    address = f"127.0.0.1:{free_port()}"
    async with running_daemon(short_tmp, MODULES, http={"listen": address}) as d, d.client() as c:
        token = (await c.call("dashboard"))["url"].split("token=", 1)[1]
        host, _, port = address.rpartition(":")
        streams = []
        for _ in range(3):
            s = await anyio.connect_tcp(host, int(port))
            head = f"GET /events HTTP/1.1\r\nCookie: workflowd_dashboard={token}\r\n\r\n"
            await s.send(head.encode())
            streams.append(s)
        first = await streams[0].receive()
        assert first.startswith(b"HTTP/1.1 200") and b"text/event-stream" in first
        silent = await anyio.connect_tcp(host, int(port))
        await silent.send(b"GET / HT")  # never finished
        with anyio.fail_after(15):
            assert await d.stop() == 0
        for s in [*streams, silent]:
            await s.aclose()


async def test_unusable_token_file_stops_the_start(short_tmp: Path) -> None:
    """A token file the daemon cannot read (here: a folder) stops the start: exit 2, one line."""
    from tests.helpers.harness import run_workflowd, write_config

    (short_tmp / "dashboard.token").mkdir()
    config = write_config(short_tmp, MODULES, http={"listen": f"127.0.0.1:{free_port()}"})
    code, err = await run_workflowd(config)
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"workflowd: cannot read {short_tmp}/dashboard.token: Is a directory"
    ]
