"""IPython magics: thin layers that parse a line, call the API, and display the result.

Each capability has its own Magics class; `MAGIC_CLASSES` is what ``%load_ext nbaccel``
registers and ``%unload_ext nbaccel`` removes.
"""

from .amp import AmpMagics
from .budget import BudgetMagics
from .common import plain_help
from .env import EnvMagics
from .profile import ProfileMagics
from .trace import TraceMagics

MAGIC_CLASSES = (AmpMagics, EnvMagics, ProfileMagics, BudgetMagics, TraceMagics)


def _plain_docs() -> None:
    """``%name?`` shows a magic's ``__doc__``, which magic_arguments made from the same help as ``-h``."""
    for cls in MAGIC_CLASSES:
        for kind in cls.magics.values():
            for method in kind.values():
                fn = getattr(cls, method)
                if fn.__doc__:
                    fn.__doc__ = plain_help(fn.__doc__)


_plain_docs()
