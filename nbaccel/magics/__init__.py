"""IPython magics: thin layers that parse a line, call the API, and display the result.

Each capability has its own Magics class; `MAGIC_CLASSES` is what ``%load_ext nbaccel``
registers and ``%unload_ext nbaccel`` removes.
"""

from .amp import AmpMagics
from .budget import BudgetMagics
from .env import EnvMagics
from .profile import ProfileMagics
from .trace import TraceMagics

MAGIC_CLASSES = (AmpMagics, EnvMagics, ProfileMagics, BudgetMagics, TraceMagics)
