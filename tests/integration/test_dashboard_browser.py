"""The dashboard page in a real headless Chromium (Debian's ``chromium``,
driven by Playwright; ``scripts/ensure-chromium.sh`` installs it): a reply
appears live, hostile text stays text, Allow resumes a paused session, an
edited input is allowed with an accepted rule, and an external call's result
is sent from the page."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from fleetbus.agents.serving.remote import RemoteAgent
from fleetbus.bus import Bus, EmbeddedServer
from fleetbus.protocol import FinalAnswer
from tests.helpers import serving
from tests.integration import resume_specs
from tests.integration.test_dashboard import dashboard, echo_agent

pytestmark = pytest.mark.slow

HOSTILE = '<img src=x onerror=\\"window.pwned=1\\"><b>bold</b>'
"""Tool output (inside the JSON of a command) that a careless page would run."""


def _chromium() -> str | None:
    for candidate in (
        os.environ.get("FLEETBUS_CHROMIUM"),
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
        "/usr/bin/chromium",
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


CHROMIUM = _chromium()


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium binary (run scripts/ensure-chromium.sh, or set FLEETBUS_CHROMIUM)",
)
async def test_the_page_shows_a_live_reply_and_allow_resumes_a_paused_session(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    from playwright.async_api import async_playwright, expect

    url, prefix = nats_server.url, bus.prefix
    async with (
        serving(url, prefix, echo_agent(), replica="b1"),
        serving(url, prefix, echo_agent("careful", ask=["echo"]), replica="b2"),
        dashboard(bus) as board,
        async_playwright() as playwright,
    ):
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(board.url)
            await expect(page.locator("#page-status")).to_have_text("dashboard: connected")
            await expect(page.locator("#bus-status")).to_have_text("bus: connected")

            # A first reply makes the session; select it, then watch the next one live.
            echo = RemoteAgent(bus, "echo", session_id="b-live")
            assert isinstance(await echo.reply("first", timeout=20), FinalAnswer)
            row = page.locator('#sessions tr[data-session="b-live"]')
            await expect(row).to_have_attribute("data-status", "done")
            await row.click()
            events = page.locator("#events")
            await expect(events).to_contain_text("echo first from")
            async with asyncio.TaskGroup() as tg:
                reply = tg.create_task(echo.reply(f'tool echo {{"text": "{HOSTILE}"}}', timeout=20))
                await expect(events.locator('li[data-kind="tool_call"]')).to_have_count(1)
            answer = await reply
            assert isinstance(answer, FinalAnswer)
            shown = '<img src=x onerror="window.pwned=1"><b>bold</b>'
            await expect(events.locator('li[data-kind="final_answer"]').last).to_contain_text(
                f"done echo={shown} from"
            )
            # Shown as text: no element was made of it, no script ran.
            assert await events.locator("img, b").count() == 0
            assert await page.evaluate("window.pwned") is None

            # A paused session, allowed from the page.
            careful = RemoteAgent(bus, "careful", session_id="b-paused")
            paused = await careful.reply('tool echo {"text": "from the page"}', timeout=20)
            assert isinstance(paused, FinalAnswer)
            assert paused.finished_reason == "paused"
            card = page.locator('.pending[data-session="b-paused"]')
            await expect(card).to_contain_text("echo")
            await expect(card).to_contain_text('{"text":"from the page"}')
            await card.locator("button.allow").click()
            await expect(page.locator("#confirm-result")).to_contain_text("b-paused:")
            done = page.locator('#sessions tr[data-session="b-paused"][data-status="done"]')
            await expect(done).to_contain_text("done echo=from the page from")
            await expect(card).to_have_count(0)
            record = [s for s in (await board.fleet())["sessions"] if s["session"] == "b-paused"]
            assert record[0]["pending"] == []

            screenshot = tmp_path / "dashboard.png"
            await page.screenshot(path=str(screenshot), full_page=True)
            print(f"dashboard screenshot: {screenshot}")
            assert screenshot.stat().st_size > 10_000
            assert errors == []
        finally:
            await browser.close()


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium binary (run scripts/ensure-chromium.sh, or set FLEETBUS_CHROMIUM)",
)
async def test_the_page_allows_an_edited_input_with_a_rule_and_sends_an_external_result(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    from playwright.async_api import async_playwright, expect

    url, prefix = nats_server.url, bus.prefix
    async with (
        serving(url, prefix, echo_agent("careful", ask=["echo"]), replica="b1"),
        serving(url, prefix, resume_specs.desk(), replica="b2"),
        dashboard(bus) as board,
        async_playwright() as playwright,
    ):
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(board.url)
            await expect(page.locator("#page-status")).to_have_text("dashboard: connected")

            # A call to confirm: its input edited, the tool's rule accepted.
            careful = RemoteAgent(bus, "careful", session_id="b-edit")
            paused = await careful.reply('tool echo {"text": "model"}', timeout=20)
            assert isinstance(paused, FinalAnswer)
            card = page.locator('.pending[data-session="b-edit"]')
            await expect(card.locator("button.allow")).to_have_count(1)
            await card.locator("button.edit").click()
            editor = card.locator("textarea.edit-input")
            await expect(editor).to_have_value('{"text":"model"}')
            await editor.fill('{"text": "from the person"}')
            await card.locator('input.rule[data-rule="echo"]').check()
            await card.locator("button.allow-edited").click()
            done = page.locator('#sessions tr[data-session="b-edit"][data-status="done"]')
            await expect(done).to_contain_text("from the person from")
            later = RemoteAgent(bus, "careful", session_id="b-later")
            answer = await later.reply('tool echo {"text": "unasked"}', timeout=20)
            assert isinstance(answer, FinalAnswer)
            assert answer.finished_reason == "completed", answer

            # A call run outside the agent: its result typed in the page.
            desk = RemoteAgent(bus, "desk", session_id="b-external")
            paused = await desk.reply('tool lookup {"query": "rows"}', timeout=20)
            assert isinstance(paused, FinalAnswer)
            card = page.locator('.pending[data-session="b-external"]')
            result = card.locator("textarea.result-input")
            await result.fill("not json")
            await card.locator("button.send-result").click()
            await expect(page.locator("#confirm-result")).to_contain_text("is not JSON")
            await result.fill('{"rows": 3}')
            await card.locator("button.send-result").click()
            done = page.locator('#sessions tr[data-session="b-external"][data-status="done"]')
            await expect(done).to_contain_text("done lookup={'rows': 3} from")
            await expect(card).to_have_count(0)
            assert errors == []
        finally:
            await browser.close()
