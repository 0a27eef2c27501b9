"""The flight recorder and its watchdog: what every rank was doing when a job stopped moving.

Per communicator, the last RECORDS collective calls (sequence number, signature, start and
end time) are kept in memory; the mismatch guard enters every call it checks. A watchdog
thread looks, about once a second, for a call still running after `timeout` seconds (env
MPIDIST_TIMEOUT, default 600; `[job] timeout`; 0 switches it off). Then, as NCCL's watchdog
and flight recorder do for GPU jobs:
  1. the rank writes its records to the flight directory and leaves a request there, which
     the watchdog of every other rank of the job answers with its own records;
  2. the first rank to see the hang waits a few seconds for them, finds the first call where
     the ranks differ and prints it ("ranks 0-2 are in allreduce #5 (n=1000 ...); rank 3 is
     in no collective, its last was ... #4"), also into diagnosis.txt;
  3. the job ends with MPI_Abort(EXIT_HANG) instead of hanging.
The directory: env MPIDIST_FLIGHT_DIR, else the job's run directory (set_directory), else a
per-job folder in the temporary directory (node-local: on several nodes, point it at shared
storage to see every rank in one place).
"""
from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import threading
import time
import weakref

from mpi4py import MPI

from mpidist.errors import abort_job, format_ranks

__all__ = ["begin", "end", "records", "describe", "set_timeout", "get_timeout", "set_directory",
           "directory", "diagnose", "EXIT_HANG"]

EXIT_HANG = 3                   # the exit code of a job the watchdog ended
RECORDS = max(1, int(os.environ.get("MPIDIST_FLIGHT_RECORDS", "64")))
GRACE = 4.0                     # seconds the reporter waits for the other ranks' records
_SEQ, _SIG, _START, _END = range(4)     # an entry: [seq, signature, t_start, t_end or None]

_state = {"timeout": None, "dir": None, "watchdog": None}
_records: "weakref.WeakSet" = weakref.WeakSet()     # every live communicator's record
_lock = threading.Lock()


class _Record:
    """One communicator's calls. `key` names the communicator alike on all its ranks: its
    members as world ranks and how many communicators of those members came before it."""

    def __init__(self, comm):
        world = MPI.COMM_WORLD.Get_group()
        group = comm.comm.Get_group()
        self.members = [int(r) for r in MPI.Group.Translate_ranks(group, list(range(comm.size)), world)]
        group.Free()
        world.Free()
        ordinal = sum(r.members == self.members for r in list(_records))
        self.key = format_ranks(self.members) + (f" (#{ordinal + 1})" if ordinal else "")
        self.calls: collections.deque = collections.deque(maxlen=RECORDS)
        self.seq = 0


def describe(signature) -> str:
    """('allreduce', ('n', 5), ('op', 'sum')) -> 'allreduce(n=5, op=sum)'."""
    if signature is None:
        return "(an argument error)"
    kind, *fields = signature
    return f"{kind}({', '.join(f'{k}={v}' for k, v in fields)})"


def begin(comm, signature) -> list:
    """Enter a call on comm (a Communicator); returns its entry for end()."""
    rec = comm.flight_record
    if rec is None:
        with _lock:
            rec = comm.flight_record = _Record(comm)
            _records.add(rec)
        _start_watchdog()
    rec.seq += 1
    entry = [rec.seq, signature, time.time(), None]
    rec.calls.append(entry)
    return entry


def end(entry) -> None:
    """Mark a call complete (None: nothing was entered, e.g. with the guard off)."""
    if entry is not None and entry[_END] is None:
        entry[_END] = time.time()


def records(comm) -> list[dict]:
    """comm's recorded calls, oldest first: seq, call (described), start, end (None: running)."""
    rec = comm.flight_record
    return [] if rec is None else [
        {"seq": e[_SEQ], "call": describe(e[_SIG]), "start": e[_START], "end": e[_END]}
        for e in list(rec.calls)]


def set_timeout(seconds: float) -> None:
    """Seconds a collective may run before the watchdog ends the job (0: never)."""
    seconds = float(seconds)
    if not seconds >= 0:
        raise ValueError(f"timeout must be >= 0 seconds, got {seconds}")
    _state["timeout"] = seconds


def get_timeout() -> float:
    if _state["timeout"] is None:
        raw = os.environ.get("MPIDIST_TIMEOUT", "600").strip() or "600"
        try:
            set_timeout(raw)
        except ValueError:
            raise ValueError(f"MPIDIST_TIMEOUT must be a number of seconds >= 0, got {raw!r}") from None
    return _state["timeout"]


def _job_key() -> str:
    """A name of this job that all its ranks share, from the launcher's environment."""
    for var in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID", "SLURM_JOB_ID"):
        if os.environ.get(var):
            step = os.environ.get("SLURM_STEP_ID", "") if var == "SLURM_JOB_ID" else ""
            return "".join(c if c.isalnum() else "-" for c in os.environ[var] + step)
    return f"pid{os.getpid()}"


def set_directory(path: str | None) -> None:
    """Where records go (a job's run directory); env MPIDIST_FLIGHT_DIR takes precedence."""
    _state["dir"] = path


def directory() -> str:
    return (os.environ.get("MPIDIST_FLIGHT_DIR") or _state["dir"]
            or os.path.join(tempfile.gettempdir(), f"mpidist-flight-{_job_key()}"))


# -- the watchdog ----------------------------------------------------------------------------

def _start_watchdog() -> None:
    with _lock:
        if _state["watchdog"] is not None or get_timeout() == 0:
            return
        me = MPI.COMM_WORLD.Get_rank()
        t = threading.Thread(target=_watch, args=(me,), name="mpidist-watchdog", daemon=True)
        _state["watchdog"] = t
    t.start()


def _watch(me: int) -> None:
    job = _job_key()
    answered = False
    while True:
        timeout = get_timeout()
        time.sleep(min(1.0, timeout / 4) if timeout else 1.0)
        if not timeout:
            continue
        stuck = _oldest_open(time.time() - timeout)
        if stuck is not None:
            _fire(me, job, stuck, timeout)
            return
        if not answered and _requested(job):
            _dump(me, job, None)
            answered = True


def _oldest_open(before: float):
    """(communicator key, entry) of the oldest call started before `before` and still open."""
    found = None
    for rec in list(_records):
        for e in list(rec.calls):
            if e[_END] is None and e[_START] < before and (found is None or e[_START] < found[1][_START]):
                found = (rec.key, e)
    return found


def _request_path() -> str:
    return os.path.join(directory(), "flight-request")


def _requested(job: str) -> bool:
    try:
        with open(_request_path()) as fh:
            return fh.read().strip() == job
    except OSError:
        return False


def _dump(me: int, job: str, stuck) -> None:
    """Write this rank's records (and the call it is stuck in, if any) for the reporter."""
    comms = [{"key": rec.key, "members": rec.members,
              "calls": [[e[_SEQ], describe(e[_SIG]), e[_START], e[_END]] for e in list(rec.calls)]}
             for rec in list(_records)]
    data = {"job": job, "rank": me, "host": os.uname().nodename, "pid": os.getpid(),
            "time": time.time(), "stuck": None if stuck is None else [stuck[0], stuck[1][_SEQ]],
            "comms": comms}
    os.makedirs(directory(), exist_ok=True)
    path = os.path.join(directory(), f"flight-rank{me}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(data, fh)
    os.replace(path + ".tmp", path)


def _fire(me: int, job: str, stuck, timeout: float) -> None:
    key, entry = stuck
    folder = directory()
    try:
        _dump(me, job, stuck)
        reporter = _claim_request(job)
    except OSError as exc:
        print(f"mpidist watchdog: rank {me}: cannot write flight records to {folder}: {exc}",
              file=sys.stderr, flush=True)
        reporter = True
    print(f"mpidist watchdog: rank {me}: {describe(entry[_SIG])} #{entry[_SEQ]} on ranks {key} "
          f"has not finished after {timeout:g} s (MPIDIST_TIMEOUT); flight records in {folder}",
          file=sys.stderr, flush=True)
    if reporter:
        time.sleep(GRACE)
        text = diagnose(_load(folder, job), key)
        print(text, file=sys.stderr, flush=True)
        try:
            with open(os.path.join(folder, "diagnosis.txt"), "w") as fh:
                fh.write(text + "\n")
        except OSError:
            pass
    else:
        time.sleep(GRACE + 5)          # the reporter ends the job; if it cannot, we do
    abort_job(MPI.COMM_WORLD, EXIT_HANG)


def _claim_request(job: str) -> bool:
    """Leave the request for the others' records; True for the rank that left it first."""
    try:
        fd = os.open(_request_path(), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        if _requested(job):
            return False
        fd = os.open(_request_path(), os.O_WRONLY | os.O_TRUNC)     # a stale one: another job's
    with os.fdopen(fd, "w") as fh:
        fh.write(job)
    return True


def _load(folder: str, job: str) -> list[dict]:
    dumps = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("flight-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as fh:
                    d = json.load(fh)
            except (OSError, ValueError):
                continue
            if d.get("job") == job:
                dumps.append(d)
    return dumps


def diagnose(dumps: list[dict], key: str) -> str:
    """The reporter's message from every rank's records of communicator `key`: where each
    member is now, and the first call at which the members differ."""
    members: list[int] = []
    calls: dict[int, dict[int, str]] = {}           # world rank -> seq -> call
    now: dict[int, tuple] = {}                      # world rank -> (open call or None, last)
    for d in dumps:
        for c in d["comms"]:
            if c["key"] != key:
                continue
            members = c["members"]
            seqs = {s: call for s, call, _, _ in c["calls"]}
            calls[d["rank"]] = seqs
            running = [(s, call) for s, call, _, t_end in c["calls"] if t_end is None]
            last = max(seqs.items()) if seqs else None
            now[d["rank"]] = (running[0] if running else None, last)
    states: dict[str, list[int]] = {}
    for r in members:
        if r not in now:
            state = "left no record (not inside mpidist: finished, failed, or busy in its own code)"
        elif now[r][0] is not None:
            state = f"{{be}} in {now[r][0][1]} #{now[r][0][0]}"
        elif now[r][1] is not None:
            state = f"{{be}} in no collective; the last was {now[r][1][1]} #{now[r][1][0]}"
        else:
            state = "{be} in no collective yet"
        states.setdefault(state, []).append(r)
    where = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)} "
                      + s.format(be="are" if len(rs) > 1 else "is") for s, rs in states.items())
    lines = [f"mpidist watchdog: no progress on the communicator of ranks {key}: {where}."]
    if calls:
        first = max(min(seqs) for seqs in calls.values() if seqs) if any(calls.values()) else 1
        last = max((max(seqs) for seqs in calls.values() if seqs), default=0)
        for s in range(first, last + 1):
            at: dict[str, list[int]] = {}
            for r in members:
                at.setdefault(calls.get(r, {}).get(s, "(no call)") if r in calls else "(no record)",
                              []).append(r)
            if len(at) > 1:
                lines.append(f"The first call where ranks differ is #{s}: " + "; ".join(
                    f"ranks {format_ranks(rs)}: {call}" for call, rs in at.items()) + ".")
                break
    lines.append("Every rank must make the same collective calls in the same order (uneven "
                 "data, or a call made on some ranks only, e.g. in an evaluation or checkpoint "
                 "branch, is the usual cause).")
    return "\n".join(lines)
