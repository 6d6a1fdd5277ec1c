"""The CUDA path of %memory_budget (runs only where CUDA exists; the GPU check script runs it)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_peak_enforce_and_oom_explanation(_ipython):
    from nbaccel.budget_check import cuda_check

    result = cuda_check(_ipython)
    assert result["ok"] and result["enforced_error"] == "OutOfMemoryError"
    _ipython.reset(new_session=False)


def test_cap_is_released_on_unload(ip):
    from nbaccel.budget import capped_devices

    ip.run_line_magic("memory_budget", "1GiB --enforce --device cuda -q")
    assert capped_devices() == [0]
    ip.run_line_magic("unload_ext", "nbaccel")
    assert capped_devices() == []
    ip.run_line_magic("load_ext", "nbaccel")


def test_cuda_counters_match_torch_getters():
    from nbaccel.memory import cuda_counters

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)
    c = cuda_counters(dev)
    assert (c.allocated, c.reserved) == (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev))
    assert (c.peak_allocated, c.peak_reserved) == (torch.cuda.max_memory_allocated(dev),
                                                   torch.cuda.max_memory_reserved(dev))
    del x


def test_enforced_cap_is_re_armed_by_reload(ip):
    from nbaccel.budget import capped_devices

    ip.run_line_magic("memory_budget", "1GiB --enforce --device cuda -q")
    ip.run_line_magic("reload_ext", "nbaccel")
    assert capped_devices() == [0]
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter:
        assert getter(0) == pytest.approx(2**30 / torch.cuda.get_device_properties(0).total_memory)
    ip.run_line_magic("memory_budget", "-q -r after")
    after = ip.user_ns["after"]
    assert after.active and after.enforce and after.budget_bytes == 2**30 and after.device.startswith("cuda")
    ip.run_line_magic("unload_ext", "nbaccel")
    assert capped_devices() == []
    ip.run_line_magic("load_ext", "nbaccel")


def test_a_device_side_assert_is_the_failing_cells_error():
    """A real device-side assert, in a child process (it leaves the CUDA context unusable): the watcher's
    synchronize after the cell finds it, and it becomes that cell's error; the next cell is not failed."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        from IPython.core.interactiveshell import InteractiveShell
        ip = InteractiveShell.instance()
        ip.run_line_magic("load_ext", "nbaccel")
        ip.run_cell("import torch; t = torch.zeros(4, device='cuda'); i = torch.tensor([10], device='cuda')")
        ip.run_line_magic("memory_budget", "1GiB --device cuda -q -r b")
        bad = ip.run_cell("y = t[i]")  # an index out of range: the kernel asserts, asynchronously
        later = ip.run_cell("z = 3")
        print("BAD", type(bad.error_in_exec).__name__, "LATER", later.error_in_exec is None)
        print("STATUS", list(ip.user_ns["b"].history["status"]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert "the GPU reported this error as In[" in out, out[-3000:]
    assert "Error in callback" not in out and "LATER True" in out, out[-3000:]
    assert "STATUS ['error', 'ok']" in out, out[-3000:]
