"""mpidist: MPI-native distributed training."""
__version__ = "0.1.0"
