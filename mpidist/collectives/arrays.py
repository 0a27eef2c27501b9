"""Any array in the collectives: torch tensors, DLPack, buffer-protocol and CUDA-array-
interface objects, seen as NumPy or CuPy arrays over the same memory.

`accept_arrays("buf", "out")` wraps a collective whose named arguments may be such
objects: each is viewed without a copy (torch CPU tensors through Tensor.numpy, bfloat16
as ml_dtypes'; CUDA tensors and `__cuda_array_interface__` objects as CuPy arrays, after
torch's current stream has finished its work on them; DLPack objects through
np.from_dlpack / cupy.from_dlpack; the buffer protocol through np.frombuffer), the
collective runs on the views, and what it returns goes back to the caller's kind: the
caller's own object where the result landed in it (in place, same data pointer), a new
object of the input's kind otherwise. Immutable inputs (JAX arrays, read-only buffers) are
reduced out of place: a result array is made for them, returned as their kind.
NumPy and CuPy arguments pass straight through. torch and JAX are imported only when such
an argument comes.
"""
from __future__ import annotations

import functools
import inspect

import ml_dtypes
import numpy as np

from mpidist.collectives.handle import Handle
from mpidist.kernels.backend import cupy, is_cupy

__all__ = ["accept_arrays", "as_array", "like"]


def _native(x) -> bool:
    return x is None or isinstance(x, np.ndarray) or is_cupy(x)


def _module(x) -> str:
    return type(x).__module__.split(".")[0]


def as_array(x):
    """A NumPy or CuPy array sharing x's memory; TypeError if x offers no array protocol."""
    if _native(x):
        return x
    kind = _module(x)
    if kind == "torch":
        import torch                   # optional: only for torch arguments
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"a torch {type(x).__name__} is not an array")
        x = x.detach()
        if x.is_cuda:
            with torch.cuda.device(x.device):
                torch.cuda.current_stream().synchronize()   # torch's queued work first
            return cupy().from_dlpack(x)
        if x.device.type != "cpu":
            raise TypeError(f"torch tensors on {x.device} are not supported; use CPU or "
                            f"CUDA tensors")
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    if hasattr(x, "__cuda_array_interface__"):
        return cupy().asarray(x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        if x.__dlpack_device__()[0] == 1:          # kDLCPU
            return np.from_dlpack(x)
        return cupy().from_dlpack(x)
    try:
        view = memoryview(x)
    except TypeError:
        raise TypeError(f"{type(x).__name__} is not an array: pass a NumPy or CuPy array, a "
                        f"torch tensor, or an object with DLPack, the buffer protocol or "
                        f"__cuda_array_interface__") from None
    return np.asarray(view)


def _immutable(obj, view) -> bool:
    """JAX arrays (whatever their view's flag says) and read-only buffers."""
    return _module(obj) in ("jax", "jaxlib") or not (is_cupy(view) or view.flags.writeable)


def _view(x):
    """as_array(x), or x itself when it is no array: the collective's own check then
    raises, on every rank together."""
    try:
        return as_array(x)
    except TypeError:
        return x


def like(result, original):
    """result (a NumPy/CuPy array) as an object of original's kind (no copy where the
    kinds share memory: torch; JAX copies, its arrays being immutable)."""
    if _native(original) or not (isinstance(result, np.ndarray) or is_cupy(result)):
        return result
    kind = _module(original)
    if kind == "torch":
        import torch                   # optional: only for torch arguments
        if is_cupy(result):
            return torch.from_dlpack(result)
        t = as_torch(result)
        return t
    if kind in ("jax", "jaxlib"):
        import jax.numpy as jnp        # optional: only for JAX arguments
        return jnp.asarray(result)
    return result


def as_torch(a):
    """A CPU torch tensor over NumPy array a (bfloat16 included)."""
    import torch                       # optional: only for torch arguments
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def accept_arrays(*names, out: str | None = "out", in_place: bool = False):
    """Decorator: the arguments `names` may be any array (see the module docstring).

    out: the name of the result argument. in_place: the collective writes its first
    argument when out is None; an immutable one then gets a fresh array as out (out of
    place). Lists and tuples of arrays are converted element-wise.
    """
    def deco(fn):
        params = list(inspect.signature(fn).parameters)
        where = {n: params.index(n) for n in names}
        places = tuple(where.items())

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for n, i in places:                 # NumPy arrays and None: straight through
                v = kwargs.get(n) if n in kwargs else (args[i] if i < len(args) else None)
                if v is not None and type(v) is not np.ndarray:
                    break
            else:
                return fn(*args, **kwargs)
            got = {n: kwargs[n] if n in kwargs else (args[i] if i < len(args) else None)
                   for n, i in where.items()}
            if all(_native(v) if not isinstance(v, (list, tuple)) else all(map(_native, v))
                   for v in got.values()):
                return fn(*args, **kwargs)                  # NumPy / CuPy: straight through
            views = {n: [_view(e) for e in v] if isinstance(v, (list, tuple))
                     else (None if v is None else _view(v)) for n, v in got.items()}
            if out in views and got[out] is not None and got[out] is got[names[0]]:
                views[out] = views[names[0]]            # out=buf: in place
            args = list(args)
            for n, v in views.items():
                if where[n] < len(args):
                    args[where[n]] = v
                elif got[n] is not None or n in kwargs:
                    kwargs[n] = v
            first = names[0]
            src = views[first]
            made = None
            if in_place and out in where and got.get(out) is None and \
                    (isinstance(src, np.ndarray) or is_cupy(src)) and _immutable(got[first], src):
                made = np.empty_like(src)       # immutable input: reduce out of place
                kwargs[out] = made
            pairs = []                          # (view, caller's object) to map back
            for n, v in views.items():
                if isinstance(v, list):
                    pairs += list(zip(v, got[n]))
                elif v is not None:
                    pairs.append((v, got[n]))

            def back(result):
                if isinstance(result, list):
                    return [back(r) for r in result]
                for view, obj in pairs:
                    if result is view:
                        return obj
                return like(result, got[first] if not isinstance(got[first], (list, tuple))
                            else got[first][0])
            result = fn(*args, **kwargs)
            if isinstance(result, Handle):          # wait() gives the caller's objects back
                return result.then(back)
            return back(result)
        return wrapper
    return deco
