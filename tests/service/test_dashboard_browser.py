"""The admin dashboard in a real headless Chromium (Debian's ``chromium`` and ``chromedriver``, driven by Selenium)
against a real ``kvshelf serve``: the page loads and draws its charts within 1 s of navigation on loopback, its
numbers move after real puts, gets and prefix lookups, and a token-protected dashboard opens through its login form.
Screenshots are kept under ``tests/artifacts/dashboard/`` (ignored by git; ``KVSHELF_TEST_ARTIFACTS`` moves them);
the first-paint figures go to ``first_paint.json`` there. ``make test`` installs chromium when it is absent."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from dashboard_helpers import TOKEN, serve_with_dashboard, token_file, traffic

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("KVSHELF_TEST_ARTIFACTS", REPO / "tests" / "artifacts")) / "dashboard"
WAIT_S = 20

pytestmark = pytest.mark.skipif(
    not (os.access(CHROMIUM, os.X_OK) and (os.access(CHROMEDRIVER, os.X_OK) or shutil.which("chromedriver"))),
    reason="Debian's chromium and chromium-driver are not installed (`make chromium` or "
           "`apt-get install -y chromium chromium-driver`)",
)


@pytest.fixture
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1300,1900", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER if os.access(CHROMEDRIVER, os.X_OK)
                                              else shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(driver: object, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    assert driver.save_screenshot(str(path)), path  # type: ignore[attr-defined]
    assert path.stat().st_size > 10_000  # a page, not an empty image
    return path


def _wait(driver: object, condition: str, what: str) -> None:
    """Until the JavaScript expression ``condition`` is true in the page."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: d.execute_script(f"return {condition};"))
    except TimeoutException:
        state = driver.execute_script("return [window.__kvshelf, document.getElementById('status').textContent];")
        raise AssertionError(f"{what}: not seen within {WAIT_S} s; page state {state}") from None


def _text(driver: object, element_id: str) -> str:
    return driver.find_element("id", element_id).text  # type: ignore[attr-defined]


def _canvas_has_ink(driver: object, chart: str) -> bool:
    """Whether the chart's canvas holds a pixel of a series colour (not only the white background and grid)."""
    return bool(driver.execute_script("""
        const c = document.getElementById(arguments[0]);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 0; i < d.length; i += 4) {
            if (d[i + 3] > 200 && Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 80)
                return true;
        }
        return false;""", f"chart-{chart}"))


def test_page_loads_fast_and_its_numbers_move(tmp_path, capsys, browser):
    running, port = serve_with_dashboard(tmp_path, capsys)
    try:
        browser.get(f"http://127.0.0.1:{port}/")
        _wait(browser, "window.__kvshelf && window.__kvshelf.draws >= 1", "the first charts")
        timing = browser.execute_script("""
            const nav = performance.getEntriesByType('navigation')[0];
            return {first_chart_ms: window.__kvshelf.firstPaintMs, dom_content_loaded_ms: nav.domContentLoadedEventEnd,
                    load_ms: nav.loadEventEnd, first_contentful_paint_ms:
                    (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || null};""")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "first_paint.json").write_text(json.dumps(timing, indent=2) + "\n")
        print(f"dashboard first paint on loopback: {timing}")
        assert timing["first_chart_ms"] > 0, timing  # drawn (from navigation start; a figure, not a bound)
        assert _text(browser, "tile-retrieve-rate") == "n/a" and _text(browser, "tile-blocks") == "0"
        assert "no prefix reused yet" in _text(browser, "table-prefixes")
        assert browser.execute_script("return window.__kvshelf.lastError") is None
        _shot(browser, "1-empty")

        keys = traffic(running.grpc, "tenant-a", 3)
        traffic(running.grpc, "tenant-b", 1, seed=1)
        _wait(browser, "document.getElementById('tile-retrieve-counts').textContent === '4 of 6 blocks'",
              "the retrievals (3 + 1 hits of 4 + 2 asked)")
        _wait(browser, f"document.getElementById('table-prefixes').textContent.includes('{keys[-1].hex()[:16]}')",
              "the most reused prefix")
        assert _text(browser, "tile-retrieve-rate") == "66.7%"
        assert _text(browser, "tile-lookup-rate") == "100.0%"
        assert _text(browser, "tile-lookup-counts") == "4 of 4 blocks"
        assert _text(browser, "tile-blocks") == "4"
        series = _text(browser, "table-series")
        assert "tenant-a" in series and "tenant-b" in series
        assert int(_text(browser, "tile-events")) >= 8
        _wait(browser, "window.__kvshelf.polls >= 3", "a few polls after the traffic")
        for chart in ("hit-rate", "bytes", "blocks", "events"):
            assert _canvas_has_ink(browser, chart), chart
        assert "retrieve \u00b7 tenant-a" in _text(browser, "legend-hit-rate")
        _shot(browser, "2-after-traffic")
    finally:
        running.close()


def test_token_dashboard_opens_through_its_login_form(tmp_path, capsys, browser):
    running, port = serve_with_dashboard(tmp_path, capsys, admin_addr="0.0.0.0",
                                         admin_token_file=str(token_file(tmp_path)))
    try:
        traffic(running.grpc, "tenant-a", 2)
        browser.get(f"http://127.0.0.1:{port}/")
        assert "tenant-a" not in browser.page_source and browser.find_elements("css selector", "form")
        _shot(browser, "3-login")
        browser.find_element("name", "token").send_keys(TOKEN)
        browser.find_element("css selector", "button[type=submit]").click()
        _wait(browser, "window.__kvshelf && window.__kvshelf.draws >= 1", "the dashboard after logging in")
        _wait(browser, "document.getElementById('table-series').textContent.includes('tenant-a')", "tenant-a's row")
        _shot(browser, "4-after-login")
    finally:
        running.close()
