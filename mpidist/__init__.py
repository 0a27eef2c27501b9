"""mpidist: MPI-native distributed training.

See docs/ARCHITECTURE.md.
"""
from mpidist import mpienv as _mpienv

__version__ = "0.1.0"

_mpienv.apply()                 # before anything starts MPI (mpidist.mpienv)
