"""Headless Chromium (Debian's ``chromium`` package) driven by Playwright, for what a person sees in MLflow's UI.

Playwright cannot download its own browser here, so it launches the system's. Where there is none the UI tests skip,
unless ``HYDRADDP_BROWSER_REQUIRED=1`` (CI, whose setup installs it) makes that a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM = os.environ.get("HYDRADDP_CHROMIUM", "/usr/bin/chromium")
# As the machine's notes say: without the background-networking flags Chromium keeps dialling out of a closed network.
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
SCREENSHOTS_ENV = "HYDRADDP_SCREENSHOTS_DIR"  # also copy the screenshots there (docs/ui: the README's pictures)
WAIT_MS = 60_000  # a page is ready in about 2 s on a quiet machine; CI runs two test files at once


def browser_or_skip() -> None:
    missing = [what for what, found in (("Debian's chromium", Path(CHROMIUM).exists()),
                                        ("playwright", _has_playwright())) if not found]
    if missing:
        message = (f"{' and '.join(missing)} missing: apt-get install chromium, and pip install -e '.[test]' "
                   "(bash scripts/dev.sh test does both)")
        if os.environ.get("HYDRADDP_BROWSER_REQUIRED") == "1":
            pytest.fail(message)
        pytest.skip(message)


def _has_playwright() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """A Playwright browser; ``new_page(browser)`` opens a page as a first visit (no stored UI state)."""
    browser_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser):
    page = browser.new_context(viewport={"width": 1600, "height": 1000}).new_page()
    page.set_default_timeout(WAIT_MS)
    return page


def screenshot(page, path: Path) -> None:
    """``path``, and a copy in ``$HYDRADDP_SCREENSHOTS_DIR`` when set. MLflow's assistant panel, which opens on a first
    visit, is closed first: it covers a third of the page."""
    close = page.locator("button[aria-label='Close']")
    if close.count():
        close.first.click()
        page.wait_for_timeout(300)
    page.screenshot(path=str(path))
    target = os.environ.get(SCREENSHOTS_ENV)
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)
