"""Streams under stress: a stalled Triton HTTP thread, another model waking, the aio client, memory pressure.

The stack (real Envoy + real tritonserver + the activator, see tests/harness/gateway.py) is shared by the
module's tests (tests/integration/gateway/conftest.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from controlplane.lifecycle.state import UnloadReason
from controlplane.spec import DeploymentSpec, resolve
from harness.gateway import (
    GRPC_KEY,
    KEY,
    Stack,
    _generate,
    _publish_repeater,
    _write_package,
    _x,
)
from harness.probes import http_infer, until

pytestmark = pytest.mark.integration


# x86_64 epoll_wait, epoll_pwait, epoll_pwait2: where Triton's HTTP (libevhtp) and gRPC event loops wait.
EPOLL_SYSCALLS = {"232", "281", "441"}


PTRACE_SEIZE, PTRACE_INTERRUPT, PTRACE_DETACH, WAIT_ALL = 0x4206, 0x4207, 17, 0x40000000


def _event_loop_threads(pid: int) -> list[int]:
    """Threads of ``pid`` waiting in epoll: its HTTP and gRPC event loops, none that runs a model or hands
    a model's responses over (those wait on locks)."""
    tids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            call = (task / "syscall").read_text().split()
            if call and call[0] in EPOLL_SYSCALLS:
                tids.append(int(task.name))
    return tids


def _stall(tids: list[int], secs: float) -> None:
    """Stop these threads (not their process) for ``secs``, as a busy machine deschedules them: ptrace
    seize + interrupt, then detach (one tracer thread does all of it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    seized = []
    try:
        for tid in tids:
            args = (ctypes.c_long(tid), ctypes.c_void_p(None), ctypes.c_void_p(None))
            if libc.ptrace(ctypes.c_long(PTRACE_SEIZE), *args) != 0:
                if ctypes.get_errno() == errno.ESRCH:  # the thread ended since it was listed
                    continue
                raise OSError(ctypes.get_errno(), f"ptrace seize of thread {tid}")
            seized.append(args)
            libc.ptrace(ctypes.c_long(PTRACE_INTERRUPT), *args)
            os.waitpid(tid, WAIT_ALL)
        time.sleep(secs)
    finally:
        for args in seized:
            libc.ptrace(ctypes.c_long(PTRACE_DETACH), *args)


def test_a_fast_sse_stream_outlives_a_stalled_triton_http_thread(stack: Stack, repeater: Path):
    """Triton's HTTP frontend hands each response of a stream to its connection's thread through a socket
    that holds ~280 of them and dropped what did not fit: a thread descheduled for a moment while a model
    streams lost tokens and the stream's end, and the response never ended (controlplane/triton/defer_send.c)."""
    name = _publish_repeater(stack, repeater, "gw_repeat_stalled_http")
    assert _generate(stack, name, "generate_stream", {"x": [1.0, 0.0]}).status_code == 200  # awake
    threads = _event_loop_threads(stack.triton.pid)
    try:
        _stall(threads[:1], 0)
    except OSError as e:  # a machine that forbids ptrace cannot stall a thread
        pytest.skip(f"cannot stop one of Triton's threads here: {e}")
    n, stalled = 1500, threading.Event()
    # The model streams on while Triton's HTTP threads stand still.
    firsts = _stream_events(stack, name, n, at=50, then=lambda: (_stall(threads, 1.0), stalled.set()))
    assert stalled.wait(10)
    assert len(firsts) == n and firsts == [float(n * i) for i in range(1, n + 1)]


def _stream_events(stack: Stack, name: str, n: int, *, at: int, then: Callable[[], object]) -> list[float]:
    """The first values of the ``n`` events of a generate_stream through the gateway, with ``then`` started on
    a thread after the ``at``-th event; fails if the stream stops before its end."""
    url = f"{stack.gateway.http_url}/v2/models/{name}/generate_stream"
    events: list[float] = []
    with (
        httpx.Client(timeout=httpx.Timeout(10, read=20)) as client,
        client.stream("POST", url, json={"x": [float(n), 0.0]}, headers=KEY) as r,
    ):
        try:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line.removeprefix("data: "))["y"][0])
                    if len(events) == at:
                        threading.Thread(target=then, daemon=True).start()
        except httpx.ReadTimeout:
            pytest.fail(f"the stream stopped after {len(events)} of {n} events and never ended")
    return events


SLOW_LOAD_PY = """
import time


class Model:
    def load(self, model_dir, device):
        time.sleep(1.0)

    def predict(self, inputs):
        return {"y": inputs["x"]}
"""


def test_a_stream_open_while_another_model_wakes_gets_every_event(stack: Stack, repeater: Path, tmp_path: Path):
    """Triton runs a model load on the HTTP thread of the connection that asked for it (the control plane's),
    which may also carry streams: during the load that thread hands nothing over, and the streamed responses
    that did not fit its socket were lost, the stream's end with them (without defer_send.c: 332-456 of 4,000
    events here, then silence)."""
    name = _publish_repeater(stack, repeater, "gw_repeat_during_wake")
    slow = _write_package(tmp_path / "slow", SLOW_LOAD_PY, warmup=False)
    stack.store.publish(resolve(DeploymentSpec(id="gw_slow_load", path=slow, max_batch_size=8)))
    assert _generate(stack, name, "generate_stream", {"x": [1.0, 0.0]}).status_code == 200  # awake
    n, woken = 3000, threading.Event()

    def wake_the_other() -> None:
        stack.loop.run(stack.lifecycle.ensure_ready("gw_slow_load"))
        woken.set()

    events = _stream_events(stack, name, n, at=50, then=wake_the_other)  # another model wakes while this one streams
    assert woken.wait(30) and stack.triton_ready("gw_slow_load")
    assert len(events) == n and events == [float(n * i) for i in range(1, n + 1)]


async def test_aio_stream_and_custom_channel_args_wake_a_sleeping_decoupled_model(stack: Stack, repeater: Path):
    """tritonclient.grpc.aio's ``stream_infer`` (an async iterator of requests) and a client built with
    custom channel arguments, as Triton's aio and channel-args examples drive them."""
    name = _publish_repeater(stack, repeater, "gw_repeat_aio")
    inp = grpcaio.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.array([3.0, 0.0], dtype=np.float32))

    async def requests() -> Any:
        yield {"model_name": name, "inputs": [inp], "request_id": "aio-1"}

    options = [("grpc.max_send_message_length", 64 * 1024 * 1024), ("grpc.keepalive_time_ms", 30_000)]
    async with grpcaio.InferenceServerClient(stack.gateway.grpc_url, channel_args=options) as client:
        answers = []
        async for result, error in client.stream_infer(requests(), headers=GRPC_KEY):
            assert error is None, error
            answers.append(result.as_numpy("y").tolist())
            if len(answers) == 3:
                break
    assert answers == [[3.0, 0.0], [6.0, 0.0], [9.0, 0.0]] and stack.load_count(name) == 1


def test_memory_pressure_evicts_another_model_than_one_with_an_open_stream(stack: Stack, repeater: Path):
    """A model streaming to a client is in use: an eviction passes it by and takes an idle one, even one
    used more recently."""
    streaming = _publish_repeater(stack, repeater, "gw_repeat_evict")
    idle = stack.publish("gw_evict_idle")
    answers: list[Any] = []
    evicted: list[str] = []

    def evict() -> bool:  # Triton's pending count (a metric) may still show the idle model's request
        evicted.extend(stack.loop.run(stack.lifecycle.loader.admission.evict(newcomer, 1 << 62, UnloadReason.MEMORY)))
        return idle in evicted

    with stack.grpc() as g:
        g.start_stream(callback=lambda result, error: answers.append(error or result), headers=GRPC_KEY)
        try:
            inp = grpcclient.InferInput("x", [2], "FP32")
            inp.set_data_from_numpy(np.array([10_000.0, 0.05], dtype=np.float32))
            g.async_stream_infer(streaming, [inp])
            until(lambda: answers, "the first token")
            with stack.http() as h:
                # used after the stream began
                np.testing.assert_allclose(http_infer(h, idle, _x(), headers=KEY), _x() * 3)
            newcomer = stack.lifecycle.states.record(stack.publish("gw_evict_newcomer"))
            # The other tests' models count as in use here: only these two are candidates (and no slow unload
            # of another test's model runs).
            others = [r for r in stack.lifecycle.states.values() if r.id not in (streaming, idle)]
            for r in others:
                r.in_use += 1
            try:
                until(evict, "the idle model's eviction", 30)
            finally:
                for r in others:
                    r.in_use -= 1
            assert streaming not in evicted and stack.triton_ready(streaming) and not stack.triton_ready(idle)
        finally:
            g.stop_stream(cancel_requests=True)
