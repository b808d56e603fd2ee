"""An alias of :mod:`kvwire.holding.state` (the transceiver state's home since issue 41), kept
for code written against ``kvwire.runtime.state``. New code imports ``kvwire.holding``."""

from kvwire.holding.state import *  # noqa: F403
from kvwire.holding.state import __all__ as __all__
