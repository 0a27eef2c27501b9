"""Beside one rank of a test session: once that rank's stacks file holds Python stacks (a
test neared its timeout, tests/conftest.py), write the rank's native stacks with gdb, so a
rank waiting inside the MPI library shows in which call and which progress loop. The
kernel's view of each thread (state, wait channel, kernel stack where readable) comes
first, taken before gdb stops the rank: a thread blocked in a system call shows on what.

    python tests/native_stacks.py PID STACKS_FILE OUT_FILE

Exits when the rank does. Where gdb cannot attach (ptrace forbidden), OUT_FILE says why.
A later capture (the rank held up again) goes beside it, in OUT_FILE's name with .1, .2.
"""
import os
import subprocess
import sys
import time


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
        kernel = _kernel_view(pid)
        try:
            run = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex",
                                  "thread apply all bt"], capture_output=True, text=True,
                                 timeout=120)
            report = run.stdout + run.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            report = f"gdb did not run: {exc}\n"
        # the first capture in OUT_FILE, later ones beside it (rankN.1.txt, ...)
        path = out if not taken else out[:-len(".txt")] + f".{taken}.txt"
        taken += 1
        with open(path, "w") as f:
            f.write(text.splitlines()[0] + "\n" + kernel + report)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
