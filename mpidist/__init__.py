"""mpidist: MPI-native distributed training.

See docs/ARCHITECTURE.md.
"""
__version__ = "0.1.0"
