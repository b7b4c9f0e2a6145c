"""Headless Chromium (Debian's `chromium` and `chromium-driver`) driven by Selenium."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def missing() -> str | None:
    """Say what is missing to run a browser test, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            return f"{path} is not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401 - only to know whether it is there
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


def need_browser() -> None:
    """Skip the test without a browser, except in CI (CI=true), where that fails it."""
    reason = missing()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the browser tests: {reason}")
    pytest.skip(reason)


@contextmanager
def chromium() -> Iterator[Any]:
    """Yield a headless Chromium WebDriver; quit it afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    # Both paths given: Selenium Manager never looks for (or downloads) a driver.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
