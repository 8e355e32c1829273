"""Sequence models through the gateway: state per correlation id, settings Triton would refuse.

The stack (real Envoy + real tritonserver + the activator, see tests/harness/gateway.py) is shared by the
module's tests (tests/integration/gateway/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from controlplane.spec import DeploymentSpec, SequenceSpec, resolve
from harness.gateway import (
    GRPC_KEY,
    KEY,
    Stack,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("strategy", ["direct", "oldest"])
def test_a_sequence_model_keeps_state_per_correlation_id_asleep_at_the_start(
    stack: Stack, accumulator: Path, strategy: str, tmp_path: Path
):
    name = f"gw_accumulate_{strategy}"
    sequence = SequenceSpec(strategy=strategy, max_sequence_idle_secs=30)
    calls = tmp_path / "calls"
    spec = DeploymentSpec(
        id=name, path=accumulator, max_batch_size=8, idle_timeout_secs=60, sequence=sequence,
        params={"calls": str(calls)},
    )  # fmt: skip
    stack.store.publish(resolve(spec))
    config = stack.store.get(name).config_text
    assert f"{strategy} {{" in config and "sequence_batching" in config and "dynamic_batching" not in config

    def grpc_step(g: grpcclient.InferenceServerClient, cid: int, value: float, start: bool, end: bool) -> float:
        inp = grpcclient.InferInput("x", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[value]], dtype=np.float32))
        r = g.infer(name, [inp], sequence_id=cid, sequence_start=start, sequence_end=end, headers=GRPC_KEY)
        return float(r.as_numpy("y")[0, 0])

    def http_step(h: httpclient.InferenceServerClient, cid: int, value: float, start: bool, end: bool) -> float:
        inp = httpclient.InferInput("x", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[value]], dtype=np.float32))
        r = h.infer(name, [inp], sequence_id=cid, sequence_start=start, sequence_end=end, headers=dict(KEY))
        return float(r.as_numpy("y")[0, 0])

    with stack.grpc() as g, stack.http() as h:
        assert grpc_step(g, 1000, 1.0, True, False) == 1.0  # asleep: this wakes it
        assert http_step(h, 2000, 10.0, True, False) == 10.0
        # Two live sequences: the model's process noted them, and a sweep holds the model in use.
        stack.loop.run(stack.lifecycle.sweep())
        assert stack.lifecycle.sequences.live(name) and stack.lifecycle.states.record(name).in_use >= 1
        assert grpc_step(g, 1000, 2.0, False, False) == 3.0
        assert http_step(h, 2000, 20.0, False, False) == 30.0
        assert grpc_step(g, 1000, 3.0, False, True) == 6.0
        stack.loop.run(stack.lifecycle.sweep())
        assert stack.lifecycle.sequences.live(name)  # 2000 is still open
        assert http_step(h, 2000, 30.0, False, True) == 60.0
        stack.loop.run(stack.lifecycle.sweep())
        assert not stack.lifecycle.sequences.live(name) and stack.lifecycle.states.record(name).in_use == 0
        assert stack.load_count(name) == 1
        inp = grpcclient.InferInput("x", [1, 1], "FP32")
        inp.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
        with pytest.raises(InferenceServerException) as info:  # no correlation id: Triton's own error
            g.infer(name, [inp], headers=GRPC_KEY)
        assert "correlation ID" in info.value.message() and info.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert grpc_step(g, 3000, 5.0, True, True) == 5.0  # and it keeps serving
    # predict saw the sequences' requests only: never the direct strategy's fillers of idle batch slots
    assert set(calls.read_text().split()) == {"1000", "2000", "3000"}


def test_sequence_settings_triton_would_refuse_are_refused_naming_the_field(tmp_path: Path):
    with pytest.raises(ValueError, match="max_candidate_sequences applies to strategy"):
        SequenceSpec(strategy="direct", max_candidate_sequences=4)
    with pytest.raises(ValueError, match="max_sequence_idle_secs"):
        SequenceSpec(max_sequence_idle_secs=0)
    with pytest.raises(ValueError, match=r"idle_timeout_secs \(10\) is below sequence.max_sequence_idle_secs"):
        DeploymentSpec(id="s", path=tmp_path, idle_timeout_secs=10, sequence=SequenceSpec(max_sequence_idle_secs=60))
