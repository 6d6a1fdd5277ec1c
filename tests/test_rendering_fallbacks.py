"""No frontend, broken frontends, and saved results: the measurement always survives."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import nbaccel
from nbaccel.render import amp as amp_render
from nbaccel.render import display as display_module


@pytest.fixture(scope="module")
def amp_result():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    x = torch.randn(16, 32)
    # 3 timed runs: the fewest for which a speedup figure is shown (below, "not claimed")
    return nbaccel.compare_amp(lambda: model(x).float().sum(), repeat=3, warmup=0)


def test_without_ipywidgets_the_bundle_is_html_and_text(amp_result, monkeypatch):
    monkeypatch.setattr(display_module, "WIDGETS", "auto")
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails like an uninstalled package
    bundle = display_module.mime_bundle(amp_result)
    assert set(bundle) == {"text/plain", "text/html"}


def test_plain_terminal_ipython_gets_no_widget(amp_result, monkeypatch):
    monkeypatch.setattr(display_module, "WIDGETS", "auto")
    # The test shell is a TerminalInteractiveShell: no kernel, so no widget manager.
    assert not display_module.widgets_available()
    assert "application/vnd.jupyter.widget-view+json" not in display_module.mime_bundle(amp_result)


def test_widget_failure_falls_back_and_result_is_still_stored(ip, monkeypatch, run_cell):
    monkeypatch.setattr(display_module, "WIDGETS", "always")

    def broken(result):
        raise RuntimeError("widget bug")

    monkeypatch.setattr(amp_render, "widget", broken)
    monkeypatch.setattr(amp_render, "html", broken)
    run_cell("import torch\nm = torch.nn.Linear(4, 4)\nx = torch.randn(2, 4)")
    _, captured = run_cell("%%amp --repeat 1 --warmup 0 -r kept\nm(x).sum()")
    assert "kept" in ip.user_ns
    shown = [o.data for o in captured.outputs if "text/plain" in o.data]
    assert any("speedup" in d["text/plain"] for d in shown)
    assert not any("text/html" in d for d in shown)


def test_text_failure_keeps_html_and_says_so(amp_result, monkeypatch):
    def broken(result):
        raise RuntimeError("text bug")

    monkeypatch.setattr(amp_render, "text", broken)
    bundle = display_module.mime_bundle(amp_result)
    assert "speedup" in bundle["text/html"]
    assert bundle["text/plain"] == ("<AmpResult: the text report failed (RuntimeError: text bug); the numbers are in the "
                                    "result's attributes and to_dict()>")


def test_widget_as_a_user_sees_it(amp_result):
    box = amp_render.widget(amp_result)
    summary, tabs, footer = box.children
    assert "speedup" in summary.value and amp_render.speedup_figure(amp_result) in summary.value
    assert [tabs.get_title(i) for i in range(3)] == ["Advice", "Operators", "Gradients"]
    choose, ops = tabs.children[1].children
    all_rows = ops.value.count("<tr>")
    choose.value = "reduced"
    reduced_rows = ops.value.count("<tr>")
    assert 1 < reduced_rows < all_rows
    assert "aten::addmm" in ops.value


def test_to_dict_round_trips_and_loads_into_a_frame(amp_result):
    text = amp_result.to_json()
    data = json.loads(text)
    assert json.loads(json.dumps(data)) == data
    old = dict(data, schema_version=0, nbaccel_version="0.0.1")
    del old["drift"]  # a field an older version did not write
    frame = nbaccel.results_frame([amp_result, text, old, {"kind": "future-thing", "schema_version": 9}])
    assert list(frame["kind"]) == ["amp", "amp", "amp", "future-thing"]
    assert frame.loc[0, "speedup"] == pytest.approx(amp_result.speedup)
    assert frame.loc[2, "drift_max_rel"] is None or frame.loc[2, "drift_max_rel"] != frame.loc[2, "drift_max_rel"]


def test_results_frame_takes_one_result_and_refuses_what_is_not_one(amp_result):
    assert list(nbaccel.results_frame(amp_result)["kind"]) == ["amp"]  # was "'AmpResult' object is not iterable"
    with pytest.raises(ValueError, match=r"record 0 is not a saved nbaccel result \(no 'kind'\)"):
        nbaccel.results_frame([{"a": 1}])  # was a silent row of kind None


def test_results_frame_reads_profile_and_budget_results():
    with nbaccel.profile() as prof:
        torch.randn(32, 32) @ torch.randn(32, 32)
    with nbaccel.memory_budget("8GiB") as mb:
        torch.ones(8)
    frame = nbaccel.results_frame([prof.result, mb.status()])
    assert list(frame["kind"]) == ["profile", "budget"]
    assert frame.loc[0, "wall_us"] > 0
    assert frame.loc[1, "budget_bytes"] == 8 * 2**30


def test_results_frame_has_headlines_for_every_result_kind():
    # A cell report, an OOM explanation, an estimate and the env report once loaded with empty columns
    # (only amp/profile/budget-status had headlines; the budget results share kind "budget").
    from nbaccel.budget import CellRecord, CellReport
    from nbaccel.oom import explain_oom

    cell = CellReport(CellRecord(label="In[3]", budget_bytes=2**30, used_bytes=900 * 2**20, added_bytes=300 * 2**20,
                                 allocated_peak_bytes=None, before_bytes=600 * 2**20, seconds=0.5, status="near",
                                 error=None, method="rss"), device="cpu")
    oom = explain_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                                   "you tried to allocate 1073741824 bytes. Error code 12"))
    est = nbaccel.estimate_memory(torch.nn.Linear(8, 8), batch=4, budget="1GiB")
    frame = nbaccel.results_frame([cell, oom, est, nbaccel.env_report()])
    assert list(frame["kind"]) == ["budget", "budget", "estimate", "env"]
    assert list(frame["view"][:2]) == ["cell", "oom"]
    assert (frame.loc[0, "cell"], frame.loc[0, "used_bytes"], frame.loc[0, "status"]) == ("In[3]", 900 * 2**20, "near")
    assert (frame.loc[1, "error_type"], frame.loc[1, "requested_bytes"]) == ("RuntimeError", 2**30)
    assert (frame.loc[2, "model"], frame.loc[2, "batch"], frame.loc[2, "budget_bytes"]) == ("model", 4, 2**30)
    assert frame.loc[2, "fp32_peak_bytes"] == est.to_dict()["single_gpu"]["fp32"]["total"] > 0 and frame.loc[2, "fits_fp32"]
    assert frame.loc[3, "torch"] == torch.__version__


@pytest.mark.parametrize("saving, label, value", [(0.3, "memory saved", "30%"), (0.0, "memory saved", "0%"),
                                                  (-7.0, "memory used", "+700% vs fp32")])
def test_memory_change_never_reads_as_a_negative_saving(saving, label, value):
    assert amp_render.memory_change(saving) == (label, value)


def test_recipe_that_took_more_memory_is_shown_as_more(amp_result, monkeypatch):
    monkeypatch.setattr(type(amp_result), "memory_saving", property(lambda self: -7.0))
    monkeypatch.setattr(type(amp_result), "memory_comparable", property(lambda self: True))  # a peak >= 1 MiB
    monkeypatch.setattr(type(amp_result), "memory_firm", property(lambda self: True))  # runs that do not overlap
    shown = amp_render.text(amp_result) + amp_render.html(amp_result) + amp_render.widget(amp_result).children[0].value
    assert "+700% vs fp32" in shown and "-700%" not in shown and "saved -" not in shown


def test_a_result_at_a_terminal_prompt_prints_the_report(amp_result):
    # IPython's pretty printer (what `res` at a terminal prompt shows) once found the dataclass's
    # generated __repr__ before the mixin's _repr_pretty_ and printed a dump of every field.
    from IPython.lib.pretty import pretty

    with nbaccel.profile() as prof:
        torch.ones(4, 4) @ torch.ones(4, 4)
    for result in (amp_result, prof.result, nbaccel.estimate_memory(torch.nn.Linear(8, 8), batch=4)):
        assert pretty(result) == str(result)
        assert f"{type(result).__name__}(" not in pretty(result)  # not the dataclass field dump


def test_show_in_a_plain_script_prints_the_text_report(tmp_path):
    # Outside IPython, display() printed the MIME bundle as one dict line of 5-9 kB.
    import os
    import subprocess
    from pathlib import Path

    script = tmp_path / "show.py"
    script.write_text("import torch, nbaccel\nx = torch.randn(8, 8)\n"
                      "nbaccel.compare_amp(lambda: x @ x, repeat=3, warmup=0).show()\n")
    checkout = str(Path(nbaccel.__file__).parents[1])  # this nbaccel, not an installed copy
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": checkout})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("nbaccel compare_amp() on CPU") and "'text/plain'" not in out.stdout


@pytest.mark.parametrize("records, error, message", [
    (None, TypeError, r"results_frame takes results, their to_dict\(\) or to_json\(\), or a list of them; got NoneType"),
    (["p1.json"], ValueError, r"record 0 is a string that is not JSON \('p1.json'\).*json.load\(open\(path\)\) first"),
])
def test_results_frame_names_what_it_cannot_read(records, error, message):
    with pytest.raises(error, match=message):
        nbaccel.results_frame(records)


def test_side_by_side_refuses_non_results_when_called(amp_result):
    with pytest.raises(TypeError, match=r"side_by_side takes nbaccel results .*argument 2 is not one \(int\)"):
        nbaccel.side_by_side(amp_result, 3)
    row = nbaccel.side_by_side([amp_result, amp_result])  # a list means its items
    assert str(row).count("nbaccel compare_amp() on") == 2


def test_cli_version():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "nbaccel", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"nbaccel {nbaccel.__version__}"


def test_a_report_names_what_made_it_the_magic_or_the_api_call(run_cell, ip):
    # A user trial: compare_amp() and profile() in a plain script printed "nbaccel %%amp on CPU...".
    import torch

    model, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    amp = nbaccel.compare_amp(lambda: model(x).sum(), repeat=3, warmup=0)
    with nbaccel.profile() as prof:
        model(x)
    assert str(amp).startswith("nbaccel compare_amp() on CPU") and "<h4>compare_amp() on CPU" in amp._repr_html_()
    assert str(prof.result).startswith("nbaccel profile() on CPU") and amp.to_dict()["made_by"] == "compare_amp()"
    run_cell("import torch\nm = torch.nn.Linear(8, 8)\nx = torch.randn(4, 8)")
    run_cell("%%amp --repeat 3 --warmup 0 -q -r a\nm(x).sum()")
    run_cell("%%profile_gpu -q -r p\nm(x)")
    # The API called in a magic's cell is the cell's own call, and named so.
    run_cell("import nbaccel")
    run_cell("%%profile_gpu -q\ninner = nbaccel.compare_amp(lambda: m(x).sum(), repeat=3, warmup=0)")
    assert str(ip.user_ns["inner"]).startswith("nbaccel compare_amp() on CPU")
    assert ip.user_ns["p"].to_dict()["made_by"] == "%%profile_gpu"
    assert str(ip.user_ns["a"]).startswith("nbaccel %%amp on CPU")
    assert str(ip.user_ns["p"]).startswith("nbaccel %%profile_gpu on CPU")


def _luminance(rgb):
    def channel(c):
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _contrast(a, b):
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _blend(fg, alpha, bg):
    return tuple(alpha * f + (1 - alpha) * b for f, b in zip(fg, bg))


@pytest.mark.parametrize("theme, text, alpha, background", [
    # JupyterLab's --jp-content-font-color1 and --jp-layout-color0 in its light and dark themes
    ("light", (0, 0, 0), 0.87, (255, 255, 255)),
    ("dark", (255, 255, 255), 1.0, (17, 17, 17)),
])
def test_secondary_and_warning_text_keep_wcag_contrast_in_light_and_dark_themes(theme, text, alpha, background):
    import re

    from nbaccel.render.common import CSS

    opacity = float(re.search(r"\.nbaccel \.muted \{opacity: ([0-9.]+)\}", CSS).group(1))
    muted = _blend(text, alpha * opacity, background)
    assert _contrast(muted, background) >= 4.5, theme
    light_warn, dark_warn = re.findall(r"\.warn \{color: #([0-9a-f]{6})\}", CSS)
    warn = dark_warn if theme == "dark" else light_warn
    assert _contrast(tuple(int(warn[i:i + 2], 16) for i in (0, 2, 4)), background) >= 4.5, theme
    assert 'data-jp-theme-light="false"' in CSS  # the dark colour applies where JupyterLab says it is dark


def test_results_frame_spells_the_device_one_way_for_every_kind():
    """A trial's frame read "AMD EPYC" (amp), "CPU: AMD EPYC" (profile) and "cpu" (budget) for one CPU: a
    filter by device found a third of the rows. The spec in ``device``, the name beside it."""
    model, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    amp = nbaccel.compare_amp(lambda: model(x), repeat=3, warmup=0)
    with nbaccel.profile() as prof:
        model(x)
    with nbaccel.memory_budget(0.9, device="cpu") as budget:
        model(x)
    frame = nbaccel.results_frame([amp, prof.result, budget])
    assert list(frame["device"]) == ["cpu", "cpu", "cpu"]
    name = nbaccel.env_report().sections["cpu"]["name"]
    assert list(frame["device_name"][:2]) == [name, name]
    from nbaccel.results import _device_spec
    assert _device_spec({"type": "cuda", "index": 1, "name": "NVIDIA H200"}) == "cuda:1"


def test_profile_and_amp_pages_fold_their_method():
    """A trial: a %%profile_gpu page ended in 13-16 lines of method between the figures and the next cell. On a
    page and in the widget it folds under "How these figures were measured" (as the memory estimate's does); the
    text keeps it whole (a terminal has no folds), and the trace line stays in view."""
    from nbaccel.render import amp as amp_render
    from nbaccel.render import profile as profile_render

    model, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    amp = nbaccel.compare_amp(lambda: model(x), repeat=3, warmup=0)
    with nbaccel.profile() as prof:
        model(x)
    fold = "<details><summary>How these figures were measured</summary>"
    for result, render in ((amp, amp_render), (prof.result, profile_render)):
        for page in (render.html(result), [w for w in widget_walk(render.widget(result))
                                           if type(w).__name__ == "HTML" and "method:" in w.value][0].value):
            before, _, inside = page.partition(fold)
            assert inside and "method: " in inside and "method:" not in before
        assert "method: " in render.text(result)


def widget_walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from widget_walk(child)
