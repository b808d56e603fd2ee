"""An alias of :mod:`kvwire.holding.auth` (pull authentication's home since issue 41), kept for
code written against ``kvwire.runtime.auth``. New code imports ``kvwire.holding``."""

from kvwire.holding.auth import *  # noqa: F403
from kvwire.holding.auth import __all__ as __all__
