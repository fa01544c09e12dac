"""The dashboard in a real browser: Debian's chromium driven by selenium (headless), against the API
over real HTTP, a real engine and one worker process we kill.

`make test` installs chromium and chromium-driver when /usr/bin/chromium is missing; nothing is
downloaded when the test runs. Set OMNIFLOW_SCREENSHOTS=docs to refresh the screenshots in
docs/operations.md (the test writes them to its tmp folder otherwise).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

import helpers
from apiserver import ADMIN_KEY, api_factory, auth_settings  # noqa: F401 - fixture
from conftest import toy_spec

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1100", "--autoplay-policy=no-user-gesture-required", "--mute-audio")
WAIT_S = 20
# fast enough for a short test, slow enough to see a workflow running (8 words x 60 ms)
SPEC = toy_spec(thinker={"token_delay_s": 0.06})


def chrome(user_data: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("chromium/chromedriver missing: `make test` installs them (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={user_data}"):
        opts.add_argument(flag)
    return webdriver.Chrome(options=opts, service=Service(str(CHROMEDRIVER)))


def kill_worker_process(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "omniflow.cli", "worker", "--stage", "talker"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def drive(base: str, extra_worker: subprocess.Popen[bytes], shots: Path) -> None:
    """Everything the browser does (blocking selenium calls: run in a thread, the engine keeps running)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    # the page re-renders rows and cards as data arrives: an element found a moment ago may be replaced
    transient = (NoSuchElementException, StaleElementReferenceException)

    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    with tempfile.TemporaryDirectory(prefix="omniflow-chromium-") as profile:
        driver = chrome(profile)
        try:
            wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.1, ignored_exceptions=transient)
            css = lambda sel: driver.find_element(By.CSS_SELECTOR, sel)      # noqa: E731
            text = lambda sel: css(sel).text                                   # noqa: E731

            def click(sel: str) -> None:
                wait.until(lambda d: css(sel).click() or True)

            driver.get(f"{base}/ui")
            wait.until(lambda d: css("#auth").is_displayed())           # keys are configured: it asks for one
            css("#key").send_keys(ADMIN_KEY)
            click("#auth button")
            wait.until(lambda d: text('.pool[data-stage="talker"] .live-workers') == "2")
            driver.execute_script("window.__same_page = true")          # gone if the page ever reloads

            # a workflow submitted through the API appears and completes, live
            # (its thinker fails once at step 3 and is retried: the timeline shows both attempts)
            done_id = api.post("/v1/workflows", json={
                "input": {"text": "show me on the dashboard"}, "request_id": "ui-demo-1",
                "stage_params": {"thinker": {"fail_at_step": 3, "fail_attempts": 1}}}).json()["id"]
            wait.until(lambda d: text(f'#wf-rows tr[data-id="{done_id}"] .state') == "completed")
            for i in range(3):
                api.post("/v1/workflows", json={"input": {"text": f"more traffic {i}"}, "request_id": f"ui-demo-{i + 2}"})
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#wf-rows .state.completed")) >= 4)
            driver.save_screenshot(str(shots / "dashboard-pools.png"))

            # its timeline: a Gantt chart with a lane per stage, attempts and ticks; then its audio plays
            click(f'#wf-rows tr[data-id="{done_id}"]')
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#gantt g.lane")) == 3)
            wait.until(lambda d: css('#gantt g.lane[data-stage="thinker"] rect.attempt.done'))
            wait.until(lambda d: css('#gantt g.lane[data-stage="thinker"] rect.attempt.failed[data-attempt="1"]'))
            wait.until(lambda d: css('#gantt g.lane[data-stage="thinker"] path.retry'))
            wait.until(lambda d: css('#gantt g.lane[data-stage="code2wav"] line.tick-audio'))
            replica = wait.until(lambda d: css('#gantt g.lane[data-stage="thinker"] rect.attempt')
                                 .get_attribute("data-replica"))
            assert replica.startswith("thinker")
            wait.until(lambda d: d.execute_script("const p = document.getElementById('player');"
                                                   "return !!p && p.readyState >= 2 && p.duration > 0"))
            click("#play")
            wait.until(lambda d: d.execute_script("return document.getElementById('player').currentTime > 0"))
            css("#detail").screenshot(str(shots / "dashboard-timeline.png"))

            # abort a running workflow with the button
            slow = api.post("/v1/workflows", json={"input": {"text": "abort me from the browser"},
                                                   "stage_params": {"thinker": {"token_delay_s": 0.5}}}).json()["id"]
            driver.execute_script(f"location.hash = '#/wf/{slow}'")
            wait.until(lambda d: text("#d-id") == slow and css("#abort").is_enabled())
            click("#abort")
            wait.until(lambda d: text("#d-state") == "aborted")
            assert api.get(f"/v1/workflows/{slow}").json()["state"] == "aborted"
            wait.until(lambda d: css("#retry").is_enabled() and not css("#abort").is_enabled())

            # kill a worker: its pool loses it once the lease lapses, without a reload
            click("#back")
            wait.until(lambda d: text(f'#wf-rows tr[data-id="{slow}"] .state') == "aborted")
            css("#list-section").screenshot(str(shots / "dashboard-list.png"))
            os.killpg(extra_worker.pid, signal.SIGKILL)
            wait.until(lambda d: text('.pool[data-stage="talker"] .live-workers') == "1")
            assert driver.execute_script("return window.__same_page === true")
            # no script error (network lines are the 401s before the key was typed)
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and e.get("source") != "network"]
            assert not errors, errors
        finally:
            driver.quit()
            api.close()


@pytest.mark.slow
async def test_dashboard_in_a_real_browser(api_factory, tmp_path):
    shots = Path(os.environ.get("OMNIFLOW_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    async with api_factory(SPEC, **auth_settings()) as (engine, server):
        extra = kill_worker_process(helpers.cli_env(engine, tmp_path))
        try:
            await helpers.eventually(lambda: _talkers(engine, 2), timeout_s=20)
            await asyncio.to_thread(drive, server.url, extra, shots)
        finally:
            if extra.poll() is None:
                os.killpg(extra.pid, signal.SIGKILL)
            extra.wait(10)
    for name in ("dashboard-pools.png", "dashboard-list.png", "dashboard-timeline.png"):
        assert (shots / name).stat().st_size > 10_000, name


async def _talkers(engine, n: int) -> bool:
    from omniflow.ops.fleet import list_workers

    return sum(1 for w in await list_workers(engine.store) if w["alive"] and "talker" in w["stages"]) == n
