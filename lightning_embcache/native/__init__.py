"""Small C loops for work that numpy can only do in many short calls (the device tier's slot
bookkeeping, slotmap.c; a disk-mode get over page-cached chunk files, gather.c), built with the
system's C compiler the first time a process needs them.

Why C: the device tier's slot bookkeeping runs in a prefetch thread beside the training thread;
as numpy calls it holds the interpreter lock for most of its time, so the training thread waits
for it. A ctypes call releases the lock for its whole duration. Why built here: the loops are a
few dozen lines with no Python API, so any C compiler builds them in a fraction of a second
(into a private temporary folder, removed once loaded: nothing is cached or loaded from a path
another user could write). Without a compiler the numpy implementation runs (it is the reference
the tests compare against); ``EMBCACHE_NATIVE=0`` chooses it, ``EMBCACHE_NATIVE=1`` makes a
failed build an error instead of a warning.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from contextlib import ExitStack
from importlib import resources

log = logging.getLogger(__name__)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES = {
    "em_find": (_P, _I, _P, _I, _P, _P),
    "em_stamp": (_P, _I, _P, _I, _I),
    "em_sweep": (_P, _P, _P, _I, _P, _I, _P, _I, _I, _P),
    "em_replace": (_P, _I, _P, _P, _I, _P, _I, _P, _P, _I),
    "em_want": (_P, _I, _P, _I, ctypes.c_int32),
    "em_plan": (_P, _I, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P),
    "em_gather_mapped": (_P, _P, _I, _P, _I),
}
_SOURCES = ("slotmap.c", "gather.c")


class NativeUnavailable(RuntimeError):
    """``EMBCACHE_NATIVE=1`` but the C helpers could not be built."""


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise NativeUnavailable("no C compiler found (set CC, or install gcc or clang)")
    tmp = tempfile.mkdtemp(prefix="embcache-native-")  # 0700: only this user can write there
    try:
        so = os.path.join(tmp, "embcache.so")
        with ExitStack() as stack:
            paths = [str(stack.enter_context(resources.as_file(resources.files(__package__).joinpath(name))))
                     for name in _SOURCES]
            proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", so, *paths],
                                  capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise NativeUnavailable(f"{cc} failed: {proc.stderr.strip()[:500]}")
        lib = ctypes.CDLL(so)  # the mapping stays after the file is removed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int64
    return lib


def library() -> ctypes.CDLL | None:
    """The built C helpers, or None where they are turned off or cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        mode = os.environ.get("EMBCACHE_NATIVE", "")
        if mode != "0":
            try:
                _lib = _build()
            except (NativeUnavailable, OSError, subprocess.SubprocessError) as exc:
                if mode == "1":
                    raise NativeUnavailable(f"EMBCACHE_NATIVE=1 but the C helpers did not build: {exc}") from exc
                log.warning("lightning_embcache: the C helpers did not build (%s); the device tier and disk-mode "
                            "gets use their numpy paths, which hold the interpreter lock longer", exc)
        _tried = True
        return _lib
