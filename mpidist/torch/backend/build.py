"""Build (once per torch version and source) and load the C++ half of the backend.

The extension is compiled with torch.utils.cpp_extension against the installed torch and
cached under ~/.cache/mpidist/torch_ext/<torch version>-<hash> (env MPIDIST_TORCH_EXT_DIR
moves the root); later loads import the cached library directly. Ranks that start together
build it once: the first takes a file lock, the others wait and then import its result.
Nothing here runs on `import mpidist.torch`; the backend calls load() when a process group
is created.

    python -m mpidist.torch.backend      # build now (the test set-up does), print the path
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import sys

import torch

__all__ = ["load", "unavailable", "library", "extension_dir", "SOURCE", "NAME"]

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "backend.cpp")
NAME = "mpidist_torch_backend"
_loaded = None


def extension_dir() -> str:
    """Where this torch's build of the current source lives (it may not exist yet)."""
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read())
    digest.update(f"{sys.version}|{torch.__file__}".encode())
    root = os.environ.get("MPIDIST_TORCH_EXT_DIR") or os.path.join(
        os.environ.get("MPIDIST_HOME") or os.path.expanduser("~/.cache/mpidist"), "torch_ext")
    return os.path.join(root, f"{torch.__version__}-{digest.hexdigest()[:12]}")


def library() -> str:
    """The path of the built extension (it may not exist yet)."""
    return os.path.join(extension_dir(), NAME + ".so")     # the name cpp_extension gives it


def _import(lib: str):
    spec = importlib.util.spec_from_file_location(NAME, lib)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unavailable() -> str | None:
    """Why the extension can not be had here (no build cached and no compiler), or None."""
    if os.path.exists(library()):
        return None
    compiler = os.environ.get("CXX", "c++")
    return None if shutil.which(compiler) else f"no build cached and no C++ compiler ({compiler})"


def _check_toolchain() -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(
            f"the mpidist torch backend compiles a small C++ extension once per torch version, "
            f"and no C++ compiler ({compiler!r}) is on PATH: install one (e.g. apt-get install "
            f"g++) or set CXX, or build it where a compiler exists with `python -m "
            f"mpidist.torch.backend` and share {os.path.dirname(extension_dir())} "
            f"(env MPIDIST_TORCH_EXT_DIR)")
    # the ninja that pip installs sits beside the interpreter, which may not be on PATH
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        raise RuntimeError("building the mpidist torch backend needs ninja: pip install ninja")


def load(verbose: bool = False):
    """The compiled extension module (built on first use, then cached on disk)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    path = extension_dir()
    lib = library()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # one builder; the others wait, then import
        if os.path.exists(lib):
            _loaded = _import(lib)
        else:
            _check_toolchain()
            from torch.utils import cpp_extension      # heavy: only when building
            _loaded = cpp_extension.load(name=NAME, sources=[SOURCE], build_directory=path,
                                         extra_cflags=["-O2"], verbose=verbose)
    return _loaded

