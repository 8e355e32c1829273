"""Triton alone: what an unload of a python model costs, and what ending its stub early does.

    python -m bench.stub_unload wait 8          # Triton's own unload: memory free when the stub exits
    python -m bench.stub_unload kill20 8        # SIGKILL the stub 20 ms after the unload call
    python -m bench.stub_unload stopkill0 8     # SIGSTOP before the unload call, SIGKILL right after it
    python -m bench.stub_unload stopkill5r 6    # ... and load the same model again at once (r)
    python -m bench.stub_unload kill1500 3 3.0  # kill it 1.5 s after the call, inside a 3 s finalize()

A hand-written python model holding 40 MiB (no snoozeml runtime) on the wheel's tritonserver, explicit model
control. Per cycle (one JSON line): the load, the unload call, when the stub's memory was free (gone or a
zombie), whether and when Triton reaped it (within 2.5 s), the index after, tritonserver's thread count before
and after; at the end a reload and an inference, the zombies left, and Triton's log lines beyond start-up.
The findings are in docs/measurements.md ("Triton's unload of a python model"); what the unloader does with them,
in docs/internals.md ("Why").
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from controlplane.triton.launcher import EmbeddedTriton
from controlplane.triton.processes import read_stat

CONFIG = """name: "m"
backend: "python"
max_batch_size: 8
input [{ name: "x" data_type: TYPE_FP32 dims: [2] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [2] }]
instance_group [{ kind: KIND_CPU count: 1 }]
"""
MODEL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINALIZE_SECS = {finalize_secs}


class TritonPythonModel:
    def initialize(self, args):
        self.ballast = np.ones(40 * 1024 * 1024 // 8)

    def finalize(self):
        time.sleep(FINALIZE_SECS)  # a model's unload() that takes this long

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy() * 2)]
            )
            for r in requests
        ]
"""
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]}


def _answers(c: httpx.Client) -> bool:
    r = c.post("/v2/models/m/infer", json=BODY)
    return r.status_code == 200 and r.json()["outputs"][0]["data"] == [2.0, 4.0]


def _index(c: httpx.Client) -> list[dict[str, str]]:
    return [e for e in c.post("/v2/repository/index", json={}).json() if e["name"] == "m"]


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _cycle(c: httpx.Client, t: EmbeddedTriton, mode: str) -> dict[str, object]:
    procs = t.processes()
    started = time.perf_counter()
    assert c.post("/v2/repository/models/m/load", json={}).status_code == 200
    load_s = time.perf_counter() - started
    answered = _answers(c)
    while len(procs.stubs("m")) > 1:  # the previous cycle's reload is still leaving
        time.sleep(0.05)
    [stub] = procs.stubs("m")
    assert t.pid is not None
    threads = _threads(t.pid)
    if mode.startswith("stop"):
        os.kill(stub.pid, signal.SIGSTOP)
    t0 = time.perf_counter()
    c.post("/v2/repository/models/m/unload", json={})
    unload_call = time.perf_counter() - t0
    killed = None
    if "kill" in mode:
        delay = float(mode.split("kill")[1].rstrip("r")) / 1000
        while time.perf_counter() - t0 < delay:
            time.sleep(0.001)
        os.kill(stub.pid, signal.SIGKILL)
        killed = time.perf_counter() - t0
    while (st := read_stat(stub.pid)) is not None and st.state != "Z" and st.start_ticks == stub.start_ticks:
        time.sleep(0.002)
    free = time.perf_counter() - t0
    reload_now = None
    if mode.endswith("r"):
        t1 = time.perf_counter()
        status = c.post("/v2/repository/models/m/load", json={}).status_code
        reload_now = [status, round(time.perf_counter() - t1, 3), _answers(c)]
        while any(e["state"] != "READY" for e in _index(c)):
            time.sleep(0.01)
        c.post("/v2/repository/models/m/unload", json={})
    reaped = None
    while time.perf_counter() - t0 < 2.5:
        st = read_stat(stub.pid)
        if st is None or st.start_ticks != stub.start_ticks:
            reaped = round(time.perf_counter() - t0, 3)
            break
        time.sleep(0.01)
    return {
        "load_s": round(load_s, 3),
        "answered": answered,
        "unload_call_ms": round(1000 * unload_call, 1),
        "killed_ms": None if killed is None else round(1000 * killed, 1),
        "memory_free_ms": round(1000 * free, 1),
        "reaped_s": reaped,
        "reload_now": reload_now,
        "index": _index(c),
        "threads_before_after": [threads, _threads(t.pid)],
    }


def main(mode: str, cycles: int, finalize_secs: float = 0.0) -> None:
    with tempfile.TemporaryDirectory(prefix="snooze-stub-unload-") as tmp:
        repo = Path(tmp) / "repo"
        (repo / "m" / "1").mkdir(parents=True)
        (repo / "m" / "config.pbtxt").write_text(CONFIG)
        (repo / "m" / "1" / "model.py").write_text(MODEL.format(finalize_secs=finalize_secs))
        t = EmbeddedTriton(repo, Path(tmp) / "work")
        t.start()
        try:
            with httpx.Client(base_url=t.http_url, timeout=30) as c:
                rows = []
                for _ in range(cycles):
                    rows.append(_cycle(c, t, mode))
                    print(json.dumps(rows[-1]), flush=True)
                status = c.post("/v2/repository/models/m/load", json={}).status_code
                print("final reload and answer:", status, _answers(c))
            assert t.pid is not None
            zombies = [p.pid for p in psutil.Process(t.pid).children() if p.status() == psutil.STATUS_ZOMBIE]
            print("zombies left:", zombies)
            print("median memory free ms:", statistics.median(float(str(r["memory_free_ms"])) for r in rows))
            noise = [
                line
                for line in t.log_file.read_text().splitlines()
                if line[:1] in ("W", "E") and not any(w in line for w in ("NVML", "DCGM", "pinned", "CudaDriverHelper"))
            ]
            print("warnings and errors in Triton's log:", noise or "none")
        finally:
            t.stop()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "wait", int(args[1]) if len(args) > 1 else 8, float(args[2]) if len(args) > 2 else 0.0)
