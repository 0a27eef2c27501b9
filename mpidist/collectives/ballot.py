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
Python-level step counts; across nodes, carrying the data saves the check's own round trip.
The entry points are looked up through mpi4py's own module (the library mpi4py calls, shim or
not), and every MPI handle is passed at the width mpi4py gives its type (MPI._sizeof: a
pointer in Open MPI, a 32-bit int in MPICH). Where that can not be done on some rank (or
MPIDIST_BALLOT=plain), every rank of the communicator takes the plain form together, agreed
when the ballot is made: the two words [d, -d] reduced by MPI_MAX through mpi4py, carrying
nothing.

A check that a thread posts now and completes later (guard.post) votes by Vote instead: the
same two words under MAX, by recursive doubling over point-to-point messages, the first
round sent at once: between two ranks one exchange. Open MPI's MPI_Iallreduce of a few words
is a binomial reduce and then a broadcast, two messages one after the other, each sent only
when its sender's progress finds the one before; with a waiter that naps between its
progress calls, that costs milliseconds.
"""
from __future__ import annotations

import ctypes
import os
import warnings

import numba
import numpy as np
from llvmlite import ir
from mpi4py import MPI
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from mpidist.collectives import waits
from mpidist.collectives.recursive_doubling import fold, real_rank

__all__ = ["CARRY", "SMALL", "LINGER", "Ballot", "Vote", "of", "compile_kernels"]

CARRY = 1024                    # a large record's payload bytes: allreduces up to this ride whole
SMALL = 216                     # a small record's payload bytes (the whole record: 256 bytes)
LINGER = 64                     # checks a record stays large after a call that needs one
_HEADER = 5                     # int64 words: d, -d, meta, flag, want (a large record next)
_RECORD = 8 * _HEADER + CARRY
# meta = n << 8 | dtype << 4 | op, the payload's description (op 0: no payload)
_DTYPES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2,
           np.dtype(np.int32): 3, np.dtype(np.int64): 4}
_OPS = {"sum": 1, "avg": 1, "min": 2, "max": 3, "prod": 4}
_WORDS = 3 * 8                  # Ballot.state's first bytes: MPI_Allreduce, MPI_IN_PLACE, linger
# Ballot.handles, MPI handles at mpi4py's width: the next record's datatype, op, comm,
# the small and the large record's datatype
_NEXT, _OP, _COMM, _SMALL_TYPE, _LARGE_TYPE = range(5)
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
    """MPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm) through its C address fn:
    the buffers as pointers, count as a C int, and the handles at the integer width of the
    array they come from (Ballot.handles), which is the width of MPI's handle types."""
    sig = types.int32(types.intp, types.intp, types.intp, types.int32, datatype, op, comm)

    def codegen(context, builder, signature, args):
        void_p = ir.IntType(8).as_pointer()
        handles = [context.get_value_type(t) for t in signature.args[4:]]
        fnty = ir.FunctionType(ir.IntType(32), [void_p, void_p, ir.IntType(32), *handles])
        target = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(target, [builder.inttoptr(args[1], void_p),
                                     builder.inttoptr(args[2], void_p), *args[3:]])
    return sig, codegen


@njit(cache=True, nogil=True)
def _cast(ballot, handles, x, y, digest, meta):
    """Vote digest through ballot (Ballot.state, Ballot.handles) with x as payload where it fits the record
    (meta describes x, meta() made it); on agreement copy the reduced payload into y.
    Returns the elements carried (all of x or none) when the ranks agreed, -1 when they
    differ, or -1 - MPI's error code. Without the GIL, as mpi4py calls MPI: the watchdog
    thread must run while a rank waits here for one that never comes.

    The record's size for the next check is agreed by this one: its `want` word, reduced
    by MAX, is set while a call that needs a large record (it fits that and not a small
    one) is at most LINGER checks back on some rank. So every rank sends the same size,
    a stream of small calls (or of checks that carry nothing) sends small records, and a
    call that finds a small record too small rides in none."""
    words = ballot[:_WORDS].view(np.int64)
    record = ballot[_WORDS:]
    header = record[:8 * _HEADER].view(np.int64)
    body = record[8 * _HEADER:]
    k = meta >> 8
    nbytes = k * x.itemsize
    if nbytes > SMALL:
        words[2] = LINGER
    elif words[2] > 0:
        words[2] -= 1
    if nbytes > (CARRY if handles[_NEXT] == handles[_LARGE_TYPE] else SMALL):
        k, nbytes = 0, 0
    xb = x.view(np.uint8)
    for i in range(nbytes):
        body[i] = xb[i]
    header[0] = digest
    header[1] = -digest
    header[2] = k << 8 | (meta & 255)
    header[3] = 0
    header[4] = 1 if words[2] > 0 else 0
    rc = _call_allreduce(words[0], words[1], record.ctypes.data, np.int32(1), handles[_NEXT],
                         handles[_OP], handles[_COMM])
    if rc != 0:
        return -1 - rc
    handles[_NEXT] = handles[_LARGE_TYPE] if header[4] != 0 else handles[_SMALL_TYPE]
    if header[0] != -header[1] or header[3] != 0:
        return -1
    yb = y.view(np.uint8)
    for i in range(nbytes):
        yb[i] = body[i]
    return k


@njit(cache=True, nogil=True)
def _vote(ballot, handles, digest):
    """_cast with no payload (two array arguments fewer to pass from Python)."""
    return _cast(ballot, handles, ballot[:0], ballot[:0], digest, 0)


# -- reaching the MPI library ----------------------------------------------------------------

def _handle_dtype():
    """The unsigned integer type of MPI's handles as mpi4py passes them (all of one width)."""
    widths = {MPI._sizeof(t) for t in (MPI.Comm, MPI.Op, MPI.Datatype)}
    if len(widths) != 1 or widths.pop() not in (4, 8):
        raise RuntimeError("MPI's handle types are not all 4 or all 8 bytes")
    return np.dtype(f"u{MPI._sizeof(MPI.Comm)}")


def _word(obj, hdtype) -> int:
    """obj's MPI handle as the unsigned word of hdtype's width (mpi4py hands a 32-bit
    handle back sign-extended: MPICH's 0x98000000 comes as 0xffffffff98000000)."""
    return MPI._handleof(obj) & ((1 << 8 * hdtype.itemsize) - 1)


def compile_kernels():
    """Compile (or load from Numba's cache) the MPI callback, _vote and _cast for every
    payload dtype at this MPI's handle width, so that no call on the flight record waits for
    a compiler; returns the callback. scripts/test.sh runs it once ahead of the tests."""
    combine = cfunc(_USER_FUNCTION, cache=True)(_combine)
    state = types.Array(types.uint8, 1, "C")
    handles = types.Array(numba.from_dtype(_handle_dtype()), 1, "C")
    _vote.compile((state, handles, types.int64))
    for dtype in _DTYPES:
        data = types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C")
        _cast.compile((state, handles, data, data, types.int64, types.int64))
    return combine


def _make_op():
    """(MPI_Allreduce's address, MPI.Op of _combine, the small and the large record's
    datatypes, the handle dtype), or the reason this process can not use the compiled form.
    MPI_Op_create and MPI_Allreduce are the ones mpi4py's module resolves (its library's)."""
    if os.environ.get("MPIDIST_BALLOT", "").strip().lower() == "plain":
        return "MPIDIST_BALLOT=plain"
    try:
        hdtype = _handle_dtype()
        lib = ctypes.CDLL(MPI.__file__)
        create, allreduce = lib.MPI_Op_create, lib.MPI_Allreduce
        ctype = ctypes.c_uint32 if hdtype.itemsize == 4 else ctypes.c_uint64
        handle = ctype()
        create.restype = ctypes.c_int
        create.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctype)]
        callback = compile_kernels()
        if create(ctypes.c_void_p(callback.address), 1, ctypes.byref(handle)) != 0:
            return "MPI_Op_create failed"
        op = MPI.Op.fromhandle(handle.value)
        if _word(op, hdtype) != handle.value:
            return "mpi4py reads the op's handle back as another value"
    except Exception as exc:          # no compiler, no symbol, an MPI without the C entry point
        return f"{type(exc).__name__}: {exc}"
    address = ctypes.cast(allreduce, ctypes.c_void_p).value
    return (address, op, MPI.BYTE.Create_contiguous(8 * _HEADER + SMALL).Commit(),
            MPI.BYTE.Create_contiguous(_RECORD).Commit(), hdtype)


_shared: dict = {}              # "made": _make_op()'s result, made on first use


class Ballot:
    """One communicator's ballot (a communicator's collectives come from one thread at a
    time, as MPI requires). state: MPI_Allreduce's address, MPI_IN_PLACE, the checks left
    before a large record is no longer wanted, then the record; handles: the MPI handles
    (_NEXT.._LARGE_TYPE) at MPI's width. A ballot starts with a large record.

    Made collectively (on the first checked call): the ranks agree on the form, compiled
    only where every rank can use it, so all of them send the same messages."""

    def __init__(self, comm):
        if "made" not in _shared:
            _shared["made"] = _make_op()
        made = _shared["made"]
        self.comm, self.size = comm.comm, comm.size
        self.plans: dict = {}   # the guard's: call signature -> (digest, meta of host data)
        can = np.array([0 if isinstance(made, str) else 1], np.int64)
        both = np.array([can[0], -can[0]], np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, both, MPI.MAX)   # [any can, -(all can)]
        if both[1] != -1:                        # the plain form: two words, MPI_MAX
            if both[0] == 1 and self.comm.Get_rank() == 0 and not _shared.get("warned"):
                _shared["warned"] = True
                why = made if isinstance(made, str) else "another rank's"
                warnings.warn("mpidist's guard: the compiled ballot is not usable on every rank "
                              f"(here: {why}), so every rank votes in the plain form",
                              RuntimeWarning, stacklevel=2)
            self.state, self.handles, self.capacity = None, None, 0
            self.votes = np.zeros(2, np.int64)
            return
        address, op, small, large, hdtype = made
        self.state, self.capacity = np.zeros(_WORDS + _RECORD, np.uint8), CARRY
        self.state[:_WORDS].view(np.int64)[:] = (address, int(MPI.IN_PLACE), 0)
        self.handles = np.array([_word(h, hdtype) for h in (large, op, self.comm, small, large)],
                                hdtype)

    def vote(self, digest: int) -> bool:
        """Collective: True when every rank voted the same digest."""
        if self.state is None:
            v = self.votes
            v[0], v[1] = digest, -digest
            self.comm.Allreduce(MPI.IN_PLACE, v, MPI.MAX)
            return v[0] == -v[1]
        rc = _vote(self.state, self.handles, digest)
        if rc < -1:
            raise MPI.Exception(-1 - rc)
        return rc == 0

    def meta(self, x, y, op):
        """allreduce(x) -> y by op described for vote_reduce (x's size, dtype and op), or
        None when x can not ride in the ballot: above CARRY bytes, not host NumPy data of a
        supported dtype, or the plain form."""
        code = _DTYPES.get(x.dtype)
        if self.state is None or code is None or x.nbytes > self.capacity or type(x) is not np.ndarray \
                or type(y) is not np.ndarray:
            return None
        return x.size << 8 | code << 4 | _OPS[op.name]

    def vote_reduce(self, digest: int, x, y, op, meta: int) -> int:
        """vote(), also reducing x into y by op where it fits the record (meta from
        meta()): returns the elements reduced (x.size or 0: then the caller reduces them),
        or -1 when the ranks differ (y untouched)."""
        k = _cast(self.state, self.handles, x, y, digest, meta)
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


# -- the nonblocking vote ---------------------------------------------------------------------

_VOTE_TAG = 0x6776              # the votes' messages, apart from every algorithm's tags


class Vote:
    """A vote of digest d on the mpi4py communicator mpi, begun at construction: the MAX of
    [d, -d] over the ranks by recursive doubling (recursive_doubling.fold pairs the ranks
    beyond a power of two), what needs nothing received first sent at once (between two
    ranks, all of it). wait() completes it (with naps on a patient thread) and returns
    whether every rank voted d. Collective: every rank makes its votes on mpi in the same
    order, from one thread, and waits for them in that order."""

    def __init__(self, mpi, d: int):
        self.mpi, self.rank = mpi, mpi.Get_rank()
        self.p2, self.rem, self.me = fold(self.rank, mpi.Get_size())
        self.value = np.array([d, -d], np.int64)
        self.got = np.empty(2, np.int64)
        self.sent: list = []            # (request, the buffer it sends)
        self.mask = 1
        if self.rank >= 2 * self.rem:
            self.pending = self._round()
        elif self.me < 0:               # an extra rank: its vote to its partner, who sends
            self._send(self.rank + 1)   # the result back
            self.pending = mpi.Irecv(self.value, self.rank + 1, _VOTE_TAG)
        else:                           # the partner of one: its vote first
            self.pending = mpi.Irecv(self.got, self.rank - 1, _VOTE_TAG)

    def _send(self, dest: int) -> None:
        buf = self.value.copy()         # value changes while the message may be in flight
        self.sent.append((self.mpi.Isend(buf, dest, _VOTE_TAG), buf))

    def _round(self):
        """Post the exchange of round `mask` and return its receive; None after the last
        (then the extra rank, if any, gets the result)."""
        if self.mask >= self.p2:
            if self.rank < 2 * self.rem:
                self._send(self.rank - 1)
            return None
        partner = real_rank(self.me ^ self.mask, self.rem)
        self._send(partner)
        return self.mpi.Irecv(self.got, partner, _VOTE_TAG)

    def wait(self) -> bool:
        if self.me < 0:
            waits.waitall([self.pending])
        else:
            if self.rank < 2 * self.rem:        # the extra rank's vote, then the rounds
                waits.waitall([self.pending])
                np.maximum(self.value, self.got, out=self.value)
                self.pending = self._round()
            while self.pending is not None:
                waits.waitall([self.pending])
                np.maximum(self.value, self.got, out=self.value)
                self.mask <<= 1
                self.pending = self._round()
        waits.waitall([request for request, _ in self.sent])
        return bool(self.value[0] == -self.value[1])
