"""A sweep as a person sees it in the MLflow UI: a real ``mlflow server`` on loopback and Debian's
chromium driven by Playwright (``.ci/run`` installs the browser; the module skips, with the reason,
where the browser or Playwright is absent).

What it checks, from the rendered page (not the API): the experiment's run list shows the parent
and, expanded, its children under names that differ within their first 20 characters (the swept
values come first: MLflow's name column cuts names at about that width), and the parent's page
shows the jobs table in its description (a rendered HTML table with a row per job).

``TRAINLAB_UI_SCREENSHOTS=<folder>`` keeps the two screenshots (docs/img/ holds the ones quoted).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.conftest import Runner

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sync_playwright is None, reason="Playwright is not installed (pip install playwright)"),
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium; .ci/run does)"),
]

# Flags for a headless browser on a machine with no network beyond loopback.
BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FAST = [
    "parallelism=single",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=4",
    "trainer.warmup_steps_excluded=0",
    "trainer.val_sequences=8",
    "tracking.system_metrics_interval_s=0",
    "checkpoint=none",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ui(tmp_path_factory, data_cache):
    """A 2 x 2 sweep (``trainer.max_steps=2,3`` x ``optim.lr=...``: names that share their first 20
    characters when keys come first), then ``mlflow server`` over its store; yields (runner, base URL)."""
    runner = Runner(tmp_path_factory.mktemp("ui"), data_cache)
    runner.run("-m", "trainer.max_steps=2,3", "optim.lr=0.001,0.002", "experiment_name=ui", *FAST)
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{runner.workdir}/mlruns.db",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        cwd=runner.workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(base + "/health"), timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.time() > deadline:
            server.kill()
            pytest.fail(f"mlflow server did not answer on {base} (exit {server.poll()})")
        time.sleep(0.5)
    try:
        yield runner, base
    finally:
        os.killpg(server.pid, 9)
        server.wait()


def _shot(page, name: str, tmp: Path) -> None:
    keep = os.environ.get("TRAINLAB_UI_SCREENSHOTS")
    path = (Path(keep) if keep else tmp) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))


def test_the_run_list_shows_distinct_names_and_the_parent_shows_the_jobs_table(ui, tmp_path):
    runner, base = ui
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    exp = client.get_experiment_by_name("ui")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("trainlab.sweep") == "parent"]
    children = [r for r in runs if r is not parent]
    assert len(children) == 4
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{base}/#/experiments/{exp.experiment_id}/runs")
        page.get_by_text(parent.info.run_name, exact=True).wait_for(timeout=60_000)
        name_cell = (
            page.locator(".ag-row").filter(has_text=parent.info.run_name).locator('[col-id="attributes.`Run Name`"]')
        )
        name_cell.locator("button").first.click()  # the parent's expander lists its children
        names = [c.info.run_name for c in children]
        for name in names:
            page.get_by_text(name, exact=True).wait_for(timeout=30_000)  # each child is listed under its name
        _shot(page, "mlflow_ui_runs.png", tmp_path)

        page.goto(f"{base}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}")
        table = page.locator("table").filter(has_text=names[0]).first  # the description, rendered
        table.wait_for(timeout=60_000)
        table.scroll_into_view_if_needed()
        n_rows = table.locator("tr").count()
        text = table.inner_text()
        _shot(page, "mlflow_ui_parent.png", tmp_path)
        browser.close()
    assert len({n[:20] for n in names}) == len(names), names  # distinct where the name column cuts them
    assert n_rows == 1 + len(children), text  # a header and a row per job
    for name in names:
        assert name in text, (name, text)
    assert "tokens/s" in text, text
