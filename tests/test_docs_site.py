"""The documentation: README as a landing page, the site's generated pages current, every
error code the server sends documented, a strict build, and the built site opened offline
in Debian's headless Chromium with no missing asset.

The site is built here with `mkdocs build --strict` (a broken link or anchor fails it), as
`make test` and `make docs` build it. The browser test uses the `browser` fixture of
conftest.py (it fails, not skips, without chromium unless ESPN_BROWSER_TESTS=0).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from tools.docs_pages import write_pages

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: What a page fetches when it is viewed: stylesheets, scripts, images, icons.
ASSET = re.compile(r"<(?:link|script|img|source)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", re.I)
CSS_URL = re.compile(r"url\(\s*['\"]?([^'\")]+)")
#: The two set-up commands, as the README has always given them.
SERVE_SAMPLE = "make serve-sample   # installs into .venv, indexes the bundled sample corpus once, serves it on"
MAKE_TEST = "make test           # installs into .venv"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, f"mkdocs build --strict failed (`make install` installs the [docs] extra):\n" \
                                  f"{built.stderr[-4000:]}"
    return out


def test_readme_is_a_landing_page_with_the_two_commands_first() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    first_block = readme.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0].startswith(SERVE_SAMPLE) and first_block[1].startswith(MAKE_TEST)
    assert readme.index("```sh") < readme.index("## ")  # the commands come before any section
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert local and all((ROOT / link).exists() for link in local), [l for l in local if not (ROOT / l).exists()]


def test_generated_pages_are_current() -> None:
    """docs/reference/cli.md, http-api.md, settings.md and openapi.json, as `make docs` writes them."""
    stale = write_pages(DOCS, check=True)
    assert not stale, f"out of date (run `make docs`): {[str(p.relative_to(ROOT)) for p in stale]}"


def test_error_codes_sent_and_documented_agree() -> None:
    # The server's own answers, and the codes the library's errors carry (the server answers with them).
    files = [*ROOT.joinpath("server").rglob("*.py"), ROOT / "espn" / "errors.py", *ROOT.joinpath("espn", "engine").rglob("*.py")]
    sources = "\n".join(p.read_text() for p in sorted(files))
    patterns = [r'code="(\w+)"', r'^\s+code = "(\w+)"$', r'_Status\(\d{3}, "(\w+)"',
                r'error_response\(\s*\d+,\s*"(\w+)"', r'_error\(\s*\d+,\s*"(\w+)"',
                r'"error":\s*"(\w+)"', r'\berror="(\w+)"', r'error_body\([^()]*, "(\w+)"\)', r'code, message = "(\w+)"', r'^\s+\d{3}: "(\w+)",$']
    codes = {code for pattern in patterns for code in re.findall(pattern, sources, re.M)}
    assert {"method_not_allowed", "conflict", "over_budget", "invalid_utf8", "write_timeout"} <= codes  # the regexes see
    page = (DOCS / "reference" / "errors.md").read_text()
    documented = set(re.findall(r"^\| (?:\d{3}|4xx/5xx) \| `(\w+)` \|", page, re.M))
    missing = sorted(codes - documented - {"error"})  # "error": the registry's fallback for an unlisted status
    assert not missing, f"error codes missing from docs/reference/errors.md: {missing}"
    # And the other way: every code the page lists is one the server or the router can send.
    unsent = sorted(documented - codes)
    assert not unsent, f"docs/reference/errors.md lists codes nothing sends: {unsent}"


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert pages and not [page for page in pages if f": {page}\n" not in nav]


def test_the_built_site_fetches_nothing_from_elsewhere(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 30
    for page in pages:
        for link in ASSET.findall(page.read_text(encoding="utf-8")):
            assert not link.startswith(("http:", "https:", "//")), f"{page.relative_to(site)} loads {link}"
            if link.startswith("data:"):
                continue
            path = link.split("#")[0].split("?")[0]
            # 404.html is served for any path, so its links start at the site's root.
            target = (site / path.lstrip("/")) if path.startswith("/") else (page.parent / path).resolve()
            assert target.is_file(), f"{page.relative_to(site)}: {link} is not in the site"
    for sheet in site.rglob("*.css"):
        remote = [url for url in CSS_URL.findall(sheet.read_text(encoding="utf-8"))
                  if url.startswith(("http:", "https:", "//"))]
        assert not remote, f"{sheet.relative_to(site)} loads {remote}"


@contextlib.contextmanager
def _serve(directory: Path) -> Iterator[str]:
    """The built site over HTTP on a free loopback port (the search index is fetched, which a
    file:// page may not do)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# Every resource the page fetched, with its HTTP status (0 where the browser could not load it).
RESOURCES = "return performance.getEntriesByType('resource').map(e => [e.name, e.responseStatus])"


@pytest.mark.parametrize("page, heading", [("index.html", "espn"),
                                           ("guides/explanations.html", "Explanations and the search page")])
def test_the_site_in_a_real_browser_has_every_asset(browser, site: Path, page: str, heading: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with _serve(site) as base:
        browser.get(f"{base}/{page}")
        WebDriverWait(browser, 60).until(lambda b: b.execute_script("return document.readyState") == "complete")
        assert browser.find_element(By.TAG_NAME, "h1").text.strip() == heading
        resources = browser.execute_script(RESOURCES)
        assert any(name.endswith(".css") for name, _ in resources) and any(name.endswith(".js")
                                                                          for name, _ in resources)
        for name, status in resources:
            assert name.startswith(base), f"{page} fetched {name} from elsewhere"
            assert status == 200, f"{page}: {name} answered {status}"
        # Stylesheets applied, images decoded: nothing missing that the page shows.
        assert browser.execute_script("return [...document.styleSheets].every(s => s.cssRules.length > 0)")
        images = browser.execute_script("return [...document.images].map(i => [i.src, i.complete && "
                                        "i.naturalWidth > 0])")
        assert all(ok for _, ok in images), images
        if page.startswith("guides/"):
            assert any(src.endswith("search-page.png") for src, _ in images)  # the screenshot of the page
        nav = browser.find_element(By.CSS_SELECTOR, "nav.md-nav--primary").get_attribute("textContent")
        assert all(section in nav for section in ("Getting started", "Guides", "Reference", "Benchmarks"))
