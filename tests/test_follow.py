"""A follower (`espn serve --follow s3://...`) replicates what a writer publishes to object storage:
real uvicorn processes, a real S3-compatible server (moto's) that the test stops and restarts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import wait_until
from server_fixtures import HTTP, running_server, s3_server

from espn.live.checks import NewDocument
from espn.live.live_index import LiveIndex
from espn.live.replication.publisher import publish

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

BUCKET = "espn-replica"
URL = f"s3://{BUCKET}/sample"


def _readyz(server) -> dict:
    return HTTP.get(f"{server.base_url}/readyz").json()


def test_a_follower_serves_what_the_writer_publishes_and_survives_the_store_going_away(
        sample_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with s3_server(monkeypatch, BUCKET) as (store, env):
        source = tmp_path / "source"
        shutil.copytree(sample_index, source)
        with LiveIndex.open(source) as writer:
            writer.upsert([NewDocument("before", "published before the follower started, about zyxolith")])
        publish(source, URL)
        # A new follower: its directory does not exist, so it starts from the newest generation.
        replica = tmp_path / "replica"
        with running_server(replica, tmp_path, "--follow", URL, "--follow-interval-s", "0.5", env=env,
                            name="follower") as follower:
            base = follower.base_url
            assert HTTP.get(f"{base}/v1/documents/before").status_code == 200
            status = _readyz(follower)["replication"]
            assert status["generation"] == 1 and status["lag_generations"] == 0 and not status["stale"]
            refused = HTTP.put(f"{base}/v1/documents/x", json={"text": "a write to a replica"})
            assert refused.status_code == 409 and URL in refused.json()["message"]

            with LiveIndex.open(source) as writer:
                writer.upsert([NewDocument("after", "published while the follower runs, about zyxolith")])
                writer.delete(["s0004"])
            publish(source, URL)
            wait_until(lambda: HTTP.get(f"{base}/v1/documents/after").status_code == 200, "the follower",
                       interval_s=0.2)
            assert HTTP.get(f"{base}/v1/documents/s0004").status_code == 404
            found = HTTP.post(f"{base}/v1/search", json={"query": "zyxolith", "k": 5, "mode": "lexical"})
            assert {hit["id"] for hit in found.json()["results"]} == {"before", "after"}

            # The store goes away: the follower keeps serving its generation and says it is stale.
            store.stop()
            wait_until(lambda: _readyz(follower)["replication"]["stale"], "the follower", interval_s=0.2)
            assert HTTP.get(f"{base}/v1/documents/after").status_code == 200
            with LiveIndex.open(source) as writer:
                writer.upsert([NewDocument("during", "written while the store was away")])
            store.start()  # the same in-process backend: what was stored is still there
            publish(source, URL)
            wait_until(lambda: HTTP.get(f"{base}/v1/documents/during").status_code == 200, "the follower",
                       interval_s=0.2)
            status = _readyz(follower)["replication"]
            assert not status["stale"] and status["lag_generations"] == 0
            assert status["generation"] == status["source_generation"]
            metrics = HTTP.get(f"{base}/metrics").text
            assert "espn_replication_lag_generations 0.0" in metrics and "espn_replication_stale 0.0" in metrics
