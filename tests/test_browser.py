"""End to end: the quickstart notebook in a real JupyterLab, in headless Chromium, as a person sees it.

Starts JupyterLab on a free loopback port with a random token, in a temporary copy of
``notebooks/``, opens ``01_quickstart.ipynb`` in Debian's Chromium (``/usr/bin/chromium``, driven
by Playwright through ``executable_path``; no browser is ever downloaded), runs every cell from the
Run menu and checks what is drawn: the ``%%amp`` widget with a speedup figure, a widget that talks
back to the kernel, the ``%%profile_gpu`` table (lists ``aten::`` operators, re-sorts from the
ascending box and from a click on a column header, whose buttons line up with the columns), the
``%memory_budget`` gauge, and a browser console free of widget errors. A second notebook shows the
same profile widget over a real H100 trace (``%profile_trace``), as ``%%profile_gpu`` draws it on a GPU; a
third a ``%memory_budget --model`` estimate, whose sharding table and method stay folded until clicked.

Screenshots go to ``$NBACCEL_SCREENSHOT_DIR`` when it is set (``docs/img`` to refresh the README's
picture), else to pytest's temporary directory, so an ordinary test run leaves the checkout clean.

Skips, saying why, only when Chromium, Playwright or JupyterLab cannot be found.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
QUICKSTART = "01_quickstart.ipynb"
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]

SERVER_START_S = 90     # first start of JupyterLab on 2 busy cores can take a while
PAGE_READY_MS = 90_000  # the notebook open and its kernel idle
RUN_ALL_MS = 150_000    # every cell of the quickstart executed
# The notebook in the tab in front: Lab's workspace reopens the notebooks an earlier test opened, behind it.
ACTIVE_NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook"
WIDGET_ERROR = re.compile(r"widget|comm|model", re.IGNORECASE)


def _chromium() -> str | None:
    for path in CHROMIUM_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    return sync_playwright


def _has_jupyterlab() -> bool:
    try:
        import jupyterlab  # noqa: F401
        import jupyterlab_widgets  # noqa: F401
    except ImportError:
        return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 serving a scratch copy of notebooks/; killed on teardown."""
    if not _has_jupyterlab():
        pytest.skip("JupyterLab / jupyterlab_widgets are not installed: pip install -e '.[test]'")
    root = tmp_path_factory.mktemp("lab")
    work = root / "notebooks"
    shutil.copytree(NOTEBOOKS, work, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    port, token = _free_port(), secrets.token_hex(16)
    # User settings of this throwaway Lab: every cell in the page (no virtual scrolling, so the test can
    # count and read them all) and no news pop-up over the notebook.
    settings = root / "settings"
    (settings / "@jupyterlab" / "notebook-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"}))
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    # Private config/data/runtime dirs: a user's own settings or a "python3" kernelspec pointing at another
    # Python must not change what this test sees (the kernel is this interpreter's ipykernel).
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(root / "config"), "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
           "JUPYTER_DATA_DIR": str(root / "data"),
           "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(root / "workspaces"),
           "PYTHONUNBUFFERED": "1",
           # The kernel runs in the scratch copy of notebooks/: without this it imported whichever nbaccel
           # is installed (another checkout's, in a trial), not the one under test.
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
           f"--LabApp.workspaces_dir={root / 'workspaces'}", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--ServerApp.terminals_enabled=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # CI containers run as root; the server still only listens on loopback
    log_path = root / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not answer within {SERVER_START_S}s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"url": base, "token": token, "root": work, "log": log_path}
    finally:
        # The whole process group: the server and the kernels it started.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def browser():
    chromium = _chromium()
    if chromium is None:
        pytest.skip("Chromium not found at /usr/bin/chromium: apt-get install chromium (never a downloaded build)")
    sync_playwright = _playwright()
    if sync_playwright is None:
        pytest.skip("Playwright for Python is not installed: pip install -e '.[test]'")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def screenshot_dir(tmp_path):
    target = os.environ.get("NBACCEL_SCREENSHOT_DIR")
    path = Path(target) if target else tmp_path / "screenshots"
    if not path.is_absolute():
        path = ROOT / path
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _lab_page(browser, lab, screenshot_dir, failure_png: str):
    """A 1400x1000 page and the list of the browser's console and page errors; on a failure, a full-page
    screenshot (``failure_png``), the server log's path and the last errors are printed."""
    errors: list[str] = []
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        yield page, errors
    except Exception:
        page.screenshot(path=str(screenshot_dir / failure_png), full_page=True)
        print(f"failure screenshot: {screenshot_dir / failure_png}; server log: {lab['log']}")
        print("console errors:", *errors[-20:], sep="\n  ")
        raise
    finally:
        context.close()


def _wait_for_idle_kernel(lab, timeout_s: float, notebook: str = QUICKSTART):
    """The notebook's session has a kernel and that kernel is idle (asked from the server's REST API)."""
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{lab['url']}/api/sessions?token={lab['token']}", timeout=10) as r:
            sessions = json.load(r)
        states = [s["kernel"]["execution_state"] for s in sessions if s.get("kernel") and
                  s.get("path", "").endswith(notebook)]
        state = states[0] if states else None
        if state == "idle":
            return
        time.sleep(0.5)
    raise AssertionError(f"{notebook}'s kernel did not become idle within {timeout_s:.0f}s (last state: {state})")


def _open_and_run_all(page, lab, notebook: str, n_code_cells: int) -> float:
    """Open ``notebook`` in Lab, wait for its kernel, Run All Cells; the seconds the run took."""
    page.goto(f"{lab['url']}/lab/tree/{notebook}?token={lab['token']}", timeout=PAGE_READY_MS)
    page.locator(f"{ACTIVE_NOTEBOOK} .jp-CodeCell").first.wait_for(timeout=PAGE_READY_MS)
    # The kernel must be up before Run All (else Lab asks which kernel to start).
    _wait_for_idle_kernel(lab, PAGE_READY_MS / 1000, notebook)
    page.wait_for_function(
        "() => /Idle/.test(document.querySelector('#jp-main-statusbar')?.innerText || '')", timeout=PAGE_READY_MS)
    page.wait_for_function("([n, active]) => document.querySelectorAll(active + ' .jp-CodeCell').length === n",
                           arg=[n_code_cells, ACTIVE_NOTEBOOK], timeout=30_000)
    started = time.monotonic()
    _run_all_cells(page)
    _wait_until_executed(page, n_code_cells, RUN_ALL_MS)
    return time.monotonic() - started


def _run_new_notebook(page, lab, name: str, cells: list[str]):
    """Write a notebook of these code cells into Lab's folder, open it, Run All; its locator, once no cell raised."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab["root"] / name)
    _open_and_run_all(page, lab, name, len(cells))
    notebook = page.locator(ACTIVE_NOTEBOOK)
    tracebacks = _tracebacks(notebook)
    assert not tracebacks, f"a cell raised in JupyterLab:\n{tracebacks[0][:2000]}"
    return notebook


def _tracebacks(notebook) -> list[str]:
    errors = notebook.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    return [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]


def _wait_for_change(locator, before: str, timeout_s: float = 20):
    """Poll until the element the locator finds now (widgets replace their HTML) shows other text."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if locator.inner_text() != before:
            return
        time.sleep(0.2)
    raise AssertionError(f"the widget did not update within {timeout_s:.0f}s (the kernel round trip failed?)")


def _run_all_cells(page):
    """Run > Run All Cells, from the menu bar, as a person would."""
    page.locator("#jp-MainMenu").get_by_text("Run", exact=True).click()
    page.locator(".lm-Menu-content").get_by_text("Run All Cells", exact=True).click()
    # Should the page have lost its kernel, Lab asks which one to start: take its suggestion, as a person would.
    dialog = page.locator(".jp-Dialog").filter(has_text="Select Kernel")
    try:
        dialog.wait_for(state="visible", timeout=3_000)
    except Exception:  # noqa: BLE001 - playwright's TimeoutError: no dialog, the usual case
        return
    dialog.get_by_role("button", name="Select").click()


def _wait_until_executed(page, n_code_cells: int, timeout_ms: int):
    """Every code cell has a number in its prompt (``[*]`` means still running) and the kernel is idle."""
    page.wait_for_function(
        """([n, active]) => {
            const prompts = [...document.querySelectorAll(active + ' .jp-CodeCell .jp-InputPrompt')]
                .map(p => p.textContent.trim());
            const done = prompts.filter(t => /^\\[\\d+\\]:$/.test(t)).length;
            const busy = prompts.some(t => t.includes('*'));
            return prompts.length === n && done === n && !busy;
        }""",
        arg=[n_code_cells, ACTIVE_NOTEBOOK], timeout=timeout_ms, polling=500,
    )


def test_quickstart_widgets_render_in_jupyterlab(lab, browser, screenshot_dir):
    import nbformat

    nb = nbformat.read(lab["root"] / QUICKSTART, as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    assert any(s.lstrip().startswith("%%amp") for s in sources), "the quickstart lost its %%amp cell"
    assert any(s.lstrip().startswith("%%profile_gpu") for s in sources), "the quickstart lost its %%profile_gpu cell"
    assert any("%memory_budget" in s for s in sources), "the quickstart lost its %memory_budget cell"

    with _lab_page(browser, lab, screenshot_dir, "failure.png") as (page, console_errors):
        run_seconds = _open_and_run_all(page, lab, QUICKSTART, len(sources))
        notebook = page.locator(ACTIVE_NOTEBOOK)
        tracebacks = _tracebacks(notebook)
        assert not tracebacks, f"a cell raised in JupyterLab:\n{tracebacks[0][:2000]}"

        # The %%amp widget: drawn by the widget manager (the class is only on the ipywidgets VBox,
        # not on the static HTML fallback), with a speedup figure a person can read.
        amp = notebook.locator(".nbaccel-amp")
        amp.first.wait_for(state="visible", timeout=30_000)
        assert amp.count() == 1
        speedup = amp.locator(".nbaccel-speedup")
        # two decimals when firm ("1.38x"), two significant digits when flagged uncertain or contended
        # ("2.3x", "0.73x", "18x": timing.format_ratio), as a noisy CI machine often makes it
        assert re.fullmatch(r"\d+\.\d{2}x|[1-9]\.\dx|\d{2,}x|0\.0+\d{2}x", speedup.inner_text().strip()), speedup.inner_text()
        amp.first.scroll_into_view_if_needed()
        amp.first.screenshot(path=str(screenshot_dir / "amp_widget.png"))

        # The widget is live, not a picture: switching the operator filter goes through the kernel
        # (an observer there rewrites the table) and back.
        amp.get_by_role("tab", name="Operators").click()
        ops_table = amp.locator(".widget-tab-contents table").first
        ops_table.wait_for(state="visible", timeout=10_000)
        all_ops = ops_table.inner_text()
        assert "aten::" in all_ops and re.search(r"\b(bf16|fp16)\b", all_ops), all_ops[:500]
        amp.get_by_role("button", name="fp32", exact=True).click()
        _wait_for_change(ops_table, all_ops)
        dtypes = [row.split("\t")[1] for row in ops_table.locator("tbody tr").all_inner_texts()]
        assert dtypes and set(dtypes) == {"fp32"}, f"the fp32 filter still shows {set(dtypes)}"

        _check_profiler_table(page, notebook, screenshot_dir)
        _check_memory_gauge(notebook, screenshot_dir)
        _check_nothing_cut_off(page)
        _check_tab_titles_whole(page)
        _check_header_in_a_narrow_window(page, notebook, screenshot_dir)

        body = notebook.inner_text()
        assert "Error displaying widget" not in body
        assert "Loading widget..." not in body, "a widget never finished loading (is jupyterlab_widgets installed?)"
        amp.first.scroll_into_view_if_needed()
        page.screenshot(path=str(screenshot_dir / "quickstart_lab.png"))

        widget_errors = [e for e in console_errors if WIDGET_ERROR.search(e)]
        assert not widget_errors, "the browser console reported widget errors:\n" + "\n".join(widget_errors)
        print(f"\nRun All took {run_seconds:.1f}s in JupyterLab; screenshots in {screenshot_dir}")


def _check_profiler_table(page, notebook, screenshot_dir):
    """The %%profile_gpu widget lists aten:: operators, and its sort control re-sorts them (through the kernel)."""
    prof = notebook.locator(".nbaccel-profile")
    prof.first.wait_for(state="visible", timeout=30_000)
    assert prof.count() == 1
    table = prof.locator(".widget-tab-contents table").first
    table.wait_for(state="visible", timeout=10_000)
    before = table.locator("tbody tr").all_inner_texts()
    assert before and any("aten::" in r for r in before), f"the profiler table lists no aten:: operators: {before[:3]}"
    prof.first.scroll_into_view_if_needed()
    prof.first.screenshot(path=str(screenshot_dir / "profile_widget.png"))

    # The header is a row of buttons over the table (nbaccel-th), lined up with its columns.
    buttons = prof.locator(".nbaccel-th")
    headers = [h.strip() for h in buttons.all_inner_texts()]
    assert headers and headers[0].startswith("operator"), f"no header buttons over the operator table: {headers}"
    _check_header_lines_up(table, buttons)
    labels = [h.rstrip(" \u25b2\u25bc") for h in headers]
    column = labels.index("self CPU") if "self CPU" in labels else None

    # Tick "ascending": the observer in the kernel re-sorts and sends the new table back.
    text_before = table.inner_text()
    prof.get_by_role("checkbox", name="ascending").check()
    _wait_for_change(table, text_before)
    after = table.locator("tbody tr").all_inner_texts()
    assert after and after[0] != before[0], "ticking 'ascending' did not re-sort the operator table"
    assert any("aten::" in r for r in after)
    if column is not None:  # the default sort on the CPU: self time, now smallest first
        first = [_seconds(r.split("\t")[column]) for r in (before[0], after[0])]
        assert first[1] <= first[0], f"ascending put {after[0]!r} above {before[0]!r}"
        times = [_seconds(r.split("\t")[column]) for r in after]
        assert times == sorted(times), f"the table is not in ascending order of self CPU: {times}"

    # Click the "calls" header: the kernel sorts by calls, largest first (and unticks "ascending");
    # a second click reverses.
    calls = labels.index("calls")
    for clicks, descending in ((1, True), (2, False)):
        text_before = table.inner_text()
        buttons.nth(calls).click()
        _wait_for_change(table, text_before)
        counts = [int(r.split("\t")[calls].replace(",", "")) for r in table.locator("tbody tr").all_inner_texts()]
        assert counts == sorted(counts, reverse=descending), f"click {clicks} on 'calls' did not sort: {counts}"
        arrow = "\u25bc" if descending else "\u25b2"
        assert buttons.nth(calls).inner_text().strip() == f"calls {arrow}", buttons.nth(calls).inner_text()
        assert prof.get_by_role("checkbox", name="ascending").is_checked() is not descending
    _check_header_lines_up(table, buttons)
    prof.first.scroll_into_view_if_needed()
    prof.first.screenshot(path=str(screenshot_dir / "profile_widget_sorted.png"))


def _check_header_lines_up(table, buttons):
    """Each header button stands over its column: the same left and right edges as the first row's cells."""
    cells = table.locator("tbody tr").first.locator("td")
    assert cells.count() == buttons.count(), f"{buttons.count()} header buttons over {cells.count()} columns"
    for i in range(buttons.count()):
        b, c = buttons.nth(i).bounding_box(), cells.nth(i).bounding_box()
        assert abs(b["x"] - c["x"]) <= 1.5 and abs(b["width"] - c["width"]) <= 1.5, (
            f"header {buttons.nth(i).inner_text()!r} at x={b['x']:.1f} w={b['width']:.1f}, "
            f"its column at x={c['x']:.1f} w={c['width']:.1f}")


def _check_nothing_cut_off(page):
    """Every nbaccel display fits the output area it is drawn in: prose wraps, only wide tables scroll
    inside their own box. (A JupyterLab trial: the %%amp and estimate widgets grew to 1100 px in a
    ~960 px output area, so their last column and every long line were cut off at the right edge.)"""
    overflows = page.evaluate("""() => [...document.querySelectorAll('.jp-OutputArea-output .nbaccel')].map(el => {
        const out = el.closest('.jp-OutputArea-output').getBoundingClientRect();
        const box = el.getBoundingClientRect();
        return {right: box.right, limit: out.right, text: el.innerText.slice(0, 60)};
    }).filter(r => r.right > r.limit + 1)""")
    assert not overflows, f"nbaccel displays wider than their output area (cut off): {overflows}"


def _check_tab_titles_whole(page):
    """In a ~700 px window with the file browser open, the %%amp and %%profile_gpu tabs read in full. (A
    JupyterLab trial: ipywidgets' tabs shrink to fit, and "Breakdown" and "Tensor Cores" read "Breakdowr",
    "Tensor Co".)"""
    page.set_viewport_size({"width": 700, "height": 1000})
    try:
        page.wait_for_timeout(1_000)
        cut = page.evaluate("""() => [...document.querySelectorAll(
                '.nbaccel-amp .widget-tab .lm-TabBar-tabLabel, .nbaccel-profile .widget-tab .lm-TabBar-tabLabel')]
            .filter(l => l.scrollWidth > l.clientWidth + 1).map(l => l.textContent)""")
        assert not cut, f"tab titles cut off in a 700 px window: {cut}"
        wide = page.evaluate("""() => [...document.querySelectorAll('.nbaccel-amp .widget-tab > .lm-TabBar, '
                + '.nbaccel-profile .widget-tab > .lm-TabBar')].filter(bar => {
                const out = bar.closest('.jp-OutputArea-output').getBoundingClientRect();
                return [...bar.querySelectorAll('.lm-TabBar-tab')].some(t => t.getBoundingClientRect().right > out.right + 1);
            }).map(bar => bar.innerText)""")
        assert not wide, f"tabs past the right edge of the output area in a 700 px window: {wide}"
    finally:
        page.set_viewport_size({"width": 1400, "height": 1000})
        page.wait_for_timeout(500)


def _check_header_in_a_narrow_window(page, notebook, screenshot_dir):
    """In a ~700 px window the operator table keeps its column widths and scrolls sideways in its box,
    and its header buttons scroll with it: still over their columns, scrolled to either end."""
    page.set_viewport_size({"width": 700, "height": 1000})
    try:
        page.wait_for_timeout(1_000)
        prof = notebook.locator(".nbaccel-profile")
        box = prof.locator(".nbaccel-ops-scroll").first
        table, buttons = prof.locator(".widget-tab-contents table").first, prof.locator(".nbaccel-th")
        box.scroll_into_view_if_needed()
        assert box.evaluate("b => b.scrollWidth > b.clientWidth"), "a 700 px window squeezed the operator table"
        _check_header_lines_up(table, buttons)
        box.evaluate("b => { b.scrollLeft = b.scrollWidth; }")
        page.wait_for_timeout(300)
        _check_header_lines_up(table, buttons)
        box.screenshot(path=str(screenshot_dir / "profile_table_narrow.png"))
    finally:
        page.set_viewport_size({"width": 1400, "height": 1000})
        page.wait_for_timeout(500)


def _seconds(text: str) -> float:
    """'2.38 µs' -> 2.38e-6 (the format nbaccel's tables use)."""
    text = text.strip()
    if text in {"0", "-"}:
        return 0.0
    value, unit = text.split()
    return float(value) * {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def _check_memory_gauge(notebook, screenshot_dir):
    """The %memory_budget gauge is drawn: the widget's progress bar, with a size and a filled part."""
    gauge = notebook.locator(".jupyter-widgets.nbaccel-gauge")  # the FloatProgress widget, not the HTML fallback
    gauge.first.wait_for(state="visible", timeout=30_000)
    box = gauge.first.bounding_box()
    assert box and box["width"] > 50 and box["height"] > 2, f"the memory gauge is not drawn: {box}"
    fill = gauge.first.locator(".progress-bar").first.bounding_box()
    assert fill and fill["width"] > 5 and fill["height"] > 2, f"the memory gauge shows no fill: {fill}"
    row = gauge.first.locator("xpath=..")
    row.scroll_into_view_if_needed()
    row.screenshot(path=str(screenshot_dir / "memory_budget_widget.png"))


GPU_TRACE = "data/h100_qwen_inference.json.gz"  # a real H100 trace the notebooks ship (notebooks/data/README.md)


def test_gpu_trace_widget_renders_in_jupyterlab(lab, browser, screenshot_dir):
    """The %%profile_gpu widget over a GPU profile, as a person sees it in Lab: this machine has no GPU, so
    the profile is the real H100 trace the notebooks ship, through ``%profile_trace`` (the same widget as
    %%profile_gpu's). Checked against the Python API's own figures for the same file: the header names the
    H100 and the peak, the operator table is sorted by self device time and re-sorts, the name filter goes
    through the kernel, the Tensor Cores tab shows the share the API computes, the Breakdown tab the kernels."""
    import nbaccel

    expected = nbaccel.load_trace(NOTEBOOKS / GPU_TRACE, top=8)
    share = f"{100 * expected.tensor_cores.value:.1f}%"
    cells = ["%load_ext nbaccel", f"%profile_trace {GPU_TRACE} --top 8"]
    with _lab_page(browser, lab, screenshot_dir, "gpu_trace_failure.png") as (page, console_errors):
        notebook = _run_new_notebook(page, lab, "gpu_trace.ipynb", cells)
        prof = notebook.locator(".nbaccel-profile")
        prof.first.wait_for(state="visible", timeout=30_000)
        header = prof.first.inner_text()
        assert "H100" in header and "dense bf16 peak" in header, header[:600]
        assert "device busy" in header and "kernels" in header, header[:600]

        # Sorted by self device time (the default with kernels), largest first: the API's order.
        table = prof.locator(".widget-tab-contents table").first
        table.wait_for(state="visible", timeout=10_000)
        buttons = prof.locator(".nbaccel-th")
        labels = [h.strip().rstrip(" \u25b2\u25bc") for h in buttons.all_inner_texts()]
        device = labels.index("self device")
        assert buttons.nth(device).inner_text().strip() == "self device \u25bc"
        rows = [r.split("\t") for r in table.locator("tbody tr").all_inner_texts()]
        times = [_seconds(r[device]) for r in rows]
        assert len(rows) == 8 and times == sorted(times, reverse=True), times
        top = expected.ops.sort_values("device_self_us", ascending=False)["name"].iloc[0]
        assert rows[0][0].strip() == top, (rows[0][0], top)
        _check_header_lines_up(table, buttons)
        prof.first.scroll_into_view_if_needed()
        prof.first.screenshot(path=str(screenshot_dir / "gpu_trace_widget.png"))

        # The name filter: typed into the box, the kernel filters and sends the table back.
        before = table.inner_text()
        prof.get_by_placeholder("part of an op name").fill("mm")
        _wait_for_change(table, before)
        names = [r.split("\t")[0] for r in table.locator("tbody tr").all_inner_texts()]
        assert names and all("mm" in n for n in names), names

        prof.get_by_role("tab", name="Tensor Cores").click()
        tensor_cores = prof.locator(".widget-tab-contents").filter(has_text="Tensor Core share")
        tensor_cores.first.wait_for(state="visible", timeout=10_000)
        assert f"Tensor Core share of kernel time: {share}" in tensor_cores.first.inner_text()

        prof.get_by_role("tab", name="Breakdown").click()
        breakdown = prof.locator(".widget-tab-contents").filter(has_text="Top kernels")
        breakdown.first.wait_for(state="visible", timeout=10_000)
        text = breakdown.first.inner_text()
        assert "matmul/conv" in text and "sm90" in text, text[:800]  # Hopper's kernels, named in full
        breakdown.first.screenshot(path=str(screenshot_dir / "gpu_trace_breakdown.png"))
        widget_errors = [e for e in console_errors if WIDGET_ERROR.search(e)]
        assert not widget_errors, "the browser console reported widget errors:\n" + "\n".join(widget_errors)


def test_memory_estimate_folds_its_method_in_jupyterlab(lab, browser, screenshot_dir):
    """A %memory_budget --model estimate as Lab shows it: the verdict and the table in view, the sharding table
    and the method folded until clicked (a tiny model's estimate filled a screen, most of it method)."""
    cells = ["%load_ext nbaccel",
             "import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 64))\nx = torch.randn(32, 64)",
             "%memory_budget 1GiB --model model --batch 32 --input x"]
    with _lab_page(browser, lab, screenshot_dir, "estimate_failure.png") as (page, console_errors):
        notebook = _run_new_notebook(page, lab, "estimate.ipynb", cells)
        estimate = notebook.locator(".nbaccel").filter(has_text="parameters")
        estimate.first.wait_for(state="visible", timeout=30_000)
        shown = estimate.first.inner_text()  # what is drawn: a folded section's body is not
        assert "fits in fp32" in shown and "peak during" in shown, shown[:800]
        assert "not needed: fp32 and bf16 AMP fit in the budget unsharded" in shown
        assert "ZeRO-1" not in shown and "method:" not in shown, shown[:1500]
        estimate.first.screenshot(path=str(screenshot_dir / "memory_estimate_folded.png"))

        estimate.first.get_by_text("How these figures were measured").click()
        method = estimate.first.locator("details").filter(has_text="How these figures were measured")
        assert "method: params/buffers/grads/optimizer states" in method.inner_text()
        assert "ZeRO-1" not in estimate.first.inner_text()  # the other fold stays as it was
        widget_errors = [e for e in console_errors if WIDGET_ERROR.search(e)]
        assert not widget_errors, "the browser console reported widget errors:\n" + "\n".join(widget_errors)
