"""Run on a simulated cluster (tests/simcluster): mpidist.torch across real nodes against one
process on the global batch; prints one JSON line from rank 0."""
import faulthandler
import importlib.util
import json
import os

from mpidist.comm import Communicator

_CASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torch",
                     "hierarchy_case.py")
_spec = importlib.util.spec_from_file_location("hierarchy_case", _CASE)
_case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_case)
max_rel_diff = _case.max_rel_diff


STACKS_AFTER = 200      # seconds; the test gives the run 240


def main() -> None:
    # a hang ends with every rank's stack on stderr, before the test's own timeout
    faulthandler.dump_traceback_later(STACKS_AFTER, exit=True)
    c = Communicator()
    out = {"size": c.size, "num_nodes": c.num_nodes,
           "auto": max_rel_diff(c, "auto"), "hierarchical": max_rel_diff(c, "hierarchical")}
    if c.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    c.free()


if __name__ == "__main__":
    main()
