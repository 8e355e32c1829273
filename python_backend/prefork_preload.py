"""What a preloaded parent does before it forks: import the modules its models declare, warm their kernels,
hold the thread pools at one thread, and tell which native threads would not survive a fork.

Runs in the parent (prefork_parent.py), which forks workers only while ``unsafe_threads`` is empty;
a worker gets the thread counts back (``ThreadPools.restore``). Standard library only at import time.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
import threading
import time
from typing import Any

ALWAYS_PRELOADED = ("numpy",)
# Modules whose import starts native threads that no fork survives (onnxruntime: a thread in a timed condition wait,
# started by its native module). The parent never imports them: its spare worker does, after its fork (spare_imports).
FORK_UNSAFE_IMPORTS = frozenset({"onnxruntime"})
PR_SET_NAME = 15


def log(message: str) -> None:
    print(f"snooze prefork parent {os.getpid()}: {message}", file=sys.stderr, flush=True)


def set_process_name(name: str) -> None:
    """The name ``ps`` and psutil show (/proc/<pid>/comm), so parents and workers are easy to tell."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def thread_ids() -> set[int]:
    """This process's native threads (the main one included), from /proc/self/task."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def thread_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _maps_name(fragment: str) -> bool:
    """Whether a library whose file name contains ``fragment`` is mapped into this process."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any(fragment in line.rsplit("/", 1)[-1] for line in f)
    except OSError:
        return False


# More such modules, comma-separated, in the model's env (a parent's env is its models'): e.g. tensorflow.
SPARE_IMPORTS_ENV = "SNOOZE_PREFORK_SPARE_IMPORTS"


def split_preload(modules: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``modules`` as (what the parent imports, what only its spare imports after the fork)."""
    named = {m.strip() for m in os.environ.get(SPARE_IMPORTS_ENV, "").split(",") if m.strip()}
    unsafe = tuple(m for m in modules if m.split(".")[0] in FORK_UNSAFE_IMPORTS or m in named)
    return tuple(m for m in modules if m not in unsafe), unsafe


def preload(
    modules: tuple[str, ...], started: dict[str, set[int]] | None = None
) -> tuple[dict[str, float], dict[str, str]]:
    """Import numpy and ``modules``; seconds per module, and the error of each that failed.
    ``started``, when given, gets the native threads each import left running."""
    seconds: dict[str, float] = {}
    failed: dict[str, str] = {}
    for name in dict.fromkeys((*ALWAYS_PRELOADED, *modules)):
        before = thread_ids()
        began = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as e:  # the worker's own import will fail with the model's name on it
            failed[name] = f"{type(e).__name__}: {e}"
            log(f"could not preload {name!r} ({failed[name]}); models that need it import it themselves")
        seconds[name] = round(time.perf_counter() - began, 4)
        if started is not None:
            started[name] = thread_ids() - before
    return seconds, failed


class ThreadPools:
    """The parent's thread pools held at one thread, so that none runs when it forks (GNU OpenMP's pool,
    torch's intra-op pool, MKL's, do not survive a fork: a worker's first parallel region would wait
    for threads that are not there); each worker gets the configured counts back right after its fork.

    ``limit`` runs after the imports and before the warmers: torch through ``torch.set_num_threads``
    (OpenMP, MKL and its pthreadpool), every other BLAS/OpenMP library threadpoolctl finds (where it is
    installed). Torch's inter-op pool is never started here (no warmer uses ``torch.jit.fork``)."""

    def __init__(self) -> None:
        self.torch_threads: int | None = None
        self._limiter: Any = None  # threadpoolctl's, whose restore_original_limits() a worker calls

    def limit(self) -> None:
        torch = sys.modules.get("torch")  # first: threadpoolctl's OpenMP limit would change what it reports
        if torch is not None:
            try:
                self.torch_threads = torch.get_num_threads()
                torch.set_num_threads(1)
            except Exception as e:
                self.torch_threads = None
                log(f"could not hold torch at one thread ({type(e).__name__}: {e})")
        try:
            import threadpoolctl
        except ImportError:
            threadpoolctl = None
        if threadpoolctl is not None:
            try:
                self._limiter = threadpoolctl.threadpool_limits(limits=1)
            except Exception as e:  # an odd library: the fork check still stands guard
                log(f"threadpoolctl could not limit the thread pools ({type(e).__name__}: {e})")

    def restore(self) -> None:
        """In a fresh worker: the thread counts the parent found before it held them at one."""
        if self._limiter is not None:
            with contextlib.suppress(Exception):
                self._limiter.restore_original_limits()
        torch = sys.modules.get("torch")
        if torch is not None and self.torch_threads is not None:
            with contextlib.suppress(Exception):
                torch.set_num_threads(self.torch_threads)

    def describe(self) -> dict[str, Any]:
        held: dict[str, Any] = {}
        if self.torch_threads is not None:
            held["torch"] = self.torch_threads
        if self._limiter is not None:
            with contextlib.suppress(Exception):
                for lib in self._limiter._original_info:
                    held[str(lib.get("prefix"))] = lib.get("num_threads")
        return held


def fork_safe_threads(started: dict[str, set[int]]) -> dict[int, str]:
    """The native threads known to survive a fork, with why. numpy's wheels bundle OpenBLAS built on
    pthreads, whose server threads start at import and are stopped by OpenBLAS's own fork handler
    (pthread_atfork) before any fork; a worker starts its own on its first BLAS call. (An OpenBLAS built
    on OpenMP starts no thread at import: its threads are OpenMP's, started by a first parallel call.)"""
    safe: dict[int, str] = {}
    if started.get("numpy") and _maps_name("openblas"):
        safe.update({tid: "OpenBLAS server thread (numpy; stopped by its fork handler)" for tid in started["numpy"]})
    return safe


def unsafe_threads(safe: dict[int, str]) -> dict[int, str]:
    """The threads other than the main one and the fork-safe ones: their name by id."""
    main = os.getpid()
    return {tid: thread_name(tid) for tid in sorted(thread_ids() - {main} - set(safe))}


def _warm_numpy() -> None:
    import numpy as np

    a = np.ones((64, 64), dtype=np.float32)
    (a @ a).sum()  # BLAS: its kernels are selected once, here (its threads are held at one: ThreadPools)
    np.ones((64, 64), dtype=np.float64).dot(np.ones(64))


def _warm_torch() -> None:
    import io

    import torch

    # CPU only, never CUDA: a context made here would not survive the fork. Gradients off, as models run.
    # On one thread (ThreadPools.limit): a parallel region here would start OpenMP's pool in the parent.
    with torch.inference_mode():
        x = torch.ones(1, 3, 16, 16)
        torch.nn.functional.conv2d(x, torch.ones(4, 3, 3, 3), padding=1).relu().sum()
        (torch.ones(32, 32) @ torch.ones(32, 32)).sum()
        torch.nn.functional.linear(torch.ones(2, 8), torch.ones(4, 8)).softmax(-1)
    # What a model's load() does first: build modules (their initialisers), read weights (torch.load's zip reader and
    # its weights_only unpickler, imported lazily), load_state_dict, then a first forward through common layers. Done
    # once here, a forked worker's load() of a small CNN took 17-23 ms instead of 21-29 (medians of 9 forks, four
    # rounds alternated; its first forward about 1 ms less).
    nn = torch.nn
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, groups=4),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 8),
        nn.LayerNorm(8),
        nn.GELU(),
    )
    saved = io.BytesIO()
    torch.save(net.state_dict(), saved)
    saved.seek(0)
    net.load_state_dict(torch.load(saved, weights_only=True))
    net.eval()
    with torch.inference_mode():
        net(torch.zeros(1, 3, 8, 8)).softmax(-1).numpy()
        nn.Embedding(4, 8)(torch.zeros(1, 2, dtype=torch.long)).sum()
    torch.get_num_threads()


# Per preloaded module: a few small operations that set up what every model's first call would (kernel
# selection, lazily built dispatch tables, the allocator), so each forked worker inherits them. Never
# thread pools: those do not survive a fork (ThreadPools).
KERNEL_WARMERS = {"numpy": _warm_numpy, "torch": _warm_torch}


def warm_kernels(imported: dict[str, float], failed: dict[str, str]) -> dict[str, float]:
    """Run the warmer of each module that imported; seconds per module (a failed warmer is logged)."""
    seconds: dict[str, float] = {}
    for name in imported:
        warm = KERNEL_WARMERS.get(name)
        if warm is None or name in failed:
            continue
        started = time.perf_counter()
        try:
            warm()
        except Exception as e:  # the model's own first call pays instead
            log(f"could not warm {name!r} ({type(e).__name__}: {e})")
        seconds[name] = round(time.perf_counter() - started, 4)
    return seconds


def cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # an odd torch build: nothing to warn about
        return False


def describe_threads(threads: dict[int, str], started: dict[str, set[int]]) -> str:
    """``tid 'name'`` for each thread, with the preloaded module whose import started it where known."""
    parts = []
    for tid, name in threads.items():
        by = [module for module, tids in started.items() if tid in tids]
        parts.append(f"{tid} {name!r}" + (f" started by importing {by[0]}" if by else ""))
    return ", ".join(parts)
