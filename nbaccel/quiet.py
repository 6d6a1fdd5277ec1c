"""Hide the side channels of a measurement run that capturing stdout and stderr misses.

``%%amp`` and ``%%profile_gpu`` run a cell several times and show the output of one run (the kept
one, or the last). Capturing ``sys.stdout``/``sys.stderr`` hides prints, but not:

* logging: a ``StreamHandler`` keeps the stream it was given (``basicConfig(stream=sys.stderr)``),
  so every hidden run logged its lines (a 2-epoch cell under ``%%amp`` logged 26 of them);
* warnings: Python shows a warning once per code location, so the first hidden run used it up and
  the run the user sees showed none (torch's "lr_scheduler.step() before optimizer.step()").

In a hidden run (`hiding_side_channels` wraps whatever silencer the caller passed), logging is
disabled and warnings are recorded and dropped without touching the once-per-location registries
(the "always" action keeps no record). Restoring the filters when
the block ends also invalidates those registries (Python versions them with its filter list), so
the shown run warns as a plain run would -- and may repeat a warning an earlier cell already
showed once, as any change to the warning filters does.
"""

from __future__ import annotations

import contextlib
import logging
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


def hiding_side_channels(silence):
    """``silence`` (a context-manager factory that hides a run's output: the magics' capture, a
    script's own) extended to logging and warnings, so every caller's hidden runs get both."""

    @contextlib.contextmanager
    def hidden():
        with silence(), unlogged_and_unwarned():
            yield

    return hidden
