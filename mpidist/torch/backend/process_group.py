"""The "mpidist" process group: a Python subclass of torch.distributed.ProcessGroup whose
collectives are Group's (group.py, moves.py) over one mpidist Communicator.

torch calls these methods from Python (dist.all_reduce, FSDP2, DeviceMesh) and from C++
through its ProcessGroup trampoline (DDP's reducer, the functional collectives of DTensor),
so no compiled code is needed. Each returns a Work over a torch future: Group runs the
collective on the calling thread or on its worker thread and ends it with done(None) or
done("Error: message"), which completes the future with the output tensors or fails it.
Work.wait() raises that error on this rank (Group's guard makes every rank raise together);
torch's own `_create_work_from_future` is not used, as its wait() drops the error. The
method names are torch 2.13's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mpidist.collectives.waits import hurry
from mpidist.torch.backend.group import Group

__all__ = ["ProcessGroup", "Work", "NAME"]

NAME = "mpidist"

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "prod",
        dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
        dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
        dist.ReduceOp.PREMUL_SUM: "premul_sum"}


def _op(opts) -> tuple[str, object]:
    """(Group's name of opts.reduceOp, the PREMUL_SUM factor or None)."""
    op = opts.reduceOp
    name = _OPS.get(op.op if isinstance(op, dist.ReduceOp) else op, "unknown")
    return name, (op.factor if name == "premul_sum" else None)


def _flat(lists) -> list[torch.Tensor]:
    return [t for ts in lists for t in ts]


class Work(dist.Work):
    """A collective's handle over `fut`, which holds its output tensors or its error."""

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        with hurry():                           # the worker need not nap while this blocks
            self._fut.wait()                    # raises the collective's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            raise RuntimeError("is_success: the collective has not completed; wait() first")
        return self.exception() is None

    def exception(self):
        """The collective's error, or None (also while it runs)."""
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except RuntimeError as exc:
            return exc
        return None


class ProcessGroup(dist.ProcessGroup):
    """One torch process group over `group` (a Group, which this object owns)."""

    def __init__(self, group: Group):
        super().__init__(group.rank, group.size)
        self._group = group
        self._name = self._desc = ""

    def _run(self, outputs: list, method: str, *args) -> Work:
        """group.<method>(done, *args) as a Work whose future holds `outputs`."""
        fut = torch.futures.Future()

        def done(error):
            if error is None:
                fut.set_result(outputs)
            else:
                fut.set_exception(RuntimeError(f"mpidist: {error}"))
        getattr(self._group, method)(done, *args)
        return Work(fut)

    def getBackendName(self) -> str:       # noqa: N802 (torch's names, called from C++)
        return NAME

    # torch keeps a group's name and description in its C++ backends, which this group has
    # none of: they live here (DeviceMesh and the functional collectives look groups up by
    # name)
    def setGroupName(self, name: str) -> None:      # noqa: N802
        self._name = name

    def getGroupName(self) -> str:                  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:      # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:                  # noqa: N802
        return self._desc

    def shutdown(self) -> None:
        """destroy_process_group: finish queued work and free the communicators."""
        if self._group is not None:
            self._group.shutdown()
            self._group = None

    def __repr__(self) -> str:
        return f"mpidist.ProcessGroup(rank={self.rank()}, size={self.size()})"

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._run(tensors, "allreduce", *_op(opts), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._run(tensors, "allreduce_coalesced", *_op(opts), tensors)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        return self._run(tensors, "reduce", *_op(opts), tensors, opts.rootRank,
                         opts.rootTensor)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run(outputs, "reduce_scatter", *_op(opts), outputs, input_lists)

    def reduce_scatter_single(self, output, inp, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run([output], "reduce_scatter_base", *_op(opts), output, inp)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run(outputs, "reduce_scatter_tensor_coalesced", *_op(opts), outputs,
                         inputs)

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._run(tensors, "broadcast", tensors, opts.rootRank, opts.rootTensor)

    def allgather(self, output_lists, inputs, opts=None):
        return self._run(_flat(output_lists), "allgather", output_lists, inputs)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self._run(_flat(output_lists), "allgather_coalesced", output_lists, inputs)

    def all_gather_single(self, output, inp, opts=None):
        return self._run([output], "allgather_base", output, inp)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._run(outputs, "allgather_into_tensor_coalesced", outputs, inputs)

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or dist.GatherOptions()
        return self._run(_flat(output_lists), "gather", output_lists, inputs, opts.rootRank)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        return self._run(outputs, "scatter", outputs, input_lists, opts.rootRank)

    def all_to_all_single(self, output, inp, output_splits, input_splits, opts=None):
        return self._run([output], "alltoall_base", output, inp, list(output_splits),
                         list(input_splits))

    def alltoall(self, outputs, inputs, opts=None):
        return self._run(outputs, "alltoall", outputs, inputs)

    def barrier(self, opts=None):
        return self._run([], "barrier")

    # ------------------------------------------------------------------ point to point
    def send(self, tensors, dst, tag):
        return self._run(tensors, "send", tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._run(tensors, "recv", tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        raise RuntimeError("the mpidist backend does not implement recvAnysource (recv "
                           "without a source); pass src=")
