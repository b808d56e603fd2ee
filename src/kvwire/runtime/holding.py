"""An alias of :mod:`kvwire.holding.loop`, the holder loop's home since issue 41: code written
against ``kvwire.runtime.holding`` (plugins, engines, the suite) keeps working. New code imports
``kvwire.holding``."""

from kvwire.holding.loop import *  # noqa: F403
from kvwire.holding.loop import __all__ as __all__
