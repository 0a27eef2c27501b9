"""The watcher beside one rank of a test session (started by tests/conftest.py):

    python tests/native_stacks.py PID STACKS_FILE WATCH_FILE OUT_FILE SIGNAL

WATCH_FILE holds one line, "STACKS_AT KILL_AT WHAT" (time.time() values), which the rank
replaces at each test. Past STACKS_AT the watcher sends SIGNAL, on which the rank's
faulthandler writes its Python stacks to STACKS_FILE; once they are there, it writes the
rank's native stacks to OUT_FILE: first the kernel's view of each thread (state, wait
channel, kernel stack where readable) and the host's load and pressure, taken before gdb
stops the rank, so a thread blocked in a system call shows on what; then gdb's, so a rank
waiting inside the MPI library shows in which call and which progress loop. Where gdb
cannot attach (ptrace forbidden), OUT_FILE says why. A later capture (the rank held up
again) goes beside it, in OUT_FILE's name with .1, .2. Past KILL_AT (a test stuck in a C
call, which the rank's own timeout can not reach) it says so on stderr and kills the rank,
which makes mpiexec end the job. Exits when the rank does.
"""
import os
import shutil
import signal
import subprocess
import sys
import time

POLL = 0.25             # seconds between looks at WATCH_FILE
STACKS_WITHIN = 10.0    # seconds to wait for the rank's Python stacks after the signal


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _kernel_view(pid: int) -> str:
    """Each thread's state, wait channel and kernel stack (/proc/PID/task/TID/stack needs
    root), and the host's load and memory pressure."""
    lines = []
    for name in ("loadavg", "pressure/cpu", "pressure/memory", "pressure/io"):
        try:
            with open(f"/proc/{name}") as f:
                lines.append(f"{name}: " + " | ".join(f.read().split("\n")).strip(" |"))
        except OSError:
            pass
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return "\n".join(lines) + "\n"
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        fields = {}
        for key in ("comm", "wchan", "stack"):
            try:
                with open(f"{base}/{key}") as f:
                    fields[key] = f.read().strip()
            except OSError as exc:
                fields[key] = f"({exc.strerror})"
        try:
            with open(f"{base}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"
        lines.append(f"task {tid} {fields['comm']} state {state} wchan {fields['wchan']}")
        lines.extend("    " + line for line in fields["stack"].splitlines())
    return "\n".join(lines) + "\n"


def _read_watch(path: str):
    """(stacks_at, kill_at, what) from WATCH_FILE, or None while it can not be read."""
    try:
        with open(path) as f:
            stacks_at, kill_at, what = f.read().rstrip("\n").split(" ", 2)
        return float(stacks_at), float(kill_at), what
    except (OSError, ValueError):
        return None


def _capture(pid: int, stacks: str, out: str, taken: int) -> None:
    """Once the rank's Python stacks are in STACKS_FILE: its native stacks into OUT_FILE
    (or beside it, for a later capture)."""
    deadline, text = time.monotonic() + STACKS_WITHIN, ""
    while time.monotonic() < deadline and "most recent call first" not in text:
        time.sleep(0.05)
        try:
            with open(stacks) as f:
                text = f.read()
        except OSError:
            pass
    kernel = _kernel_view(pid)
    if shutil.which("gdb"):
        try:
            run = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex",
                                  "thread apply all bt"], capture_output=True, text=True,
                                 timeout=120)
            report = run.stdout + run.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            report = f"gdb did not run: {exc}\n"
    else:
        report = "gdb did not run: not installed\n"
    path = out if not taken else out[:-len(".txt")] + f".{taken}.txt"
    with open(path, "w") as f:
        f.write((text.splitlines() or ["(no Python stacks)"])[0] + "\n" + kernel + report)


def main(pid: int, stacks: str, watch: str, out: str, signum: int) -> None:
    signalled, taken = None, 0
    while _alive(pid):
        time.sleep(POLL)
        state = _read_watch(watch)
        if state is None:
            continue
        stacks_at, kill_at, what = state
        now = time.time()
        if now >= kill_at:
            print(f"\n+++ Timeout +++ the watcher of rank pid {pid}: {what}; past its "
                  f"timeout, the rank is stuck where a signal does not reach (see "
                  f"{stacks}): killed", file=sys.stderr, flush=True)
            os.kill(pid, signal.SIGKILL)
            return
        if now >= stacks_at and signalled != state:
            signalled = state
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                return
            _capture(pid, stacks, out, taken)
            taken += 1


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
