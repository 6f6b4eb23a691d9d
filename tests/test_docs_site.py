"""The documentation site builds in strict mode, and its pages render in a browser as a reader sees them.

``make docs`` runs ``mkdocs build --strict``: a broken link or anchor, a page missing from the navigation, a
missing include or an API reference that does not resolve fails the build. These tests build the site from
this checkout, show that a broken link and an unresolvable reference do fail it, and open the home and the
algorithm page in headless Chromium to check that the navigation, the code blocks and the figures are there.
They skip, saying why, without the docs extra (``pip install -e '.[docs]'``, which ``make setup`` does) or
without a ``chromium`` on the PATH (``.ci/run`` installs Debian's package when it runs as root).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from test_docs_blocks import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="the docs extra is not installed (pip install -e '.[docs]'; make setup installs it)",
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def build(config_dir: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=config_dir, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def site() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="adaloss-site-"))
    done = build(ROOT, folder)
    assert done.returncode == 0, done.stderr[-4000:]
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_the_site_builds_strict(site: Path) -> None:
    for page in (
        "index.html",
        "algorithm/index.html",
        "performance/index.html",
        "reference/adaptive/index.html",
    ):
        assert (site / page).is_file(), page
    # mkdocstrings rendered the docstrings: the API page holds Algorithm 4's function, with its signature
    api = (site / "reference" / "adaptive" / "index.html").read_text(encoding="utf-8")
    assert 'id="adaloss.adaptive.rules.gemm_loss_scale"' in api


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy2(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    for name in ("src", "configs"):
        (root / name).symlink_to(ROOT / name, target_is_directory=True)
    return root


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    page = root / "docs" / "changelog.md"
    text = page.read_text(encoding="utf-8")
    page.write_text(text + "\nSee [the old page](no-such-page.md).\n", encoding="utf-8")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and "no-such-page.md" in done.stderr, done.stderr[-2000:]
    page.write_text(text + "\nSee [the rules](algorithm.md#no-such-anchor).\n", encoding="utf-8")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and "no-such-anchor" in done.stderr, done.stderr[-2000:]


def test_an_unresolved_api_reference_fails_the_build(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    page = root / "docs" / "reference" / "adaptive.md"
    page.write_text(page.read_text(encoding="utf-8") + "\n::: adaloss.adaptive.rules.no_such_rule\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0 and "no_such_rule" in done.stderr, done.stderr[-2000:]


# ------------------------------------------------------------------------------------------ in a browser


class _Page(HTMLParser):
    """What a reader would look for in the DOM Chromium produced: navigation links, code blocks, images."""

    def __init__(self) -> None:
        super().__init__()
        self.nav_links: list[str] = []
        self.code_blocks = 0
        self.images: list[str] = []
        self._nav_depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "nav" and "md-nav--primary" in (a.get("class") or ""):
            self._nav_depth = 1
        elif tag == "nav" and self._nav_depth:
            self._nav_depth += 1
        if tag == "a" and self._nav_depth and a.get("href"):
            self.nav_links.append(a["href"])
        if tag == "pre":
            self.code_blocks += 1
        if tag == "img" and a.get("src"):
            self.images.append(a["src"])

    def handle_endtag(self, tag: str) -> None:
        if tag == "nav" and self._nav_depth:
            self._nav_depth -= 1


def chromium(url: str, *args: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="adaloss-chromium-")
    try:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--window-size=1280,2000", *args, url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def look_at(site: Path, page: str, screenshot: Path) -> _Page:
    """Open ``page`` of the built site in headless Chromium: its DOM after scripts ran, and a screenshot."""
    url = (site / page).as_uri()
    dom = chromium(url, "--dump-dom")
    assert dom.returncode == 0 and "<html" in dom.stdout, dom.stderr[-2000:]
    shot = chromium(url, f"--screenshot={screenshot}")
    assert shot.returncode == 0 and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot.stderr[-2000:]
    parsed = _Page()
    parsed.feed(dom.stdout)
    return parsed


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on the PATH (apt-get install -y chromium; .ci/run does)"
)
@pytest.mark.parametrize("page", ["index.html", "algorithm/index.html"])
def test_pages_render_in_chromium(site: Path, page: str, tmp_path: Path) -> None:
    seen = look_at(site, page, tmp_path / "page.png")
    # the navigation lists every page of mkdocs.yml's nav, the API reference included
    nav = {re.sub(r"(^|/)\.\./", "", h).split("#")[0] for h in seen.nav_links}
    for target in (
        "algorithm/",
        "reproducing/",
        "performance/",
        "testing/",
        "changelog/",
        "reference/adaptive/",
    ):
        if page.startswith(target):  # the page itself, linked as ./
            continue
        assert any(h.endswith(target) for h in nav), (target, sorted(nav))
    assert seen.code_blocks >= 1
    # each figure's file is in the built site, and it is a PNG
    figures = [src for src in seen.images if src.endswith(".png")]
    assert figures, seen.images
    for src in figures:
        path = (site / page).parent / src
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", src
