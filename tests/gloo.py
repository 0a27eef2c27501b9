"""gloo process groups for the tests that compare with torch's own backend.

On a loaded machine gloo's connection set-up now and then never finishes on one rank while
the others return with their group. `agreed` makes a group with each try bounded by TIMEOUT
(gloo gives up on a connection after about five times it), the ranks agree over MPI whether
every one of them has its group, and otherwise all drop it and try again: the harness then
sees a group or an error on every rank, not a hang.
"""
from datetime import timedelta

from mpi4py import MPI

TIMEOUT = timedelta(seconds=20)
TRIES = 3


def agreed(make, drop):
    """make() on every rank of COMM_WORLD until it returns on all of them; drop(result) on
    the ranks where it did when another failed. Collective; make() is called in lockstep."""
    error = None
    for _ in range(TRIES):
        made, error = None, None
        try:
            made = make()
        except RuntimeError as exc:           # torch's DistBackendError is one
            error = exc
        if MPI.COMM_WORLD.allreduce(error is None, op=MPI.LAND):
            return made
        if error is None:
            drop(made)
    raise RuntimeError(f"no gloo group on every rank after {TRIES} tries; here: {error}")
