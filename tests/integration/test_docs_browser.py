"""The built documentation site in a real browser (issue 31, item 5): headless Chromium (Debian's `chromium`, which
`make install` installs) opens every page from a local HTTP server and the test fails on a console error, a failed
request, a broken image or an empty page; the site's search finds a spec field on the spec reference page.

Chromium is driven over its DevTools protocol (a WebSocket) with websocket-client; nothing leaves the machine (the
theme's web fonts are off in mkdocs.yml).
"""

from __future__ import annotations

import functools
import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make install installs it)"),
]
MIN_TEXT = 80  # characters of an article: less is an empty page


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # one line per request would bury a failure's output
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The site built from docs/ and served on a free port of 127.0.0.1: (base URL, folder)."""
    folder = tmp_path_factory.mktemp("docs") / "site"
    build = [sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir", str(folder)]
    subprocess.run(build, cwd=ROOT, check=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", folder
    server.shutdown()


class Page:
    """One browser tab, spoken to over the DevTools protocol; remembers every error it reports."""

    def __init__(self, ws_url: str) -> None:
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)
        self.errors: list[str] = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self.ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == ident:
                assert "error" not in message, message
                return message.get("result", {})
            self.note(message)

    def note(self, event: dict[str, Any]) -> str | None:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.errors.append(f"exception: {params['exceptionDetails'].get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(f"console.error: {[a.get('value') for a in params.get('args', [])]}")
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            self.errors.append(f"request failed: {params.get('errorText')}")
        return method

    def open(self, url: str) -> None:
        self.errors.clear()
        self.call("Page.navigate", url=url)
        while self.note(json.loads(self.ws.recv())) != "Page.loadEventFired":
            pass
        self.settle(0.3)

    def settle(self, seconds: float) -> None:
        """Take the events of the next `seconds` (late console errors, failed requests)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.ws.settimeout(left)
            try:
                self.note(json.loads(self.ws.recv()))
            except Exception:  # the timeout: nothing more arrived
                break
        self.ws.settimeout(60)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        import base64

        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    profile = tmp_path_factory.mktemp("chromium-profile")
    browser = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=1280,900",
         "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = devtools_port(browser)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as answer:
            tab = Page(json.load(answer)["webSocketDebuggerUrl"])
        yield tab
        tab.ws.close()
    finally:
        browser.terminate()
        browser.wait(timeout=30)


def devtools_port(browser: subprocess.Popen) -> int:
    """Chromium prints `DevTools listening on ws://127.0.0.1:PORT/...` once it listens (port 0: it picks one)."""
    for line in browser.stderr:
        if "DevTools listening on" in line:
            return int(line.split("ws://127.0.0.1:")[1].split("/")[0])
    raise AssertionError(f"chromium exited ({browser.wait()}) before it listened")


def pages_of(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder).parent) for p in folder.rglob("index.html"))


BROKEN_IMAGES = "[...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
ARTICLE_TEXT = "(document.querySelector('article') || document.body).innerText.trim().length"


def test_every_page_opens_without_an_error(site: tuple[str, Path], page: Page, tmp_path: Path) -> None:
    base, folder = site
    names = pages_of(folder)
    assert len(names) >= 20 and "reference/spec" in names
    problems = []
    for name in names:
        page.open(base + ("" if name == "." else name + "/"))
        if page.errors:
            problems.append(f"{name}: {page.errors}")
        if broken := page.evaluate(BROKEN_IMAGES):
            problems.append(f"{name}: broken images {broken}")
        if (length := page.evaluate(ARTICLE_TEXT)) < MIN_TEXT:
            problems.append(f"{name}: empty page ({length} characters)")
    assert not problems, "\n".join(problems)
    page.open(base)
    assert page.evaluate("document.images.length") >= 1, "the home page shows the architecture picture"


def test_search_finds_a_spec_field_on_the_spec_reference(site: tuple[str, Path], page: Page) -> None:
    base, _ = site
    page.open(base + "reference/spec/")
    search = (  # Material's search reads the query on keyup, as a user's typing ends
        "(() => { const input = document.querySelector('input.md-search__input'); input.focus();"
        " input.value = 'kl_clamp'; input.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true})); })()"
    )
    links: list[str] = []
    deadline = time.monotonic() + 120  # the search worker builds its index first: slow on a loaded machine
    while not links and time.monotonic() < deadline:
        page.evaluate(search)  # again each time: a query typed before the index was ready is not re-run
        page.settle(1.0)
        links = page.evaluate("[...document.querySelectorAll('.md-search-result__item a')].map(a => a.href)")
    assert any("reference/spec/" in link for link in links), links
    assert not page.errors, page.errors


def test_the_browser_sees_what_it_must_fail_on(site: tuple[str, Path], page: Page) -> None:
    """A page with a missing image and a console error: both are caught (the checks above could fail)."""
    base, folder = site
    (folder / "broken.html").write_text('<img src="missing.png"><script>console.error("boom")</script>')
    page.open(base + "broken.html")
    assert page.evaluate(BROKEN_IMAGES) == [base + "missing.png"]
    assert any("boom" in e for e in page.errors) and any("404" in e for e in page.errors), page.errors
    assert page.evaluate(ARTICLE_TEXT) < MIN_TEXT
