"""The docs site builds with ``mkdocs build --strict`` (a broken link or anchor fails it), every alert's
runbook URL anchor is on the built runbooks page, and the site opened in headless Chromium renders, loads
its search, and sends no request off the machine."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from openlora_otel.stack import DEFAULT_RUNBOOK_BASE, rules_text
from tests.support.chromium import chromium, headless, page_requests

ROOT = Path(__file__).resolve().parents[2]


def needs_mkdocs() -> None:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
        import mkdocstrings_handlers.python  # noqa: F401
    except ImportError as exc:
        message = f"the docs extra is not installed ({exc.name}): pip install -e '.[docs]'"
        if os.environ.get("CI"):
            pytest.fail(message + "; the README's test command installs it")
        pytest.skip(message)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    needs_mkdocs()
    out = tmp_path_factory.mktemp("docs") / "site"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"mkdocs build --strict took {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stdout + result.stderr
    yield out


@pytest.mark.process
def test_site_builds_strict_with_every_page_and_runbook_anchor(site: Path) -> None:
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("index.html"))
    # One built page per page of the nav (tests/project/test_docs.py: the nav lists every page under docs/).
    nav = re.findall(r"^\s+- (?:[^:\n]+|\"[^\"]+\"): ([\w/-]+)\.md$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert "runbooks" in nav and len(nav) > 20
    assert pages == sorted("index.html" if page == "index" else f"{page}/index.html" for page in nav)
    # Every rule's runbook_url: the base, then an anchor the built page has.
    runbooks = (site / "runbooks" / "index.html").read_text()
    alerts = [r for g in yaml.safe_load(rules_text())["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) > 30
    for rule in alerts:
        base, anchor = rule["annotations"]["runbook_url"].split("#")
        assert base == DEFAULT_RUNBOOK_BASE and base.endswith("/runbooks/")
        assert re.search(rf'<h3 id="{anchor}">{rule["alert"]}', runbooks), rule["alert"]
    # The API page is rendered from the docstrings, callbacks included.
    api = (site / "reference" / "api" / "index.html").read_text()
    # The docstrings' Sphinx roles show as the name alone (docs/hooks.py), not as ":class:".
    assert ":class:<code>" not in api and ":meth:<code>" not in api
    for name in ("setup_telemetry", "record_step", "DivergenceGuard", "InferenceMetrics", "TelemetryCallback"):
        assert name in api, name
    # Search: every page is in the index, and a query's words are in the runbook it should find.
    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = {doc["location"] for doc in index["docs"]}
    assert "runbooks/#openloratrainingstalled" in locations
    stalled = next(d for d in index["docs"] if d["location"] == "runbooks/#openloratrainingstalled")
    assert "openlora_training_steps_total" in stalled["text"]
    # Nothing the pages load comes from the network: scripts, styles, images, fonts, frames.
    for page in site.rglob("*.html"):
        text = page.read_text()
        loaded = re.findall(r'<(?:script|img|iframe|source)\b[^>]*\bsrc="([^"]+)"', text)
        loaded += re.findall(r'<link\b(?![^>]*rel="canonical")[^>]*\bhref="([^"]+)"', text)
        remote = [url for url in loaded if re.match(r"(https?:)?//", url)]
        assert not remote, (page, remote)
    for css in site.rglob("*.css"):
        assert not re.search(r"(@import|url\()\s*['\"]?(https?:)?//", css.read_text()), css


class _Handler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        self.server.paths.append(self.path)  # type: ignore[attr-defined]


@pytest.mark.e2e
@pytest.mark.process
def test_site_in_headless_chromium_renders_loads_search_and_stays_on_the_machine(
    site: Path, tmp_path: Path
) -> None:
    chromium()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(site)))
    server.paths = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{server.server_address[1]}"
    netlog = tmp_path / "netlog.json"
    try:
        result = headless(
            tmp_path,
            # Any name but 127.0.0.1 fails to resolve: a request off the machine cannot succeed, and
            # the net log below shows that it was tried.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            f"--log-net-log={netlog}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            f"{origin}/runbooks/",
        )
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    # Rendered by the theme's script: the page, its navigation, the search box, the anchors.
    assert '<h1 id="alert-runbooks">Alert runbooks' in dom
    assert 'data-md-component="search-query"' in dom and "md-nav__link" in dom
    assert '<h3 id="openloratrainingstalled">' in dom
    # The search worker started and loaded the index (a query's results: the test above).
    assert any(p.startswith("/assets/javascripts/workers/search.") for p in server.paths), server.paths
    assert "/search/search_index.json" in server.paths, server.paths
    # Every request the page made (its initiator is the site) went to the site. Chromium's own
    # requests (component updates, no initiator origin) are the browser's, not the site's.
    from_page = set(page_requests(netlog))
    assert any(url.endswith("/search/search_index.json") for url in from_page), from_page
    off = sorted(url for url in from_page if not url.startswith(origin + "/"))
    assert not off, f"the site sent requests off the machine: {off}"
