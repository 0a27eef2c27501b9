"""The guard's ballot: one MPI_Allreduce record that carries a call's signature digest and,
for a small host allreduce, the data itself.

A check of its own costs a message round trip per collective, about what a small
MPI_Allreduce costs. So the record is [d, -d, meta, flag, want | payload], reduced by one
user-defined MPI op (a Numba C callback): the header by MAX, and the payload by the call's
op when both sides' headers agree. A native allreduce that fits the payload and its check
are a single message; a larger one is checked by the ballot and sent apart.
After the reduction max(d) == -max(-d) and flag == 0 exactly when every rank voted the same
digest and metadata (n, dtype, op): the guard's agreement test.

Every rank sends a record of the same size, carried data or not, so ranks that disagree on
whether or what they carry still exchange matching MPI messages and learn that they differ.
The size is small (256 bytes) or large (CARRY bytes of payload), and each check agrees on
the next one's through its `want` word: large while a call that needs it is recent on any
rank (_cast). Filling the record, MPI_Allreduce and the check run in one compiled function
that calls the MPI library's C entry point, since at a few microseconds per call each
Python-level step counts. Where ctypes cannot reach the MPI library's functions
(MPI_Op_create, MPI_Allreduce), the ballot is the two words [d, -d] reduced by MPI_MAX
through mpi4py and carries nothing; every process of one job loads the same library, so
all ranks use the same form.
"""
from __future__ import annotations

import ctypes
import os

import numba
import numpy as np
from llvmlite import ir
from mpi4py import MPI
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

__all__ = ["CARRY", "SMALL", "LINGER", "Ballot", "of", "compile_kernels"]

CARRY = 1024                    # a large record's payload bytes: allreduces up to this ride whole
SMALL = 216                     # a small record's payload bytes (the whole record: 256 bytes)
LINGER = 64                     # checks a record stays large after a call that needs one
_HEADER = 5                     # int64 words: d, -d, meta, flag, want (a large record next)
_RECORD = 8 * _HEADER + CARRY
# meta = n << 8 | dtype << 4 | op, the payload's description (op 0: no payload)
_DTYPES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2,
           np.dtype(np.int32): 3, np.dtype(np.int64): 4}
_OPS = {"sum": 1, "avg": 1, "min": 2, "max": 3, "prod": 4}
_HANDLES = 8 * 8                # Ballot.state's first bytes: the words _cast works with
# MPI_User_function: void (void *invec, void *inoutvec, int *len, MPI_Datatype *datatype)
_USER_FUNCTION = types.void(types.voidptr, types.voidptr, types.CPointer(types.int32),
                            types.voidptr)


# -- the MPI op: header by MAX, payload by the call's op --------------------------------------

@njit(cache=True)
def _reduce(x, y, start, n, op):
    """y[start:start+n] = y OP x, as MPI's predefined ops do (inout = inout OP in)."""
    for i in range(start, start + n):
        if op == 1:
            y[i] += x[i]
        elif op == 2:
            if not y[i] < x[i]:
                y[i] = x[i]
        elif op == 3:
            if not y[i] > x[i]:
                y[i] = x[i]
        else:
            y[i] *= x[i]


def _combine(invec, inoutvec, count, datatype):
    """The MPI user function over one record (a ballot is always sent as count 1); compiled
    as a C callback by _make_op, on first use rather than at import."""
    a = carray(invec, (_HEADER,), np.int64)
    b = carray(inoutvec, (_HEADER,), np.int64)
    agree = a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[3] == 0 and b[3] == 0
    for i in (0, 1, 4):
        if a[i] > b[i]:
            b[i] = a[i]
    if not agree:
        b[3] = 1
        return
    meta = b[2]
    op, dtype, n = meta & 15, (meta >> 4) & 15, meta >> 8
    if op == 0:
        return
    if dtype == 1:
        _reduce(carray(invec, (_RECORD // 4,), np.float32),
                carray(inoutvec, (_RECORD // 4,), np.float32), 8 * _HEADER // 4, n, op)
    elif dtype == 2:
        _reduce(carray(invec, (_RECORD // 8,), np.float64),
                carray(inoutvec, (_RECORD // 8,), np.float64), _HEADER, n, op)
    elif dtype == 3:
        _reduce(carray(invec, (_RECORD // 4,), np.int32),
                carray(inoutvec, (_RECORD // 4,), np.int32), 8 * _HEADER // 4, n, op)
    else:
        _reduce(carray(invec, (_RECORD // 8,), np.int64),
                carray(inoutvec, (_RECORD // 8,), np.int64), _HEADER, n, op)


# -- one compiled call: fill the record, MPI_Allreduce, check, copy the result out -----------

@intrinsic
def _call_allreduce(typingctx, fn, sendbuf, recvbuf, count, datatype, op, comm):
    """MPI_Allreduce through its C address fn; every argument a machine word (MPI handles
    are pointers or ints, passed in a register either way)."""
    sig = types.int32(types.intp, types.intp, types.intp, types.int32, types.intp,
                      types.intp, types.intp)

    def codegen(context, builder, signature, args):
        word = ir.IntType(64)
        fnty = ir.FunctionType(ir.IntType(32), [word, word, ir.IntType(32), word, word, word])
        target = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(target, args[1:])
    return sig, codegen


@njit(cache=True, nogil=True)
def _cast(ballot, x, y, digest, meta):
    """Vote digest through ballot (Ballot.state) with x as payload where it fits the record
    (meta describes x, meta() made it); on agreement copy the reduced payload into y.
    Returns the elements carried (all of x or none) when the ranks agreed, -1 when they
    differ, or -1 - MPI's error code. Without the GIL, as mpi4py calls MPI: the watchdog
    thread must run while a rank waits here for one that never comes.

    The record's size for the next check is agreed by this one: its `want` word, reduced
    by MAX, is set while a call that needs a large record (it fits that and not a small
    one) is at most LINGER checks back on some rank. So every rank sends the same size,
    a stream of small calls (or of checks that carry nothing) sends small records, and a
    call that finds a small record too small rides in none."""
    handles = ballot[:_HANDLES].view(np.int64)
    record = ballot[_HANDLES:]
    header = record[:8 * _HEADER].view(np.int64)
    body = record[8 * _HEADER:]
    k = meta >> 8
    nbytes = k * x.itemsize
    if nbytes > SMALL:
        handles[7] = LINGER
    elif handles[7] > 0:
        handles[7] -= 1
    if nbytes > (CARRY if handles[2] == handles[6] else SMALL):
        k, nbytes = 0, 0
    xb = x.view(np.uint8)
    for i in range(nbytes):
        body[i] = xb[i]
    header[0] = digest
    header[1] = -digest
    header[2] = k << 8 | (meta & 255)
    header[3] = 0
    header[4] = 1 if handles[7] > 0 else 0
    rc = _call_allreduce(handles[0], handles[1], record.ctypes.data, np.int32(1), handles[2],
                         handles[3], handles[4])
    if rc != 0:
        return -1 - rc
    handles[2] = handles[6] if header[4] != 0 else handles[5]
    if header[0] != -header[1] or header[3] != 0:
        return -1
    yb = y.view(np.uint8)
    for i in range(nbytes):
        yb[i] = body[i]
    return k


@njit(cache=True, nogil=True)
def _vote(ballot, digest):
    """_cast with no payload (one array argument fewer to pass from Python)."""
    return _cast(ballot, ballot[:0], ballot[:0], digest, 0)


# -- reaching the MPI library ----------------------------------------------------------------

def _libmpi_function(name: str):
    """The MPI library's C function `name`, as ctypes finds it in this process, or None."""
    candidates = [None]
    try:
        with open("/proc/self/maps") as maps:
            candidates += sorted({line.split()[-1] for line in maps
                                  if os.path.basename(line.split()[-1]).startswith("libmpi")})
    except OSError:
        pass
    for path in candidates:
        try:
            fn = getattr(ctypes.CDLL(path), name, None)
        except OSError:
            continue
        if fn is not None:
            return fn
    return None


def compile_kernels():
    """Compile (or load from Numba's cache) the MPI callback, _vote and _cast for every
    payload dtype, so that no call on the flight record waits for a compiler; returns the callback.
    scripts/test.sh runs it once ahead of the tests."""
    combine = cfunc(_USER_FUNCTION, cache=True)(_combine)
    state = types.Array(types.uint8, 1, "C")
    _vote.compile((state, types.int64))
    for dtype in _DTYPES:
        data = types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C")
        _cast.compile((state, data, data, types.int64, types.int64))
    return combine


def _make_op():
    """(MPI_Allreduce's address, MPI.Op of _combine, the small and the large record's
    datatypes), or None where the MPI library's functions are out of ctypes' reach (or
    MPIDIST_BALLOT=plain)."""
    create, allreduce = _libmpi_function("MPI_Op_create"), _libmpi_function("MPI_Allreduce")
    if create is None or allreduce is None or os.environ.get("MPIDIST_BALLOT") == "plain":
        return None
    handle_type = ctypes.c_void_p if MPI._sizeof(MPI.Op) == ctypes.sizeof(ctypes.c_void_p) \
        else ctypes.c_int
    handle = handle_type()
    create.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(handle_type)]
    if create(ctypes.c_void_p(compile_kernels().address), 1, ctypes.byref(handle)) != 0:
        return None
    address = ctypes.cast(allreduce, ctypes.c_void_p).value
    return (address, MPI.Op.fromhandle(handle.value),
            MPI.BYTE.Create_contiguous(8 * _HEADER + SMALL).Commit(),
            MPI.BYTE.Create_contiguous(_RECORD).Commit())


_shared: dict = {}              # "made": _make_op()'s result, made on first use


class Ballot:
    """One communicator's ballot (a communicator's collectives come from one thread at a
    time, as MPI requires). state: the words _cast works with (MPI_Allreduce's address,
    MPI_IN_PLACE, the next record's datatype, the op, the communicator, the small and the
    large record's datatypes, checks left before a large record is no longer wanted), then
    the record. A ballot starts with a large record."""

    def __init__(self, comm):
        if "made" not in _shared:
            _shared["made"] = _make_op()
        made = _shared["made"]
        self.comm, self.size = comm.comm, comm.size
        self.plans: dict = {}   # the guard's: call signature -> (digest, meta of host data)
        if made is None:                         # the plain form: two words, MPI_MAX
            self.state, self.capacity = None, 0
            self.votes = np.zeros(2, np.int64)
            return
        address, op, small, large = made
        self.state, self.capacity = np.zeros(_HANDLES + _RECORD, np.uint8), CARRY
        self.state[:_HANDLES].view(np.int64)[:] = (
            address, int(MPI.IN_PLACE), MPI._handleof(large), MPI._handleof(op),
            MPI._handleof(self.comm), MPI._handleof(small), MPI._handleof(large), 0)

    def vote(self, digest: int) -> bool:
        """Collective: True when every rank voted the same digest."""
        if self.state is None:
            v = self.votes
            v[0], v[1] = digest, -digest
            self.comm.Allreduce(MPI.IN_PLACE, v, MPI.MAX)
            return v[0] == -v[1]
        rc = _vote(self.state, digest)
        if rc < -1:
            raise MPI.Exception(-1 - rc)
        return rc == 0

    def meta(self, x, y, op):
        """allreduce(x) -> y by op described for vote_reduce (x's size, dtype and op), or
        None when x can not ride in the ballot: above CARRY bytes, not host NumPy data of a
        supported dtype, or the plain form."""
        code = _DTYPES.get(x.dtype)
        if code is None or x.nbytes > self.capacity or type(x) is not np.ndarray \
                or type(y) is not np.ndarray:
            return None
        return x.size << 8 | code << 4 | _OPS[op.name]

    def vote_reduce(self, digest: int, x, y, op, meta: int) -> int:
        """vote(), also reducing x into y by op where it fits the record (meta from
        meta()): returns the elements reduced (x.size or 0: then the caller reduces them),
        or -1 when the ranks differ (y untouched)."""
        k = _cast(self.state, x, y, digest, meta)
        if k < 0:
            if k < -1:
                raise MPI.Exception(-1 - k)
            return -1
        if op.average and k:
            op.finalize(y[:k], self.size)
        return k


def of(comm) -> Ballot:
    """comm's ballot (made on first use)."""
    b = comm.ballot
    if b is None:
        b = comm.ballot = Ballot(comm)
    return b
