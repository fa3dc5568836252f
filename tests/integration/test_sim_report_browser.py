"""``fleetbus sim report`` of a real run (``fleetbus sim run`` with its host
and tool worker processes: answers, an agent whose answer cannot be read, a
late one), and its page in a real headless Chromium (Debian's ``chromium``,
driven by Playwright; ``scripts/ensure-chromium.sh`` installs it), opened
from a ``file://`` URL: the charts are drawn and visible, the console stays
clean, and the page asks for nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from fleetbus.bus import EmbeddedServer
from fleetbus.cli.main import main
from fleetbus.sim import RunFiles, Simulation
from tests.helpers import ROOT, charts_drawn, open_page
from tests.integration.test_dashboard_browser import CHROMIUM
from tests.integration.test_sim_runner import simulation

pytestmark = pytest.mark.slow

NAMES = tuple(f"a{i}" for i in range(12))
ROUNDS = 3


def mixed() -> Simulation:
    """Twelve agents, three rounds of two seconds: ``a3``'s answers cannot be
    read, ``a11`` answers too late."""
    sim = simulation(NAMES, delays={"a11": 30.0}, rounds=ROUNDS, deadline=2.0)
    read = sim.parse
    assert read is not None

    def parse(text: str) -> Any:
        if " for a3 at " in text:
            raise ValueError("a3 answers in riddles")
        return read(text)

    sim.parse = parse
    return sim


@pytest.fixture(scope="module")
def run_dir(nats_server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of a finished ``fleetbus sim run`` of :func:`mixed`."""
    out = tmp_path_factory.mktemp("report") / "run"
    command = [
        sys.executable, "-m", "fleetbus", "sim", "run",
        "tests.integration.test_sim_report_browser:mixed",
        "--nats", nats_server.url, "--prefix", f"t{uuid.uuid4().hex[:12]}", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.mark.timeout(150)
def test_the_report_of_a_real_run(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "report", str(run_dir)]) == 0
    path = run_dir / "report.html"
    assert capsys.readouterr().out.strip() == str(path)
    page = path.read_text()
    state = RunFiles(run_dir).load_state()
    assert state is not None
    assert state.completed == ROUNDS
    assert f"{ROUNDS} of {ROUNDS}: finished" in page
    assert f"{ROUNDS * len(NAMES)} read from results.jsonl" in page
    assert "30 ok, 3 error, 3 late, 0 missing" in page
    for round_no in range(1, ROUNDS + 1):
        # The values are the visits counted by env_add on the tool worker: 1-11
        # in round 1 (a3 counted, not read; a11 never got there), and so on.
        assert re.search(rf"<title>round {round_no}: 10 answers; min \d+", page), round_no
        assert re.search(rf"<title>round {round_no}: 11 answered; p10 \d+ ms", page), round_no
    assert "the answer could not be read: ValueError" in page
    assert "no answer within 2 s" in page
    assert "<figcaption>applied</figcaption>" in page  # what apply returned, charted


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium binary (run scripts/ensure-chromium.sh, or set FLEETBUS_CHROMIUM)",
)
@pytest.mark.timeout(150)
async def test_the_page_draws_its_charts_in_chromium_and_loads_nothing(
    run_dir: Path, tmp_path: Path
) -> None:
    from playwright.async_api import async_playwright, expect

    assert main(["sim", "report", str(run_dir), "--out", str(tmp_path / "page.html")]) == 0
    url = (tmp_path / "page.html").as_uri()
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            opened = await open_page(browser, url)
            page, errors, requests = opened.page, opened.errors, opened.requests
            ids = await charts_drawn(page, min_height=100)
            assert ids >= {
                "chart-status", "chart-duration", "chart-rate", "chart-latency",
                "chart-answers", "chart-histogram", "chart-metric-0", "chart-metric-1",
            }  # fmt: skip
            # What is drawn inside has a size too: bars, the latency's median
            # line, the heat map's cells.
            for shape in (
                "#chart-status .bars rect",
                "#chart-latency path.p50",
                "#chart-answers .cells rect",
            ):
                box = await page.locator(shape).first.bounding_box()
                assert box is not None, shape
                assert box["width"] > 0 or box["height"] > 0, (shape, box)
            # One band with the round's figures as its tooltip per round.
            await expect(page.locator("#chart-latency .hover rect")).to_have_count(ROUNDS)
            await expect(page.locator("#chart-latency .hover rect title").first).to_have_text(
                re.compile(r"round 1: 11 answered; p10 \d+ ms")
            )
            await expect(page.locator("table.errors")).to_contain_text("no answer within 2 s")

            screenshot = tmp_path / "report.png"
            await page.screenshot(path=str(screenshot), full_page=True)
            print(f"report screenshot: {screenshot}")
            assert screenshot.stat().st_size > 10_000
            assert errors == []
            assert requests == [url]  # the page itself; nothing else
        finally:
            await browser.close()
