"""The pictures surgery writes, opened in headless Chromium: `diagnose`'s report.html and the main job's selection.png
load with no console error, and every image is there, decoded and not blank.

Skipped only where no Chromium binary is found; CI installs Debian's (`.ci/run`). Driven by Playwright on that binary,
so no browser is downloaded."""

import html
import json
import shutil

import pytest
from typer.testing import CliRunner

from surgery.cli import app
from tests.test_report import assert_not_blank

runner = CliRunner()
# Offline machines refuse the connections Chromium makes at start-up (updates, sync, QUIC probes) with console errors
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    binary = next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None)
    if binary is None:
        pytest.skip("no chromium binary on PATH (CI installs Debian's: apt-get install chromium)")
    from playwright.sync_api import sync_playwright  # the `test` extra

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=binary, args=FLAGS)  # headless, in a new empty profile
        yield launched
        launched.close()


def open_page(browser, path) -> tuple[list[str], list[dict]]:
    """Load the page at `path`; return its console errors (failed loads included) and, for each <img>, its src,
    whether it loaded, its natural width and a screenshot of it as shown."""
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("requestfailed", lambda r: errors.append(f"{r.url}: {r.failure}"))
    page.goto(path.resolve().as_uri(), wait_until="load")
    images = []
    for img in page.locator("img").all():
        img.scroll_into_view_if_needed()
        state = img.evaluate("i => ({src: i.getAttribute('src'), complete: i.complete, naturalWidth: i.naturalWidth})")
        images.append({**state, "shown": img.screenshot() if state["naturalWidth"] > 0 else None})
    page.close()
    return errors, images


def assert_opens_whole(browser, path, expected: int) -> None:
    errors, images = open_page(browser, path)
    assert errors == []
    assert [i["src"] for i in images if not (i["complete"] and i["naturalWidth"] > 0)] == []
    assert len(images) == expected
    for image in images:
        assert_not_blank(image["shown"])


def test_the_checks_catch_a_broken_page(browser, tmp_path):
    """A missing image and a script error are what the other tests would catch."""
    page = tmp_path / "broken.html"
    page.write_text("<!doctype html><html><body><img src='missing.png'><script>undefined_name()</script></body></html>")
    errors, images = open_page(browser, page)
    assert any("undefined_name" in e for e in errors) and any("missing.png" in e or "ERR_FILE_NOT_FOUND" in e for e in errors)
    assert images[0]["naturalWidth"] == 0


def test_diagnose_report_opens_in_a_browser(browser, tmp_path, fixture_path):
    out = tmp_path / "report"
    result = runner.invoke(app, ["diagnose", str(fixture_path("llama")), "-o", str(out), "--seq-len", "32", "--windows", "2",
                                 "--eval-windows", "2"])
    assert result.exit_code == 0, result.output
    assert_opens_whole(browser, out / "report.html", expected=6)


def test_main_job_writes_its_selection_picture_and_it_opens_in_a_browser(browser, tmp_path, fixture_path):
    out = tmp_path / "auto"
    result = runner.invoke(app, ["parallelize", str(fixture_path("llama")), "-o", str(out), "--layers", "auto", "--seq-len", "32",
                                 "--windows", "2", "--fit-windows", "8", "--eval-windows", "2", "--no-latency"])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "selection.json").read_text())
    assert saved["budget"] == {"max_kl": 0.05, "max_loss_increase": 0.02}  # the picture's limits
    assert_not_blank((out / "selection.png").read_bytes())
    page = tmp_path / "selection.html"
    src = html.escape((out / "selection.png").as_uri())
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>selection</title></head><body><img src='{src}'></body></html>")
    assert_opens_whole(browser, page, expected=1)
