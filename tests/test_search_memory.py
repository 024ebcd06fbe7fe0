"""A server's memory while it answers search requests at their size limits, many at once, over
real HTTP against a running `espn serve`.

Every client sends a batch of queries at the longest text a query may have, as many as the
largest body holds, with the largest k HTTP allows, all clients at once, twice. Every answer
must be complete, and the server's peak resident set must grow by at most a fixed allowance for
encoding (the server encodes at most `max_batch_size` queries at once per search thread, whatever
the number of requests) plus a stated amount per hit returned (the engine's hits of every request
in flight are Python objects until they are written as JSON), and not at all from one round to
the next (nothing is kept between requests).
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

from benchmarks.common import rss_pss
from espn_server.schemas import MAX_HTTP_K, MAX_QUERY_CHARS
from espn_server.settings import ServerSettings
from server_fixtures import HTTP, running_server

CLIENTS = 6
#: As many queries of the longest text as the largest body takes (104 of 10,000 characters in 1 MiB).
QUERIES = (ServerSettings.model_fields["max_body_bytes"].default - 4096) // (MAX_QUERY_CHARS + 16)
#: What a server may hold per hit of the requests it is answering: the engine's hit (282 bytes)
#: and its JSON (about 110); each response's model is made and written one at a time.
HIT_BYTES = 512
#: A micro-batch of 32 queries (the default `max_batch_size`) at the model's longest input through
#: the encoder: measured 158 MiB over the server's RSS when ready (8 queries: 44 MiB); the read
#: buffers (24 MiB); the allocator's slack. docs/guides/serving.md, "Memory of requests in flight".
FIXED_BYTES = 256 << 20
TIMEOUT_S = 600  # 6 x 104 long queries on a busy 2-core machine


def test_many_batches_at_their_limits_at_once_answer_in_full_within_a_stated_memory(
        sample_index: Path, tmp_path: Path) -> None:
    words = "how do ocean tides follow the moon and what trains the immune system "
    text = (words * (MAX_QUERY_CHARS // len(words) + 1))[:MAX_QUERY_CHARS - 8]
    body = {"queries": [f"{text} {i}" for i in range(QUERIES)], "k": MAX_HTTP_K}
    documents = json.loads((sample_index / "manifest.json").read_text())["counts"]["documents"]
    with running_server(sample_index, tmp_path, name="memory") as server:
        for _ in range(3):  # the code paths warm, so that what grows after is the requests'
            assert HTTP.post(f"{server.base_url}/v1/search/batch", json={**body, "queries": body["queries"][:8]},
                             timeout=TIMEOUT_S).status_code == 200
        ready = rss_pss(server.pid)["rss"]

        def ask(_: int) -> tuple[int, int]:
            answer = HTTP.post(f"{server.base_url}/v1/search/batch", json=body, timeout=TIMEOUT_S)
            assert answer.status_code == 200, answer.text[:300]
            responses = answer.json()["responses"]
            assert len(responses) == QUERIES and not answer.json()["errors"]
            return len(responses), sum(len(r["results"]) for r in responses)

        peaks = []
        for _ in range(2):
            with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
                answered = list(pool.map(ask, range(CLIENTS)))
            peaks.append(rss_pss(server.pid)["peak_rss"])
        assert "Traceback" not in server.log()
    hits = sum(h for _, h in answered)
    assert hits == CLIENTS * QUERIES * min(documents, MAX_HTTP_K)  # every query answered in full
    allowed = hits * HIT_BYTES + FIXED_BYTES
    grown = peaks[0] - ready
    print(f"{CLIENTS} x {QUERIES} queries, {hits} hits: peak {ready / 2**20:.0f} -> {peaks[0] / 2**20:.0f} -> "
          f"{peaks[1] / 2**20:.0f} MiB, allowed +{allowed / 2**20:.0f} MiB")
    assert grown <= allowed, f"{CLIENTS} requests of {QUERIES} queries ({hits} hits) grew the server " \
                             f"{grown / 2**20:.0f} MiB over {ready / 2**20:.0f} MiB; allowed {allowed / 2**20:.0f} MiB"
    assert peaks[1] - peaks[0] <= 0.1 * grown + (16 << 20), \
        f"the second round grew the peak again: {peaks[0] / 2**20:.0f} -> {peaks[1] / 2**20:.0f} MiB"
