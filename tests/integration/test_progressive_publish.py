"""`serve --models` with many packages: the gateway and the API are live before every package is published; a
request for a model still waiting is answered once it is (published first), never with a bare 404; a restart with
the work dir kept writes nothing for unchanged packages. Both topologies; the embedded one publishes with a helper
process (``controlplane.store.stager``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from harness.probes import grpc_infer, until
from harness.serve import TOPOLOGIES, Serve, write_package

PACKAGES = 120
ADMIN_KEY, API_KEY = "progressive-admin", "progressive-infer"
HEADERS = {"X-API-Key": ADMIN_KEY}


def _serve(root: Path, models: Path, topology: str) -> Serve:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNOOZE_")}
    env.update(SNOOZE_ADMIN_KEYS=json.dumps([ADMIN_KEY]), SNOOZE_API_KEYS=json.dumps([API_KEY]))
    # the embedded stack publishes with a helper process (it starts from 300 packages by default), the other without
    env.update(SNOOZE_PUBLISH_HELPER_FROM="1" if topology == "embedded" else "0")
    return Serve(root / "work", env, models=models, admin_key=ADMIN_KEY, topology=topology)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_live_before_publishing_ends_and_a_restart_adopts_every_package(tmp_path: Path, topology: str) -> None:
    models = tmp_path / "models"
    for i in range(PACKAGES):
        write_package(models / f"many-{i:03d}", dims=4, params={"scale": 2.0})
    serve = _serve(tmp_path, models, topology)
    try:
        serve.start(timeout=180, published=False)
        last = f"many-{PACKAGES - 1:03d}"
        progress = httpx.get(f"{serve.api_url}/v1/publishing", headers=HEADERS, timeout=10).json()
        assert progress["total"] == PACKAGES
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        # whether or not it is published yet, the request is answered (a waiting model goes first)
        np.testing.assert_allclose(
            grpc_infer(serve.grpc_url, last, x, headers={"x-api-key": API_KEY}, timeout=120), x * 2
        )
        until(
            lambda: not httpx.get(f"{serve.api_url}/v1/publishing", headers=HEADERS, timeout=10).json()["in_progress"],
            "every package published",
            timeout=180,
        )
        r = httpx.get(f"{serve.api_url}/v1/models", headers=HEADERS, params={"limit": 50}, timeout=30)
        assert r.headers["X-Total-Count"] == str(PACKAGES) and len(r.json()) == 50
        helped = "publishing with a helper process" in serve.log.read_text(errors="replace")
        assert helped == (topology == "embedded")
        serve.stop()

        serve.start(timeout=180)  # the work dir kept: nothing to write
        progress = httpx.get(f"{serve.api_url}/v1/publishing", headers=HEADERS, timeout=10).json()
        assert (progress["unchanged"], progress["published"]) == (PACKAGES, 0), progress
        np.testing.assert_allclose(grpc_infer(serve.grpc_url, "many-000", x, headers={"x-api-key": API_KEY}), x * 2)
    finally:
        serve.stop()  # and `snoozectl triton` (two_process)
