"""Load the built site in headless Chromium, offline, and report what a reader's browser does.

No Python dependency beyond the standard library: Chromium is driven over the DevTools protocol
through a pipe (``--remote-debugging-pipe``: JSON messages separated by NUL bytes on fds 3/4).
Every request the page makes is intercepted (``Fetch``): requests to the local server go on,
every other one is blocked and recorded as external; the host resolver also maps every name
but 127.0.0.1 to "not found", so nothing leaves the machine.

Used by ``tests/test_site.py`` (the browser test) and by ``make screenshots``::

    python scripts/browser.py check docs/_build/html            # every page; exit 1 on a problem
    python scripts/browser.py screenshots docs/_build/html OUT  # one PNG per main page
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = ("install it with `apt-get update && apt-get install -y chromium` (as root), "
                "or set KVDOC_CHROMIUM")
# Sphinx's generated pages that are not the site's content (they hold no maths or figures, but
# are still loaded and checked: search.html runs the search index script).
SKIP_SCREENSHOT = {"genindex.html", "search.html", "py-modindex.html"}
# Narrower windows are emulated as a phone (a touch screen, the page's viewport meta honoured).
MOBILE_BELOW = 800
# Every page is also laid out this wide (a common phone, in CSS pixels): nothing on it may make
# the page wider than the screen; a wide table scrolls inside its own box.
PHONE_WIDTH = 412
MIN_FIGURE_PX = 9  # CSS px: a figure's smallest label, as a phone shows it


def find_chromium() -> str | None:
    """The Chromium executable: ``$KVDOC_CHROMIUM``, else the first of CHROMIUM_NAMES on PATH."""
    if os.environ.get("KVDOC_CHROMIUM"):
        return os.environ["KVDOC_CHROMIUM"]
    for name in CHROMIUM_NAMES:
        if path := shutil.which(name):
            return path
    return None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve(root: Path) -> Iterator[str]:
    """Serve ``root`` on 127.0.0.1 (a free port) for the duration; yields the origin URL."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@dataclass
class PageReport:
    """What one page load did. ``problems()`` is empty for a page that holds."""

    url: str
    requests: list[str] = field(default_factory=list)
    external: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    maths: int = 0
    maths_unrendered: int = 0
    math_errors: int = 0
    mathjax_loaded: bool = False
    images: int = 0
    images_broken: list[str] = field(default_factory=list)
    images_without_alt: list[str] = field(default_factory=list)
    phone_overflow: int = 0  # CSS px the page is wider than a PHONE_WIDTH screen
    phone_culprits: list[str] = field(default_factory=list)
    small_figures: list[str] = field(default_factory=list)  # text under MIN_FIGURE_PX on a phone
    openables: int = 0  # answers (dropdown admonitions) and hidden code cells
    shown_closed: list[str] = field(default_factory=list)
    not_opening: list[str] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = [f"external request (blocked): {u}" for u in self.external]
        out += [f"failed request: {f}" for f in self.failed]
        out += [f"console error: {e}" for e in self.console_errors]
        if self.maths and not self.mathjax_loaded:
            out.append(f"{self.maths} maths elements but MathJax did not load")
        if self.maths_unrendered:
            out.append(f"{self.maths_unrendered} of {self.maths} maths elements "
                       "not rendered by MathJax")
        if self.math_errors:
            out.append(f"{self.math_errors} MathJax errors (bad TeX)")
        out += [f"image did not load: {u}" for u in self.images_broken]
        out += [f"image without alt text: {u}" for u in self.images_without_alt]
        if self.phone_overflow > 0:
            out.append(f"{self.phone_overflow} px wider than a {PHONE_WIDTH} px phone, "
                       f"because of: {'; '.join(self.phone_culprits)}")
        out += [f"figure text {f} on a {PHONE_WIDTH} px phone (at least {MIN_FIGURE_PX})"
                for f in self.small_figures]
        out += [f"visible before the reader opens it: {a}" for a in self.shown_closed]
        out += [f"shows nothing once opened: {a}" for a in self.not_opening]
        out += [f"page contains {f!r} (a path of the machine that built it)"
                for f in self.forbidden]
        return out


# Runs in the page after the load event: waits for MathJax and every image, then counts. Then
# opens every answer (a "Check yourself" admonition with :class: dropdown) and every hidden code
# cell (MyST-NB's hide-cell/hide-input <details>) and closes it again: what a reader sees of its
# body is measured as rendered (text boxes with a size, not hidden by visibility, opacity, a
# closed <details> or display: none), so a class name that nothing collapses does not pass.
# __FORBIDDEN__ is replaced by a JSON list of strings no page may contain (a build path).
_INSPECT = r"""
(async () => {
  const imgs = [...document.images];
  for (const i of imgs) { i.loading = "eager"; }
  await Promise.all(imgs.map(i => (i.complete ? null
                                 : new Promise(r => { i.onload = i.onerror = r; }))));
  const mj = window.MathJax && window.MathJax.startup && window.MathJax.startup.promise;
  if (mj) { await window.MathJax.startup.promise; }
  await document.fonts.ready;
  const maths = [...document.querySelectorAll(".math")];
  const shown = (nodes) => {
    const out = [];
    for (const root of nodes) {
      const walk = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
      for (let n = walk.nextNode(); n; n = walk.nextNode()) {
        const text = n.textContent.trim();
        const style = {opacityProperty: true, visibilityProperty: true};
        if (!text || !n.parentElement.checkVisibility(style)) { continue; }
        const range = document.createRange();
        range.selectNodeContents(n);
        if ([...range.getClientRects()].some(r => r.width > 0 && r.height > 0)) {
          out.push(text);
        }
      }
    }
    return out.join(" ");
  };
  const openables = [
    ...[...document.querySelectorAll(".admonition.dropdown")].map(el => ({
      kind: "answer", title: el.querySelector(".admonition-title"),
      body: [...el.children].filter(c => !c.classList.contains("admonition-title"))})),
    ...[...document.querySelectorAll("details.hide")].map(el => ({
      kind: "hidden cell", title: el.querySelector(":scope > summary"),
      body: [...el.children].filter(c => c.tagName !== "SUMMARY")})),
  ];
  const pause = () => new Promise(r => setTimeout(r, 400));  // the theme's 0.3 s fade
  const name = o => `${o.kind}: ${o.body.map(b => b.textContent).join(" ")
                                 .replace(/\s+/g, " ").trim().slice(0, 70)}`;
  const before = openables.map(o => shown(o.body));
  openables.forEach(o => o.title && o.title.click());
  // the fade, then as long as a loaded machine takes to lay them out (a fixed 0.4 s once saw
  // every hidden cell of a long page empty while other work ran): at most 10 s
  for (let t = 0; openables.length && t < 25; t++) {
    await pause();
    if (openables.every(o => shown(o.body))) { break; }
  }
  const after = openables.map(o => shown(o.body));
  openables.forEach(o => o.title && o.title.click());  // closed again, as a reader finds them
  if (openables.length) { await pause(); }
  const html = document.documentElement.outerHTML;
  return JSON.stringify({
    mathjax: !!(window.MathJax && window.MathJax.version),
    maths: maths.length,
    unrendered: maths.filter(e => !e.querySelector("mjx-container")).length,
    errors: document.querySelectorAll("mjx-merror").length,
    images: imgs.map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0,
                            alt: (i.getAttribute("alt") || "").trim()})),
    openables: openables.length,
    shown_closed: openables.filter((o, k) => before[k]).map(name),
    not_opening: openables.filter((o, k) => !after[k]).map(name),
    forbidden: __FORBIDDEN__.filter(f => html.includes(f)),
  });
})()
"""


# Run at PHONE_WIDTH: how far the page is wider than the screen, and the innermost elements
# that stick out of it and are not inside a box that scrolls (or clips) sideways by itself;
# and each SVG figure's smallest text as shown there. matplotlib draws a glyph of s pt as a path
# scaled by s / 100; an SVG's natural width is its width in pt, 4/3 CSS px each.
_TOO_WIDE = r"""
(async () => {
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const vw = document.documentElement.clientWidth;
  const figures = [];
  for (const img of document.images) {
    if (!img.src.endsWith(".svg") || !img.naturalWidth || !img.clientWidth) { continue; }
    const svg = await (await fetch(img.src)).text();
    const sizes = [...svg.matchAll(/scale\(([0-9.]+) -[0-9.]+\)/g)].map(m => 100 * +m[1])
      .filter(pt => pt < 40);  // glyphs; a marker or an image is drawn at scale 1
    if (!sizes.length) { continue; }
    figures.push({src: img.src, px: Math.min(...sizes) * 4 / 3 * img.clientWidth
                                    / img.naturalWidth});
  }
  const out = r => r.width > 0 && r.right > vw + 1;
  const boxed = el => {
    for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      if (["auto", "scroll", "hidden"].includes(getComputedStyle(p).overflowX)) { return true; }
    }
    return false;
  };
  const culprits = [...document.body.querySelectorAll("*")]
    .filter(el => out(el.getBoundingClientRect()) && !boxed(el) && !el.closest(".skip-link")
                  && ![...el.children].some(c => out(c.getBoundingClientRect())))
    .map(el => `<${el.tagName.toLowerCase()} class="${el.className}"> `
               + el.textContent.replace(/\s+/g, " ").trim().slice(0, 50));
  return JSON.stringify({over: document.documentElement.scrollWidth - vw,
                         culprits: culprits.slice(0, 3), figures});
})()
"""


class Chromium:
    """A headless Chromium driven over a DevTools pipe; allows requests to ``origin`` only."""

    FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--no-default-browser-check", "--disable-background-networking",
             "--disable-component-update",
             "--disable-sync", "--disable-extensions", "--disable-default-apps", "--mute-audio",
             "--hide-scrollbars", "--remote-debugging-pipe", "--window-size=1280,900",
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")

    def __init__(self, executable: str, origin: str, timeout_s: float = 60.0) -> None:
        self.origin, self.timeout_s = origin, timeout_s
        self.profile = tempfile.mkdtemp(prefix="kvdoc-chromium-")
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, executable, *self.FLAGS, f"--user-data-dir={self.profile}",
             "about:blank"],
            pass_fds=(to_chrome_r, from_chrome_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        self.blocked: list[str] = []
        self._metrics: dict[str, dict] = {}  # each tab's own window size
        self.version = self.send("Browser.getVersion")["product"]

    # -- protocol ------------------------------------------------------------------------------
    def _post(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._id += 1
        msg: dict = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        return self._id

    def _read(self, deadline: float) -> dict | None:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                return None
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                stderr = self.proc.stderr
                err = stderr.read().decode(errors="replace")[-2000:] if stderr else ""
                raise RuntimeError(
                    f"Chromium closed the DevTools pipe (exit {self.proc.poll()}): {err}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def _event(self, msg: dict) -> None:
        if msg["method"] == "Fetch.requestPaused":  # answer at once, or the page stalls
            url = msg["params"]["request"]["url"]
            rid = msg["params"]["requestId"]
            if self.allowed(url):
                self._post("Fetch.continueRequest", {"requestId": rid}, msg.get("sessionId"))
            else:
                self.blocked.append(url)
                self._post("Fetch.failRequest",
                           {"requestId": rid, "errorReason": "BlockedByClient"},
                           msg.get("sessionId"))
        self.events.append(msg)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send a command and wait for its answer, handling the events that arrive meanwhile."""
        mid = self._post(method, params, session)
        deadline = time.monotonic() + self.timeout_s
        while True:
            msg = self._read(deadline)
            if msg is None:
                raise TimeoutError(f"Chromium did not answer {method} within {self.timeout_s} s")
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self._event(msg)

    def pump(self, seconds: float, until: str | None = None, session: str | None = None) -> bool:
        """Handle events for ``seconds``, or until event ``until`` of ``session``.

        True if that event came.
        """
        deadline = time.monotonic() + seconds
        while (msg := self._read(deadline)) is not None:
            if "method" in msg:
                self._event(msg)
                if msg["method"] == until and msg.get("sessionId") == session:
                    return True
        return False

    def allowed(self, url: str) -> bool:
        return url.startswith((self.origin + "/", "data:", "blob:", "about:"))

    # -- pages -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def tab(self, width: int = 1280, height: int = 900, scale: float = 1) -> Iterator[str]:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget",
                            {"targetId": target, "flatten": True})["sessionId"]
        self._metrics[session] = {"width": width, "height": height, "deviceScaleFactor": scale,
                                  "mobile": width < MOBILE_BELOW}
        for method, params in (("Fetch.enable", {"patterns": [{"urlPattern": "*"}]}),
                               ("Network.enable", {}),
                               ("Runtime.enable", {}), ("Log.enable", {}), ("Page.enable", {}),
                               ("Network.setCacheDisabled", {"cacheDisabled": True}),
                               ("Emulation.setDeviceMetricsOverride", self._metrics[session])):
            self.send(method, params, session)
        try:
            yield session
        finally:
            self.send("Target.closeTarget", {"targetId": target})

    def load(self, session: str, url: str, forbidden: tuple[str, ...] = (),
             inspect: bool = True) -> PageReport:
        """Navigate, wait for the load event, MathJax and every image; report what happened.

        ``forbidden``: strings the page must not contain anywhere in its HTML (a build path).
        ``inspect=False``: requests, console errors and the phone's width only (no MathJax,
        images or openables: a page seen again, as a reading path shows it).
        """
        self.events.clear()
        self.blocked.clear()
        self.send("Page.navigate", {"url": url}, session)
        if not self.pump(self.timeout_s, until="Page.loadEventFired", session=session):
            raise TimeoutError(f"{url} did not finish loading within {self.timeout_s} s")
        seen = dict(mathjax=False, maths=0, unrendered=0, errors=0, images=[], openables=0,
                    shown_closed=[], not_opening=[], forbidden=[])
        if inspect:
            expression = _INSPECT.replace("__FORBIDDEN__", json.dumps(list(forbidden)))
            result = self.send("Runtime.evaluate", {"expression": expression,
                                                    "awaitPromise": True,
                                                    "returnByValue": True}, session)
            if "exceptionDetails" in result:
                raise RuntimeError(f"inspecting {url} failed: {result['exceptionDetails']}")
            seen = json.loads(result["result"]["value"])
        seen.update(self._phone(session))
        self.pump(0.3)  # late requests (fonts, lazy scripts)
        return self._report(url, session, seen)

    def _phone(self, session: str) -> dict:
        """Lay the page out PHONE_WIDTH wide, measure what sticks out, and put the tab back."""
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": PHONE_WIDTH, "height": 900, "deviceScaleFactor": 1, "mobile": True},
                  session)
        try:
            result = self.send("Runtime.evaluate", {"expression": _TOO_WIDE, "awaitPromise": True,
                                                    "returnByValue": True}, session)
        finally:
            self.send("Emulation.setDeviceMetricsOverride", self._metrics[session], session)
        return json.loads(result["result"]["value"])

    def _report(self, url: str, session: str, seen: dict) -> PageReport:
        report = PageReport(url=url, mathjax_loaded=seen["mathjax"], maths=seen["maths"],
                            maths_unrendered=seen["unrendered"], math_errors=seen["errors"],
                            images=len(seen["images"]), external=sorted(set(self.blocked)))
        report.images_broken = [i["src"] for i in seen["images"] if not i["ok"]]
        report.images_without_alt = [i["src"] for i in seen["images"] if not i["alt"]]
        report.phone_overflow, report.phone_culprits = seen["over"], seen["culprits"]
        report.small_figures = [f"{f['px']:.1f} px: {f['src'].rsplit('/', 1)[-1]}"
                                for f in seen["figures"] if f["px"] < MIN_FIGURE_PX]
        report.openables = seen["openables"]
        report.shown_closed, report.not_opening = seen["shown_closed"], seen["not_opening"]
        report.forbidden = seen["forbidden"]
        urls: dict[str, str] = {}
        for ev in self.events:
            if ev.get("sessionId") != session:
                continue
            p = ev.get("params", {})
            match ev["method"]:
                case "Network.requestWillBeSent":
                    urls[p["requestId"]] = p["request"]["url"]
                    report.requests.append(p["request"]["url"])
                case "Network.responseReceived" if p["response"]["status"] >= 400:
                    report.failed.append(f"{p['response']['url']}: HTTP {p['response']['status']}")
                case "Network.loadingFailed" if not p.get("errorText", "").startswith(
                        "net::ERR_BLOCKED_BY_CLIENT"):
                    report.failed.append(f"{urls.get(p['requestId'], '?')}: {p.get('errorText')}")
                case "Runtime.exceptionThrown":
                    d = p["exceptionDetails"]
                    report.console_errors.append(
                        d.get("exception", {}).get("description") or d.get("text", "?"))
                case "Runtime.consoleAPICalled" if p["type"] in ("error", "assert"):
                    report.console_errors.append(
                        " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
                case "Log.entryAdded" if p["entry"]["level"] == "error":
                    entry = p["entry"]
                    report.console_errors.append(f"{entry['text']} ({entry.get('url', '')})")
        return report

    def screenshot(self, session: str, path: Path, width: int = 1280, height: int = 900,
                   max_height: int = 16000, scale: float = 1) -> None:
        """Save the whole page (up to ``max_height`` CSS pixels tall) as a PNG, ``width`` wide.

        The viewport is stretched to the page's height for the capture (so the layout is the one a
        ``width``-wide window shows), then put back.
        """
        size = self.send("Page.getLayoutMetrics", {}, session)["cssContentSize"]
        full = max(height, min(int(size["height"]) + 1, max_height))
        metrics = {"width": width, "deviceScaleFactor": scale, "mobile": width < MOBILE_BELOW}
        self.send("Emulation.setDeviceMetricsOverride", {**metrics, "height": full}, session)
        try:
            frame = "new Promise(r => requestAnimationFrame(() => r(1)))"
            self.send("Runtime.evaluate", {"expression": frame, "awaitPromise": True}, session)
            data = self.send("Page.captureScreenshot", {"format": "png"}, session)["data"]
        finally:
            self.send("Emulation.setDeviceMetricsOverride", {**metrics, "height": height}, session)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._post("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)


def build_paths() -> tuple[str, ...]:
    """This machine's paths that no built page may show: the repository's (as found and with
    links resolved, for a worktree or a linked checkout) and the Python environment's, whose
    site-packages paths leak through a module's repr."""
    root = Path(__file__).absolute().parents[1]
    prefix = Path(sys.prefix)
    return tuple(sorted({str(root), str(root.resolve()), str(prefix), str(prefix.resolve())}))


def pages_of(site: Path) -> list[str]:
    """Every HTML page of a built site, relative to it, sorted."""
    return sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                  if not p.relative_to(site).parts[0].startswith("_"))


@dataclass
class SiteReport:
    pages: list[PageReport]
    browser: str

    @property
    def failures(self) -> dict[str, list[str]]:
        return {p.url: p.problems() for p in self.pages if p.problems()}

    def summary(self) -> str:
        n_req = sum(len(p.requests) for p in self.pages)
        n_ext = sum(len(p.external) for p in self.pages)
        n_fail = sum(len(p.failed) for p in self.pages)
        return (f"{self.browser}: {len(self.pages)} pages checked, {n_req} requests seen "
                f"({n_ext} external, {n_fail} failed), "
                f"{sum(len(p.console_errors) for p in self.pages)} console errors, "
                f"{sum(p.maths - p.maths_unrendered for p in self.pages)}/"
                f"{sum(p.maths for p in self.pages)} "
                f"maths rendered, {sum(p.images - len(p.images_broken) for p in self.pages)}/"
                f"{sum(p.images for p in self.pages)} images loaded, "
                f"{sum(p.openables - len(p.shown_closed) for p in self.pages)}/"
                f"{sum(p.openables for p in self.pages)} answers and hidden cells closed")


def check_site(site: Path, executable: str, pages: list[str] | None = None,
               forbidden: tuple[str, ...] = (), browsers: int | None = None) -> SiteReport:
    """Load every page of ``site`` (or ``pages``, relative paths) from a local server.

    ``forbidden``: strings no page may contain (the paths of the machine that built it).
    ``browsers``: Chromium processes loading pages at once (default: one a core, at most 4);
    a page's report is the same whichever loads it, and the reports come in page order.
    """
    pages = pages_of(site) if pages is None else pages
    browsers = max(1, min(browsers or min(os.cpu_count() or 1, 4), len(pages)))
    shares = [pages[i::browsers] for i in range(browsers)]
    with serve(site) as origin, ThreadPoolExecutor(browsers) as pool:
        # a thread mostly waits on its browser's pipe, so the browsers render side by side
        done = list(pool.map(lambda share: _load_all(executable, origin, share, forbidden),
                             shares))
    by_url = {r.url: r for reports, _ in done for r in reports}
    return SiteReport([by_url[f"{origin}/{page}"] for page in pages], done[0][1])


def _load_all(executable: str, origin: str, pages: list[str],
              forbidden: tuple[str, ...]) -> tuple[list[PageReport], str]:
    browser = Chromium(executable, origin)
    try:
        with browser.tab() as session:
            return [browser.load(session, f"{origin}/{page}", forbidden) for page in pages], \
                browser.version
    finally:
        browser.close()


def screenshots(site: Path, out: Path, executable: str, pages: list[str] | None = None,
                width: int = 1280, scale: float = 1) -> list[Path]:
    """One full-page PNG per page (default: every page but Sphinx's index/search pages).

    ``width``: CSS pixels (412 is a common phone); ``scale``: device pixels per CSS pixel (a
    phone's 2 or more shows whether a figure has the detail for it; the PNG is that much wider).
    """
    pages = [p for p in pages_of(site) if p not in SKIP_SCREENSHOT] if pages is None else pages
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with serve(site) as origin:
        browser = Chromium(executable, origin)
        try:
            with browser.tab(width, scale=scale) as session:
                for page in pages:
                    report = browser.load(session, f"{origin}/{page}")
                    for problem in report.problems():
                        print(f"warning: {page}: {problem}", file=sys.stderr)
                    path = out / (page.removesuffix(".html").replace("/", "__") + ".png")
                    browser.screenshot(session, path, width, scale=scale)
                    written.append(path)
        finally:
            browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="load every page; exit 1 on any problem")
    check.add_argument("site", type=Path)
    shots = sub.add_parser("screenshots", help="render pages to PNG")
    shots.add_argument("site", type=Path)
    shots.add_argument("out", type=Path)
    shots.add_argument("--width", type=int, default=1280, help="CSS pixels (default 1280)")
    shots.add_argument("--scale", type=float, default=1,
                       help="device pixels per CSS pixel (default 1; a phone has 2 or more)")
    shots.add_argument("pages", nargs="*",
                       help="pages relative to the site (default: the main pages)")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"no built site at {args.site}: run `make html` first", file=sys.stderr)
        return 2
    executable = find_chromium()
    if executable is None:
        print(f"Chromium not found: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if args.command == "screenshots":
        for path in screenshots(args.site, args.out, executable, args.pages or None,
                                width=args.width, scale=args.scale):
            print(path)
        return 0
    report = check_site(args.site, executable, forbidden=build_paths())
    for url, problems in report.failures.items():
        print(f"FAIL {url}", *(f"  {p}" for p in problems), sep="\n")
    print(report.summary())
    print(f"{len(report.pages) - len(report.failures)} passed, {len(report.failures)} failed")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
