"""The cost model's former place: it lives in collectives.tuning.costmodel now. This name
re-exports it for code not yet moved to the new import (experiments/)."""
from mpidist.collectives.tuning.costmodel import *  # noqa: F401,F403
from mpidist.collectives.tuning.costmodel import __all__  # noqa: F401
