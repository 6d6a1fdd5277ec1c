"""Hide the side channels of a measurement run that capturing stdout and stderr misses.

``%%amp`` and ``%%profile_gpu`` run a cell several times and show the output of one run (the kept
one, or the last). Capturing ``sys.stdout``/``sys.stderr`` hides prints, but not:

* logging: a ``StreamHandler`` keeps the stream it was given (``basicConfig(stream=sys.stderr)``),
  so every hidden run logged its lines (a 2-epoch cell under ``%%amp`` logged 26 of them);
* warnings: Python shows a warning once per code location, so the first hidden run used it up and
  the run the user sees showed none (torch's "lr_scheduler.step() before optimizer.step()");
* matplotlib figures: pyplot keeps every figure a run opens until something closes it, and the
  inline backend shows all open figures when the cell ends, so a plotting cell under ``%%amp``
  showed 15 identical figures (one per run). ``plt.show()`` in the cell displays and closes its
  figure inside the run, where the capture hides it; a figure left open was never hidden.

In a hidden run (`hiding_side_channels` wraps whatever silencer the caller passed), logging is
disabled, warnings are recorded and dropped without touching the once-per-location registries
(the "always" action keeps no record), and the pyplot figures the run opened are closed when it
ends (`new_figures_closed`; figures open before it are left alone). Restoring the filters when
the block ends also invalidates those registries (Python versions them with its filter list), so
the shown run warns as a plain run would -- and may repeat a warning an earlier cell already
showed once, as any change to the warning filters does.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings


@contextlib.contextmanager
def unlogged_and_unwarned():
    previous = logging.root.manager.disable  # the level the user's own logging.disable() set, if any
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            yield
    finally:
        logging.disable(previous)


def _open_figures() -> set:
    """pyplot's open figure managers; none when pyplot is not imported (nbaccel never imports it:
    a cell that plots has imported it, and one that does not should not pay for matplotlib)."""
    if "matplotlib.pyplot" not in sys.modules:
        return set()
    from matplotlib._pylab_helpers import Gcf  # pyplot's own registry, already loaded with it

    return set(Gcf.get_all_fig_managers())


@contextlib.contextmanager
def new_figures_closed():
    """Close the pyplot figures opened inside the block, also when it raises. Managers, not figure
    numbers, tell new from old: a run may close figure 1 and open a new figure 1."""
    before = _open_figures()
    try:
        yield
    finally:
        for manager in _open_figures() - before:  # the cell may have imported pyplot itself
            sys.modules["matplotlib.pyplot"].close(manager.canvas.figure)


def hiding_side_channels(silence):
    """``silence`` (a context-manager factory that hides a run's output: the magics' capture, a
    script's own) extended to logging, warnings and pyplot figures, so every caller's hidden runs
    get all three."""

    @contextlib.contextmanager
    def hidden():
        with silence(), unlogged_and_unwarned(), new_figures_closed():
            yield

    return hidden
