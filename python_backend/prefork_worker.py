"""A preforked worker: one model instance's user code, in a process forked from the preloaded parent.

``serve`` runs in the child right after the fork and never returns. It imports the package, runs
``load`` and then answers the stub's INFER frames one at a time on its main thread (the protocol is
in prefork_protocol.py). Outputs are checked and conformed here with the stub's own functions
(batching.py), and every failure is described here with errors.describe_failure, so that the stub
answers exactly as if the model ran inside it. CUDA, if the model uses it, is initialised by
``load``: after the fork, in this process only.
"""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from .batching import check_outputs, check_raw_outputs
from .errors import describe_failure, without_prefix
from .journal import note_phase, start_ticks
from .prefork_protocol import (
    CANCEL,
    END,
    ERROR,
    FORKED,
    INFER,
    ITEM,
    NEXT,
    READY,
    RESULT,
    SHUTDOWN,
    STREAM,
    PeerClosed,
    PeerRegion,
    ProtocolError,
    Region,
    read_tensors,
    recv_frame,
    send_frame,
    send_json,
    send_tensors,
)
from .runners import build_model
from .spec import RuntimeSpec, load_spec

EXIT_CRASHED = 70  # the worker's own plumbing failed (not the model): EX_SOFTWARE
WATCH_POLL_SECS = 0.5  # without pidfd_open (kernels before 5.3): how often the stub is looked at


@dataclasses.dataclass(frozen=True)
class SpawnRequest:
    """What a stub asks the parent for (the SPAWN frame's JSON)."""

    spec_path: str
    package_dir: str
    device: str
    stub_pid: int
    stub_start_ticks: int

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> SpawnRequest:
        try:
            return cls(
                str(payload["spec_path"]),
                str(payload["package_dir"]),
                str(payload["device"]),
                int(payload["stub_pid"]),
                int(payload["stub_start_ticks"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"SPAWN frame: missing or bad field ({e!r})") from None


def serve(conn: socket.socket, request: SpawnRequest) -> None:
    """The worker's whole life (in the forked child): never returns."""
    code = EXIT_CRASHED
    try:
        code = _run(conn, request)
    except BaseException:  # the plumbing failed: say how on stderr (Triton's log) and end
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _watch_stub(pid: int, ticks: int) -> None:
    """End this worker when its stub is gone (killed on a hanging load, crashed, unloaded)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        same = start_ticks(pid) == ticks
    except (OSError, ValueError, IndexError):
        same = False
    if not same:
        os._exit(0)
    if fd is not None:
        select.select([fd], [], [])
        os._exit(0)
    while True:
        time.sleep(WATCH_POLL_SECS)
        try:
            if start_ticks(pid) != ticks:
                os._exit(0)
        except (OSError, ValueError, IndexError):
            os._exit(0)


def _run(conn: socket.socket, request: SpawnRequest) -> int:
    send_json(conn, FORKED, {"pid": os.getpid(), "start_ticks": start_ticks()})
    threading.Thread(
        target=_watch_stub, args=(request.stub_pid, request.stub_start_ticks), name="snooze-stub-watch", daemon=True
    ).start()
    sys.stdout = sys.stderr  # user prints reach Triton's log, as in the stub
    stage = "initialize"
    model_id = os.path.basename(os.path.dirname(os.path.dirname(request.spec_path))) or "?"
    try:
        spec = load_spec(request.spec_path)
        model_id = spec.model_id
        os.environ.update(spec.env)  # before the user's import, as in the stub
        stage = "import"
        stub = (request.stub_pid, request.stub_start_ticks)
        note_phase("import", stub=stub, worker=os.getpid())  # in its stub's note: the control plane reads that
        started = time.perf_counter()
        model = build_model(spec, request.package_dir)
        imported = time.perf_counter()
        stage = "load"
        note_phase("load", stub=stub, worker=os.getpid())
        model.load(request.package_dir, request.device)
        loaded = time.perf_counter()
    except Exception as e:
        _send_error(conn, e, model_id, stage, None)
        return 0
    ready = {"import_secs": imported - started, "load_secs": loaded - imported}
    ready["unload"] = callable(getattr(model, "unload", None))  # the stub tells the control plane (journal)
    send_json(conn, READY, ready)
    return _serve_requests(conn, spec, model)


def _serve_requests(conn: socket.socket, spec: RuntimeSpec, model: Any) -> int:
    region, peer = Region(f"snooze-out-{spec.model_id}"), PeerRegion()
    while True:
        try:
            kind, body, fd = recv_frame(conn)
        except PeerClosed:
            return 0  # the stub is gone
        if kind == SHUTDOWN:
            unload = getattr(model, "unload", None)
            try:
                if callable(unload):
                    unload()
            except Exception as e:
                _send_error(conn, e, spec.model_id, "unload", None)
                return 0
            send_frame(conn, RESULT)
            return 0
        if kind == STREAM:
            _stream(conn, spec, model, read_tensors(body, fd, peer, copy=False, take=True), region)
            continue
        if kind != INFER:
            raise ProtocolError(f"a worker expects INFER, STREAM or SHUTDOWN, got frame type {kind}")
        # In place: the stub writes its next INFER only after this call's RESULT.
        inputs = read_tensors(body, fd, peer, copy=False, take=True)
        rows = _rows(spec, inputs)
        try:
            outputs = _conform(spec, inputs, model.predict(inputs), rows)
        except BaseException as e:  # user code can raise anything (SystemExit too): described, answered by the stub
            _send_error(conn, e, spec.model_id, "predict", rows)
            continue
        send_tensors(conn, RESULT, region, outputs)


def _stream(conn: socket.socket, spec: RuntimeSpec, model: Any, inputs: Any, region: Region) -> None:
    """A decoupled model's request: one ITEM per result ``predict`` yields, each after the stub's NEXT;
    END once the generator ends or the stub sent CANCEL (the generator is closed first); ERROR when it
    raised (the items before stay sent). The inputs stay in place: the stub writes nothing until END."""
    rows = _rows(spec, inputs)
    results = None
    try:
        results = iter(model.predict(inputs))
        for outputs in results:
            send_tensors(conn, ITEM, region, _conform(spec, inputs, outputs, rows))
            kind, _, fd = recv_frame(conn)
            if fd is not None:
                os.close(fd)
            if kind == CANCEL:
                break
            if kind != NEXT:
                raise ProtocolError(f"a streaming worker expects NEXT or CANCEL, got frame type {kind}")
    except (PeerClosed, ProtocolError, OSError):
        raise  # the stub is gone or confused: the worker's own plumbing, not the model
    except BaseException as e:  # user code can raise anything: it ends this request's stream
        _send_error(conn, e, spec.model_id, "predict", rows)
        return
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
    send_frame(conn, END)


def _rows(spec: RuntimeSpec, inputs: Any) -> int | None:
    """The collated batch size, as the stub's run_batch counts it for an out-of-memory message."""
    if not spec.batched:
        return None
    first = inputs[spec.inputs[0].name]
    if spec.tensor_format == "raw":
        return sum(len(a) for a in first)
    return len(first)


def _conform(spec: RuntimeSpec, inputs: Any, outputs: Any, rows: int | None) -> Any:
    """Outputs as the stub's checks want them (numpy arrays of the declared dtypes; undeclared keys
    dropped); raises the very errors the stub would raise (the stub checks them again, cheaply)."""
    if spec.tensor_format == "raw":
        sizes = [len(a) if spec.batched else None for a in inputs[spec.inputs[0].name]]
        per_request = check_raw_outputs(spec, outputs, sizes)
        return {t.name: [r[t.name] for r in per_request] for t in spec.outputs}
    return check_outputs(spec, outputs, rows)


def _send_error(conn: socket.socket, exc: BaseException, model_id: str, stage: str, rows: int | None) -> None:
    kind, message = describe_failure(exc, model_id, stage, rows)
    send_json(conn, ERROR, {"kind": kind, "message": without_prefix(kind, model_id, message), "stage": stage})


def reset_signals() -> None:
    """The parent's signal setup is not the worker's: default dispositions, no wake-up fd."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
