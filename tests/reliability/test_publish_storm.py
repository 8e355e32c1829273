"""A storm of concurrent publishes of one model id, while the model serves traffic.

One publish wins (the last one written), nothing is corrupted (the folder is whole and its files
agree with each other), no staging folder is left, and every answer during the storm came from
one of the published versions.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from harness.probes import until_async
from harness.reliability import Traffic, report, summary

pytestmark = pytest.mark.integration

PUBLISHES = 6  # each one reloads the model: six make the storm, in about half the time of ten


async def test_concurrent_publishes_of_one_id(serve_factory, package):
    serve = serve_factory("storm")
    await asyncio.to_thread(serve.start)
    await asyncio.to_thread(serve.publish, "storm", package, params={"scale": 1.0})
    scales = {1.0} | {float(i + 2) for i in range(PUBLISHES)}
    traffic = Traffic(serve, {"storm": scales}, grpc_clients=3, http_clients=1).start()
    try:
        await until_async(lambda: any(r.ok for r in traffic.results), "traffic")
        async with httpx.AsyncClient(timeout=180) as http:
            answers = await asyncio.gather(
                *(
                    http.post(
                        f"{serve.api_url}/v1/models:from-path",
                        json={
                            "id": "storm",
                            "path": str(package),
                            "params": {"scale": float(i + 2)},
                            "max_batch_size": i + 1,
                        },
                    )
                    for i in range(PUBLISHES)
                )
            )
        await asyncio.sleep(1.0)
    finally:
        results = await traffic.stop()

    assert [a.status_code for a in answers] == [201] * PUBLISHES, [a.text for a in answers if a.status_code != 201]
    folder = serve.repository / "storm"
    config = model_config_pb2.ModelConfig()
    text_format.Parse((folder / "config.pbtxt").read_text(), config)
    deployment = json.loads((folder / "snooze_deployment.json").read_text())
    runtime = json.loads((folder / "1" / "snooze_runtime.json").read_text())
    winner = deployment["params"]["scale"]
    # One winner, the same in every file of the folder.
    assert config.name == "storm" and config.max_batch_size == deployment["deployment"]["max_batch_size"]
    assert config.max_batch_size == int(winner) - 1 == runtime["max_batch_size"]
    assert runtime["params"]["scale"] == winner == deployment["deployment"]["params"]["scale"]
    assert [p for p in serve.staging.iterdir() if p.is_dir()] == []  # the writers' .lock file stays
    listed = await asyncio.to_thread(serve.models)
    assert listed["storm"]["max_batch_size"] == config.max_batch_size
    status = await asyncio.to_thread(serve.status, "storm")

    # The model serves the winner.
    after = Traffic(serve, {"storm": winner}, grpc_clients=2).start()
    await until_async(lambda: sum(r.ok for r in after.results) >= 20, "traffic on the winner")
    served = summary(await after.stop())
    storm = summary(results)
    report(
        f"{PUBLISHES} concurrent publishes of one id",
        winner_scale=winner,
        load_count=status["load_count"],
        failed_during_storm=f"{storm['failed']}/{storm['total']}",
        failed_after=f"{served['failed']}/{served['total']}",
        errors=storm["errors"],
    )
    assert served["failed"] == 0, served
    assert storm["failed"] == 0, storm
