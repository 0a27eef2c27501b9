"""CUDA tensors in the backend: each collective is ordered after the work torch had queued on
its current stream when the collective was called.

Allreduces: the caller's thread records an event on torch's current stream; the group's
worker waits for it, then float32/float64 tensors go to mpidist's allreduce on CuPy views
(its device path: CUDA-aware MPI where the library is, else staged through the host), other
dtypes to the CPU path on host copies. Every other collective (on_host) runs the CPU path on
host copies made at the call, on torch's current stream (so after its queued work), copied
back to the device before the Work completes. The Work completes only once the results are
on the device, so work queued after wait() sees them.
"""
from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["has_cuda", "ready_event", "staged", "on_host", "DEVICE_DTYPES"]

DEVICE_DTYPES = (torch.float32, torch.float64)     # reduced on the device path (no widening)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)


def has_cuda(args) -> bool:
    """Whether any tensor in args (nested lists) is a CUDA tensor."""
    return any(t.is_cuda for t in _tensors(args))


def ready_event(args):
    """An event recorded on torch's current stream of the first CUDA tensor's device (on the
    calling thread, at the call), or None without CUDA tensors."""
    for t in _tensors(args):
        if t.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            return event
    return None


@contextlib.contextmanager
def staged(args):
    """args with every CUDA tensor replaced by a host copy; on a normal exit the host copies
    go back into the CUDA tensors (the collective's outputs among them), synchronously."""
    pairs = []

    def host(obj):
        if isinstance(obj, torch.Tensor):
            if not obj.is_cuda:
                return obj
            h = obj.detach().to("cpu", memory_format=torch.contiguous_format)
            pairs.append((obj, h))
            return h
        if isinstance(obj, list):
            return [host(x) for x in obj]
        if isinstance(obj, tuple):
            return tuple(host(x) for x in obj)
        return obj
    yield host(args)
    for dev, h in pairs:
        dev.detach().copy_(h)
    if pairs:
        torch.cuda.current_stream(pairs[0][0].device).synchronize()


def on_host(method):
    """Decorate a Group collective `method(self, done, *args)`: with CUDA tensors among args,
    it runs on host copies made now (ordered after torch's current stream), and the results
    go back into the CUDA tensors before `done` completes the Work."""
    @functools.wraps(method)
    def call(self, done, *args):
        if not has_cuda(args):
            return method(self, done, *args)
        context = staged(args)
        host = context.__enter__()

        def finish(error):
            try:
                if error is None:
                    context.__exit__(None, None, None)     # copy back, synchronise
            except Exception as exc:                        # delivered by Work.wait()
                error = f"{type(exc).__name__}: {exc}"
            done(error)
        return method(self, finish, *host)
    return call
