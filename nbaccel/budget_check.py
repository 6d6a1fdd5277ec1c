"""The CUDA path of ``%memory_budget``, end to end, for the GPU check script.

``python -m nbaccel.budget_check`` (or ``cuda_check()``) runs, in a real InteractiveShell:

1. a 1 GiB allocation under a budget: the measured allocated peak must be within 5 % of it;
2. ``--enforce`` with a 2 GiB budget and a 3 GiB allocation: the cap turns it into a
   ``torch.OutOfMemoryError`` that the handler explains (request, cap, holders), and the next
   cell still runs (the kernel is alive);
3. ``%memory_budget off``: the allocator fraction is back to what it was, and no hook or handler
   is left.

It raises AssertionError with the numbers on any failure and returns them otherwise.
"""

from __future__ import annotations

import json

import torch

GiB = 2**30


def cuda_check(shell=None) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_check needs a CUDA device")
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython
    from IPython.utils.capture import capture_output

    ip = shell or start_ipython() or get_ipython()  # start_ipython() is None when called before
    ip.run_line_magic("load_ext", "nbaccel")
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction_before = getter(0) if getter else None

    def run(src):
        with capture_output(display=True) as captured:
            result = ip.run_cell(src, store_history=True)
        return result, "\n".join(o.data.get("text/plain", "") for o in captured.outputs) + captured.stdout

    out = {}
    try:
        run("import torch\ntorch.cuda.empty_cache()")
        run("%memory_budget 0.9 --device cuda -q -r _b")
        run("x = torch.ones(GiB // 4, device='cuda')".replace("GiB", str(GiB)))
        row = ip.user_ns["_b"].history.iloc[-1]
        out["allocated_peak_bytes"] = int(row["allocated_peak_bytes"])
        out["reserved_peak_bytes"] = int(row["used_bytes"])
        out["added_bytes"] = int(row["added_bytes"])
        run("del x\ntorch.cuda.empty_cache()")
        before = torch.cuda.memory_allocated(0)
        assert abs((out["allocated_peak_bytes"] - before) - GiB) <= 0.05 * GiB, out

        run("%memory_budget 2GiB --enforce --device cuda -q")
        result, text = run(f"y = torch.empty({3 * GiB}, dtype=torch.uint8, device='cuda')")
        out["enforced_error"] = type(result.error_in_exec).__name__
        out["explanation_head"] = text.strip().splitlines()[0] if text.strip() else ""
        assert isinstance(result.error_in_exec, torch.OutOfMemoryError), out
        assert "OUT OF MEMORY on cuda" in text and "requested: 3 GiB" in text and "limit:" in text, text
        alive, _ = run("alive = 1 + 1")
        assert alive.success and ip.user_ns["alive"] == 2
        run("%memory_budget off -q")
        if getter:
            out["fraction_after_off"] = getter(0)
            assert out["fraction_after_off"] == fraction_before, out
        left = [cb for n in ("pre_run_cell", "post_run_cell") for cb in ip.events.callbacks[n]
                if "nbaccel" in type(getattr(cb, "__self__", None)).__module__]
        assert not left and ip.custom_exceptions == (), (left, ip.custom_exceptions)
        out["ok"] = True
        return out
    finally:
        ip.run_line_magic("unload_ext", "nbaccel")


if __name__ == "__main__":
    print(json.dumps(cuda_check(), indent=2))
