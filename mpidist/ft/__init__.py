"""Training that survives a lost rank: ULFM (MPI's fault-tolerance extension) shrink-and-continue.

    recovery   the training loop's hook for [job] fault_tolerance = "shrink": the survivors
               agree on the state to continue from, rebuild the strategy over the new size
               and record each recovery
    inject     planned kills for the tests and `mpidist bench ft` (MPIDIST_FT_KILL), which
               the recovery asks at two points and nothing else uses

The MPI level (is ULFM active, is this exception a process failure, revoke and shrink) is
mpidist.ulfm, below the collectives, which leave the shared-memory allreduce out in FT mode;
recovery sits above the strategies and below the engine's loop.
See docs/ARCHITECTURE.md (fault tolerance).
"""
