"""Training that survives a lost rank: ULFM (MPI's fault-tolerance extension) shrink-and-continue.

    ulfm       the MPI level: is ULFM active, is this exception a process failure, revoke
               every communicator of a Communicator and shrink it to the survivors
    recovery   the training loop's hook for [job] fault_tolerance = "shrink": the survivors
               agree on the state to continue from, rebuild the strategy over the new size
               and record each recovery

Only ulfm is imported by the layers below the engine (collectives leave the shared-memory
allreduce out in FT mode); recovery sits at the engine's level.
See docs/ARCHITECTURE.md (fault tolerance).
"""
