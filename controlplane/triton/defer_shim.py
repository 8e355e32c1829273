"""The preload library that keeps Triton 2.51's HTTP frontend from losing streamed responses.

Triton's HTTP frontend (libevhtp) hands every response of a ``generate_stream`` request to the
connection's worker thread with one 17-byte command on a non-blocking socketpair, and drops the command
when that socket is full (the worker thread ~280 responses behind while a model streams ~2,000 tokens/s:
descheduled on a busy machine, or running another model's load, which Triton does on the HTTP thread of the
connection that asked for it). A dropped command is a lost token, or a lost end of the
stream: the SSE response then never ends, and a client or the gateway waits until its idle timeout.
``defer_send.c`` (read its header) makes that one send wait for room instead; the embedded launcher
builds it once (the user's cache, else the work dir) with the machine's C compiler and preloads it into
tritonserver only.
Without a compiler Triton runs as before, with a warning naming the fix.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger("snoozeml.triton")

SOURCE = Path(__file__).with_name("defer_send.c")
LIB_PREFIX = "libsnooze_defer_send"  # the library finds itself in LD_PRELOAD by this name


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` or ``gcc`` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def user_cache() -> Path:
    """Where the library is kept for every work dir of this user: ``$XDG_CACHE_HOME/snoozeml/preload``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "snoozeml" / "preload"


def build_defer_shim(work_dir: Path, cache: Path | None = None, *, use_cache: bool = True) -> Path | None:
    """The library (built on first use, one file per source version) from the user's cache (``cache``, default
    ``user_cache()``; skipped with ``use_cache=False``) or else ``work_dir/preload/``, or None when it cannot
    be built (logged, with the fix)."""
    name = f"{LIB_PREFIX}-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}.so"
    folders = ([cache or user_cache()] if use_cache else []) + [Path(work_dir) / "preload"]
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    cc = compiler()
    if cc is None:
        log.warning(
            "no C compiler (cc/gcc, or $CC) to build %s: Triton's HTTP generate_stream can lose tokens or never "
            "end a stream when its HTTP thread falls behind; install gcc to get the fix",
            SOURCE.name,
        )
        return None
    failure = ""
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only cache: the work dir next
            failure = str(e)
            continue
        target = folder / name
        partial = target.with_name(f"{name}.{os.getpid()}.tmp")
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
            os.replace(partial, target)
            return target
        except (OSError, subprocess.SubprocessError) as e:
            failure = (getattr(e, "stderr", None) or str(e)).strip()[-500:]
            partial.unlink(missing_ok=True)
    log.warning(
        "could not build %s with %s (%s): Triton runs without it, and its HTTP generate_stream can lose tokens "
        "or never end a stream when its HTTP thread falls behind",
        SOURCE.name,
        cc,
        failure,
    )
    return None


def with_preload(env: dict[str, str], library: Path | None) -> dict[str, str]:
    """``env`` with ``library`` first in ``LD_PRELOAD`` (unchanged when None)."""
    if library is None:
        return env
    rest = env.get("LD_PRELOAD", "")
    return {**env, "LD_PRELOAD": f"{library}:{rest}" if rest else str(library)}
