"""Beside one rank of a test session: once that rank's stacks file holds Python stacks (a
test neared its timeout, tests/conftest.py), write the rank's native stacks with gdb, so a
rank waiting inside the MPI library shows in which call and which progress loop.

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
            f.write(text.splitlines()[0] + "\n" + report)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
