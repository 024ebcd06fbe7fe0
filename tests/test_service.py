"""espn.service, the server's one door to the library: it loads light, lends every name it
lists, and its per-query isolation over a real index answers the good queries of a batch that
holds a refused one (the server's batches and the CLI's runs go through it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import espn.service as service
from espn.errors import InvalidParameterError


def test_the_door_loads_no_torch_faiss_or_numpy_and_lends_every_name_it_lists() -> None:
    # `espn --help` reads the server's settings, which import the door: it must stay light.
    code = ("import sys, espn.service as s\n"
            "print(sorted(m for m in ('torch', 'faiss', 'numpy') if m in sys.modules))\n"
            "print(sorted(n for n in s.__all__ if not hasattr(s, n)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    heavy, missing = done.stdout.splitlines()
    assert heavy == "[]", heavy
    assert missing == "[]", f"espn.service lists names it does not lend: {missing}"
    assert len(service.__all__) == len(set(service.__all__))
    with pytest.raises(AttributeError, match="no attribute 'read_current'"):
        getattr(service, "read_current")  # a library name the door does not lend


def test_sort_outcomes_tells_a_refusal_from_a_failure() -> None:
    refused, failed = InvalidParameterError("no text"), ValueError("a bug")
    outcomes = service.sort_outcomes(["a", refused, failed, "d"])
    assert outcomes.answered == {0: "a", 3: "d"}
    assert outcomes.refused == {1: refused}
    assert outcomes.failed == {2: failed}


def test_search_isolated_answers_the_others_and_keeps_the_shared_encode_in_the_stage_times(
        sample_index: Path) -> None:
    searcher = service.Searcher.open(sample_index, reader="memory")
    try:
        too_long = "x " * service.MAX_QUERY_CHARS
        results = service.search_isolated(searcher, ["vaccines", too_long, "ocean temperature"], {"k": 3})
        assert isinstance(results[1], InvalidParameterError) and "characters" in str(results[1])
        assert [len(r.hits) for r in results if not isinstance(r, InvalidParameterError)] == [3, 3]

        groups = [(["vaccines", "protein folding"], {"k": 2}), (["ocean temperature"], {"k": 4})]
        shared, encode_ms = service.encode_together(searcher, groups)
        assert [None if e is None else len(e) for e in shared] == [2, 1] and encode_ms > 0
        together = service.search_isolated(searcher, groups[0][0], groups[0][1], embeddings=shared[0],
                                           encode_ms=encode_ms)
        alone = searcher.search(groups[0][0], k=2)
        assert [[h.doc_id for h in r.hits] for r in together] == [[h.doc_id for h in r.hits] for r in alone]
        stage_ms = together[0].stats.stage_ms
        assert stage_ms["encode"] == round(encode_ms, 3) and stage_ms["total"] >= stage_ms["encode"]
    finally:
        searcher.close()
