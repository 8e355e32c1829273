"""How a stub reaches its preloaded parent: the identity the two must share (interpreter, runtime files,
preload set, env, Triton), the parent started when none listens on that identity's socket, and the
question of how a worker ended, which only the parent that reaped it can answer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

from . import RUNTIME_MODULES
from .journal import JOURNAL_ENV, start_ticks
from .prefork_protocol import (
    EXITED,
    STATUS,
    PeerClosed,
    ProtocolError,
    abstract_name,
    parse_json,
    recv_frame,
    send_json,
)
from .spec import RuntimeKind, RuntimeSpec

PARENT_CONNECT_SECS = 15.0  # the parent binds its socket first thing: a slow start on a busy machine
STATUS_ASK_SECS = 3.0  # how long a stub waits for the parent to say how its worker ended
# The parent's entry point: fork once more (nobody's child, still in Triton's process group), then
# import the runtime from this model's folder and run; the runtime folder leaves sys.path afterwards
# so that it never shadows a model's own modules.
_BOOT = (
    "import os, sys\n"
    "if os.fork():\n"
    "    os._exit(0)\n"
    "sys.path.insert(0, sys.argv[2])\n"
    "from python_backend import prefork_parent\n"
    "sys.path.remove(sys.argv[2])\n"
    "sys.exit(prefork_parent.main(sys.argv[1:]))\n"
)
_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))


class PreforkUnavailable(Exception):
    """No preloaded parent can serve this model: it loads in the stub instead."""


def find_interpreter() -> str | None:
    """The interpreter the stub embeds, as a program: the parent must import what the stub imports."""
    exe = sys.executable
    if exe and os.path.isfile(exe) and os.access(exe, os.X_OK):
        return exe
    return shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}")


def runtime_digest(runtime_dir: str = _RUNTIME_DIR) -> str:
    """A parent serves only stubs whose runtime files are the same as the ones it imported."""
    h = hashlib.sha256()
    for name in RUNTIME_MODULES:
        with open(os.path.join(runtime_dir, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class ParentIdentity:
    """What a parent must share with the stubs it serves; its hash names the parent's socket."""

    interpreter: str
    runtime: str
    preload: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    triton_pid: int
    triton_start_ticks: int

    @property
    def key(self) -> str:
        raw = json.dumps([os.getuid(), sys.version, *dataclasses.astuple(self)], sort_keys=True)
        return hashlib.sha256(raw.encode()).hexdigest()[:24]


def parent_identity(spec: RuntimeSpec, interpreter: str, server_pid: int | None = None) -> ParentIdentity:
    triton = server_pid or os.getppid()  # the stub is tritonserver's child
    # The onnxruntime runner's framework: its parent's spare worker imports it ahead of the wake (prefork_parent.py)
    runner = ("onnxruntime",) if spec.kind is RuntimeKind.ONNX else ()
    return ParentIdentity(
        interpreter,
        runtime_digest(),
        tuple(dict.fromkeys(("numpy", *runner, *spec.preload))),
        tuple(sorted(spec.env.items())),
        triton,
        start_ticks(triton),
    )


def start_parent(identity: ParentIdentity) -> None:
    """Start a parent for ``identity`` (it exits at once if another one already serves it)."""
    config = {
        "key": identity.key,
        "preload": list(identity.preload),
        "env": dict(identity.env),
        "triton_pid": identity.triton_pid,
        "triton_start_ticks": identity.triton_start_ticks,
        "journal_dir": os.environ.get(JOURNAL_ENV) or None,
    }
    root = os.path.dirname(_RUNTIME_DIR)
    # It imports from the model's folder and writes no bytecode (a file written into the repository is a change of
    # the model to Triton, as the entry's _bytecode part says). No PYTHONPYCACHEPREFIX either: under one, the
    # frameworks it preloads would not read their own bytecode, and compile (torch: seconds) into it first.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.Popen(
        [identity.interpreter, "-c", _BOOT, "snooze-prefork", root, json.dumps(config)],
        stdin=subprocess.DEVNULL,
        close_fds=True,
        env=env,
    )
    proc.wait()  # the boot forks and its first process exits at once


def connect_parent(identity: ParentIdentity, timeout: float = PARENT_CONNECT_SECS) -> socket.socket:
    """A connection to the parent, started first if none listens; PreforkUnavailable when none comes."""
    deadline = time.monotonic() + timeout
    started = False
    delay = 0.002
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.connect(abstract_name(identity.key))
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
        if not started:
            try:
                start_parent(identity)
            except OSError as e:
                raise PreforkUnavailable(f"the parent could not be started with {identity.interpreter} ({e})") from e
            started = True
        if time.monotonic() > deadline:
            raise PreforkUnavailable(f"no parent listened within {timeout:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def ask_exit_status(identity: ParentIdentity, worker_pid: int) -> int | None:
    """How worker ``worker_pid`` ended, from the parent that reaped it (None: not known)."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(STATUS_ASK_SECS)
        with sock:
            sock.connect(abstract_name(identity.key))
            send_json(sock, STATUS, {"pid": worker_pid})
            kind, body, _ = recv_frame(sock)
            payload = parse_json(kind, body) if kind == EXITED else {}
    except (OSError, PeerClosed, ProtocolError):
        return None
    status = payload.get("status")
    return status if isinstance(status, int) else None
