"""Beside one rank of a test session: once that rank's stacks file holds Python stacks (a
test neared its timeout, tests/conftest.py), write the rank's native stacks with gdb, so a
rank waiting inside the MPI library shows in which call and which progress loop. The
kernel's view of each thread (state, wait channel, kernel stack where readable) comes
first, taken before gdb stops the rank: a thread blocked in a system call shows on what.

    python tests/native_stacks.py PID STACKS_FILE OUT_FILE

Exits when the rank does. Where gdb cannot attach (ptrace forbidden), OUT_FILE says why.
The kernel's view is written before gdb runs: gdb reads the rank's memory map, which waits
for the address space's lock, so a rank whose lock is stuck holds gdb (unkillable) and its
report never comes; OUT_FILE then ends with GDB_STUCK. A later capture (the rank held up
again) goes beside it, in OUT_FILE's name with .1, .2.
"""
import os
import subprocess
import sys
import time

GDB_LIMIT = 120
GDB_STUCK = f"gdb did not finish in {GDB_LIMIT} s: the rank's memory map did not answer"


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


def main(pid: int, stacks: str, out: str) -> None:
    seen, taken = None, 0
    while _alive(pid):
        time.sleep(0.5)
        try:
            with open(stacks) as f:
                text = f.read()
        except OSError:
            continue
        if "most recent call first" not in text or text == seen:
            continue
        seen = text
        # the first capture in OUT_FILE, later ones beside it (rankN.1.txt, ...)
        path = out if not taken else out[:-len(".txt")] + f".{taken}.txt"
        taken += 1
        with open(path, "w") as f:
            f.write(text.splitlines()[0] + "\n" + _kernel_view(pid))
        report = _gdb(pid)
        with open(path, "a") as f:
            f.write(report)


def _gdb(pid: int) -> str:
    """gdb's backtraces of every thread of pid, or why there are none."""
    try:
        gdb = subprocess.Popen(["gdb", "-p", str(pid), "-batch", "-nx", "-ex",
                                "thread apply all bt"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        return f"gdb did not run: {exc}\n"
    try:
        return gdb.communicate(timeout=GDB_LIMIT)[0]
    except subprocess.TimeoutExpired:
        gdb.kill()                      # a gdb asleep in the kernel dies only when it wakes
        try:
            part = gdb.communicate(timeout=5)[0]
        except subprocess.TimeoutExpired:
            part = ""
        return part + GDB_STUCK + "\n"


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
