"""``fleetbus eval`` as a user runs it, every part its own process: the
built-in tool worker, the demo fleet's agent on the offline model, and the
command, on the shipped datasets; a second run compared with the first
(``--compare``); then the pages in a real headless Chromium (Debian's
``chromium``, driven by Playwright; ``scripts/ensure-chromium.sh`` installs
it), opened from ``file://`` URLs: the charts and the table are drawn, the
console stays clean, and the pages ask for nothing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.evals import load_dataset, read_run
from tests.helpers import ROOT, charts_drawn, open_page, wait_for_workers
from tests.integration.test_dashboard_browser import CHROMIUM
from tests.integration.test_readme_path import process, run_cli

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples" / "evals"


@pytest.fixture(autouse=True)
def _the_offline_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo fleet's agent takes its model from the environment: none here."""
    for name in ("FLEETBUS_MODEL", "OPENAI_API_KEY", "OPENAI_BASE_URL", "FLEETBUS_NATS_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(240)
async def test_the_shipped_datasets_on_a_fleet_of_processes_and_their_pages(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    on_bus = ("--nats", nats_server.url, "--prefix", bus.prefix)
    arithmetic = EXAMPLES / "arithmetic.jsonl"
    first, second, steps = tmp_path / "first", tmp_path / "second", tmp_path / "steps"
    with process("worker", "fleetbus.tools_workers.builtin", *on_bus, "--worker-id", "w1"):
        await wait_for_workers(bus, "calculator", 1)
        with process("agent", "fleetbus.cli.demo_fleet:agents", *on_bus) as agent:
            await agent.wait_for("serving assistant")
            runs = [
                ("eval", str(arithmetic), "--agent", "assistant", "--out", str(first)),
                ("eval", str(EXAMPLES / "multistep.jsonl"), "--agent", "assistant",
                 "--out", str(steps), "--concurrency", "2"),
                ("eval", str(arithmetic), "--agent", "assistant", "--out", str(second),
                 "--compare", str(first), "--label", "again"),
            ]  # fmt: skip
            outputs = []
            for argv in runs:
                code, out = await run_cli(*argv, *on_bus, timeout=90)
                assert code == 0, out
                outputs.append(out)
    cases = len(load_dataset(arithmetic).cases)
    assert f"{cases} of {cases} cases passed (100.0%)" in outputs[0], outputs[0]
    assert outputs[0].rstrip().endswith(str(first / "report.html")), outputs[0]
    steps_cases = len(load_dataset(EXAMPLES / "multistep.jsonl").cases)
    assert f"{steps_cases} of {steps_cases} cases passed" in outputs[1], outputs[1]
    assert "time-and-arithmetic" in outputs[1]  # the table of the cases
    summary = orjson.loads((first / "summary.json").read_bytes())
    assert summary["agent"] == "assistant"
    assert summary["passed"] == cases
    assert summary["models"] == {"fleetbus-offline": cases}
    records = [orjson.loads(line) for line in (first / "results.jsonl").read_bytes().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(c.id for c in load_dataset(arithmetic).cases)
    assert all(r["passed"] and r["tool_calls"][0]["name"] == "calculator" for r in records)
    compared = (second / "report.html").read_text()
    assert "<h1>first vs again</h1>" in compared
    assert f"0 fixed, 0 regressed, {cases} still passing" in compared
    assert read_run(second).facts.label == "again"

    if CHROMIUM is None:
        pytest.skip("no chromium binary (run scripts/ensure-chromium.sh, or set FLEETBUS_CHROMIUM)")
    await _check_in_chromium(
        first / "report.html", steps / "report.html", second / "report.html", shots=tmp_path
    )


async def _check_in_chromium(*pages: Path, shots: Path) -> None:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            for path in pages:
                await _check_page(browser, path, shots)
        finally:
            await browser.close()


async def _check_page(browser: Any, path: Path, shots: Path) -> None:
    """The page at ``path``: its four charts drawn with a size, bars inside,
    one row a case, hover titles, no error, nothing loaded."""
    from playwright.async_api import expect

    url = path.as_uri()
    opened = await open_page(browser, url)
    page, errors, requests = opened.page, opened.errors, opened.requests
    ids = await charts_drawn(page, min_height=80)
    assert ids == {"chart-graders", "chart-latency", "chart-tokens", "chart-tools"}
    # Bars are drawn with a size: the pass rates, and one a case (two, comparing).
    for shape in ("#chart-graders .bars rect", "#chart-latency .bars rect"):
        box = await page.locator(shape).first.bounding_box()
        assert box is not None, shape
        assert box["width"] > 0, (shape, box)
        assert box["height"] > 0, (shape, box)
    await expect(page.locator("table.cases tbody tr")).to_have_count(
        len(read_run(path.parent).results)
    )
    await expect(page.locator("td.outcome-fail")).to_have_count(0)
    await expect(page.locator("#chart-latency .hover rect title").first).to_have_text(
        re.compile(r"^case 1\n")
    )
    shot = shots / f"{path.parent.name}-{path.stem}.png"
    await page.screenshot(path=str(shot), full_page=True)
    print(f"report screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    assert errors == [], (path, errors)
    assert requests == [url], requests  # the page itself; nothing else
    await page.close()
