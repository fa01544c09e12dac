"""Refresh the screenshots in docs/operations.md.

    .venv/bin/python docs/screenshots.py

1. the dashboard (pools, the workflow list, one workflow's Gantt timeline): the browser test
   `tests/api/test_dashboard_browser.py`, run with OMNIFLOW_SCREENSHOTS=docs;
2. `omniflow stats --watch`, captured from tmux: `omniflow up` in a scratch folder, some traffic
   (a few workflows fail once and are retried), the command running in a detached tmux pane,
   `tmux capture-pane -e` (text with colours) rendered by rich to HTML and photographed by the
   same headless chromium.
Needs tmux, chromium and chromium-driver (`make browser`).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PY = sys.executable
COLUMNS, ROWS = 150, 30


def dashboard() -> None:
    env = {**os.environ, "OMNIFLOW_SCREENSHOTS": str(DOCS)}
    subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/api/test_dashboard_browser.py"],
                   cwd=REPO, env=env, check=True)


def traffic(env: dict[str, str], stop: threading.Event) -> None:
    from omniflow.client import Client

    with Client() as client:
        i = 0
        while not stop.is_set():
            params = {"thinker": {"fail_at_step": 2, "fail_attempts": 1}} if i % 7 == 0 else {}
            client.submit(f"traffic {i}: why do durable queues matter", stage_params=params)
            i += 1
            time.sleep(0.05)


def stats_watch() -> None:
    from omniflow.ops.embedded import free_port

    home = Path(tempfile.mkdtemp(prefix="omniflow-shots-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    env.update(OMNIFLOW_HOME=str(home), COLUMNS=str(COLUMNS))
    up = subprocess.Popen([PY, "-m", "omniflow.cli", "up", "--no-api", "--port", str(free_port())], cwd=home,
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    stop = threading.Event()
    session = f"omniflow-stats-{os.getpid()}"
    try:
        deadline = time.monotonic() + 60
        while not (home / "redis.url").exists():
            if time.monotonic() > deadline or up.poll() is not None:
                raise SystemExit("omniflow up did not start")
            time.sleep(0.2)
        time.sleep(3)                                     # workers register
        os.environ.update(OMNIFLOW_HOME=str(home))
        feeder = threading.Thread(target=traffic, args=(env, stop), daemon=True)
        feeder.start()
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", str(COLUMNS), "-y", str(ROWS),
                        f"cd {home} && OMNIFLOW_HOME={home} {PY} -m omniflow.cli stats --watch"], check=True, env=env)
        time.sleep(12)                                    # a few refreshes with traffic in the last minute
        captured = subprocess.run(["tmux", "capture-pane", "-p", "-e", "-t", session], check=True,
                                  capture_output=True, text=True).stdout
        render(captured, DOCS / "stats-watch.png")
    finally:
        stop.set()
        subprocess.run(["tmux", "kill-session", "-t", session], check=False, stderr=subprocess.DEVNULL)
        os.killpg(up.pid, 15)
        up.wait(30)
        shutil.rmtree(home, ignore_errors=True)


def render(ansi: str, out: Path) -> None:
    """Terminal text with colours -> PNG (rich draws an SVG, headless chromium takes the picture)."""
    from rich.console import Console
    from rich.text import Text

    console = Console(record=True, width=COLUMNS, file=open(os.devnull, "w"), force_terminal=True)
    console.print(Text.from_ansi(ansi.rstrip("\n")))
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "stats.svg"        # rich draws it as a terminal window
        page.write_text(console.export_svg(title="tmux: omniflow stats --watch"))
        subprocess.run(["/usr/bin/chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={tmp}/profile", f"--screenshot={out}", "--window-size=1500,470",
                        "--hide-scrollbars", page.as_uri()], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    dashboard()
    stats_watch()
    print("wrote", *sorted(p.name for p in DOCS.glob("*.png") if p.name.startswith(("dashboard", "stats"))))
