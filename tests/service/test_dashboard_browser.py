"""The admin dashboard in a real headless Chromium (Debian's ``chromium`` and ``chromedriver``, driven by Selenium)
against a real ``kvshelf serve``: the page loads and draws its charts within 1 s of navigation on loopback, its
numbers move after real puts, gets and prefix lookups, a token-protected dashboard opens through its login form;
with blocks held, its first paint shows placeholders then the server's numbers (never a zero), its charts start
from the server's history, models show by name, the latency and tier panels hold data, and a tier that goes away
shows as unreachable.
Screenshots are kept under ``tests/artifacts/dashboard/`` (ignored by git; ``KVSHELF_TEST_ARTIFACTS`` moves them);
the first-paint figures go to ``first_paint.json`` there. ``make test`` installs chromium when it is absent."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dashboard_helpers import TOKEN, request, serve_with_dashboard, token_file, traffic
from helpers import FINGERPRINT
from redis_servers import restartable_redis  # noqa: F401 (a fixture)

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("KVSHELF_TEST_ARTIFACTS", REPO / "tests" / "artifacts")) / "dashboard"
WAIT_S = 20
PLACEHOLDER = "\u2013"
#: installed before the page's own code: every text the watched elements show, in order, from the first parse on
RECORDER = """
window.__seen = [];
const watched = ["tile-blocks", "tile-bytes", "tile-lookup-rate", "tile-retrieve-rate", "tile-events", "status"];
const shown = {};
function look() {
  for (const id of watched) {
    const node = document.getElementById(id);
    if (node && node.textContent.trim() && node.textContent !== shown[id]) {
      shown[id] = node.textContent;
      window.__seen.push([id, node.textContent.trim()]);
    }
  }
}
new MutationObserver(look).observe(document, {subtree: true, childList: true, characterData: true});
document.addEventListener("DOMContentLoaded", look);
"""

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


def _history_points(port: int, at_least: int) -> int:
    """Wait until the server's history (``/api/history``) holds ``at_least`` points; their count."""
    for _ in range(WAIT_S * 10):
        status, _, body = request(f"http://127.0.0.1:{port}/api/history")
        assert status == 200, body
        points = json.loads(body)["points"]
        if len(points) >= at_least:
            return len(points)
        time.sleep(0.1)
    raise AssertionError(f"the server kept {len(points)} history points, not {at_least}, within {WAIT_S} s")


def test_first_paint_with_blocks_held_history_names_latency_and_tiers(tmp_path, capsys, browser):
    """A server holding blocks: until the first answer every number is a placeholder, then the server's own
    (never "0 blocks held" nor "n/a" first); the first charts already hold the server's history; the model shows
    by the name its blocks carry (its fingerprint as the tooltip); the latency and tier panels hold data."""
    running, port = serve_with_dashboard(tmp_path, capsys, history_interval=0.2)
    try:
        traffic(running.grpc, "tenant-a", 3, model_name="smollm2-135m")
        traffic(running.grpc, "tenant-b", 1, seed=1, model_name="smollm2-135m")
        _history_points(port, 5)
        browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORDER})
        browser.get(f"http://127.0.0.1:{port}/")
        _wait(browser, "window.__kvshelf && window.__kvshelf.draws >= 1", "the first charts")
        seen = browser.execute_script("return window.__seen;")
        first = browser.execute_script("return window.__kvshelf;")

        def shown(element_id: str) -> list[str]:
            return [text for name, text in seen if name == element_id]

        assert shown("tile-blocks")[0] == PLACEHOLDER, seen  # the paint before the first answer
        assert "0" not in shown("tile-blocks") and shown("tile-blocks")[-1] == "4", seen
        assert shown("tile-lookup-rate") == [PLACEHOLDER, "100.0%"], seen
        assert shown("tile-retrieve-rate") == [PLACEHOLDER, "66.7%"], seen
        assert shown("tile-events")[0] == PLACEHOLDER and "0" not in shown("tile-events"), seen
        assert not any("connecting" in text for text in shown("status")), seen
        # the first draw: the server's history (both tiers' usage over several points), not one point
        assert first["historyPoints"] >= 3, first
        assert first["firstDrawPoints"]["bytes"] >= 2 * first["historyPoints"], first
        assert first["firstDrawPoints"]["hit-rate"] >= 2, first  # hit rates from the history's counts
        assert first["historyError"] is None and first["lastError"] is None, first
        assert "points of the server's history" in _text(browser, "history-note")
        # models by name, the fingerprint in the tooltip
        series = _text(browser, "table-series")
        assert "smollm2-135m" in series and "tenant-b" in series
        cell = browser.find_element("css selector", "#table-series td.model")
        assert FINGERPRINT in cell.get_attribute("title") and "2 layers, 2 KV heads x 8" in cell.get_attribute("title")
        # request latency per method, over a window of this page's polls
        latency = _text(browser, "table-latency")
        assert "LookupPrefix" in latency and " ms" in latency, latency
        _wait(browser, "window.__kvshelf.polls >= 3", "a few polls")
        assert "over the last" in _text(browser, "latency-note")
        # the tiers' health and usage
        tiers = _text(browser, "table-tiers")
        assert "memory up" in tiers and "disk up" in tiers and "of 16.0 MiB" in tiers, tiers
        assert _text(browser, "tile-health") == "all up"
        traffic(running.grpc, "tenant-a", 2, seed=7, model_name="smollm2-135m")  # live hit rates, by model name
        legend = "document.getElementById('legend-hit-rate').textContent"
        _wait(browser, f"{legend}.includes('tenant-a \u00b7 smollm2-135m')", "the hit rate of tenant-a's smollm2-135m")
        for chart in ("hit-rate", "bytes", "blocks"):
            assert _canvas_has_ink(browser, chart), chart
        path = _shot(browser, "5-history-names-latency-tiers")
        shutil.copyfile(path, "/tmp/dash.png")
    finally:
        running.close()


def test_tier_panel_shows_a_tier_that_went_away(tmp_path, capsys, browser, restartable_redis):  # noqa: F811
    """A Redis tier whose server stops: the tier panel and the health tile say unreachable (its reads miss, the
    other tiers serve); back, it is degraded while the failures counted meanwhile are recent (60 s)."""
    running, port = serve_with_dashboard(tmp_path, capsys, redis=restartable_redis.url)
    try:
        traffic(running.grpc, "tenant-a", 2)
        browser.get(f"http://127.0.0.1:{port}/")
        _wait(browser, "document.getElementById('table-tiers').textContent.includes('redis')", "the redis tier")
        assert "redis up" in _text(browser, "table-tiers")
        restartable_redis.stop()
        _wait(browser, "document.getElementById('tile-health').textContent.includes('redis unreachable')",
              "the redis tier unreachable")
        assert "redis unreachable" in _text(browser, "table-tiers")
        traffic(running.grpc, "tenant-a", 2, seed=5)  # served by the other tiers; the writes to Redis fail
        _wait(browser, "document.getElementById('table-tiers').textContent.includes('unreachable')", "still down")
        _shot(browser, "6-redis-unreachable")
        restartable_redis.start()
        _wait(browser, "document.getElementById('tile-health').textContent === 'redis degraded'", "Redis back")
        assert "redis degraded" in _text(browser, "table-tiers")
    finally:
        running.close()
