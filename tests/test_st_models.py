"""Sentence Transformers 6 MultiVectorEncoder checkpoints served by espn, checked against the library's own encode.

Tiny seeded models (hidden 32, two layers; BERT and ModernBERT backbones built from configs made
here, never downloaded; the WordPiece tokenizer of the bundled all-MiniLM-L6-v2) are saved by
Sentence Transformers 6 itself, with and without prompts, query expansion (attended or not),
skiplists per task and a baked-in token pooling. The reference is `MultiVectorEncoder.encode_query`
/ `encode_document` / `similarity` on the same strings: espn's vectors must have the same token
counts and agree within 1e-5 (fp32), its exhaustive ranking on an fp16 index the same top 10 with
scores within 0.5%. PyLate and colbert-ai checkpoints (espn's own loader) are checked against the
same reference. Checkpoints written by PyLate 1.6.0 and colbert-ai themselves, with their own
encode, are tests/model_fixtures/ (tests/test_model_fixtures.py).
The title joiner: recorded in the manifest, used by the build and by explanations.
"""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

st = pytest.importorskip("sentence_transformers", minversion="6.2",
                         reason="the reference is Sentence Transformers 6 (pip install -e '.[test]')")

from sentence_transformers import MultiVectorEncoder  # noqa: E402
from sentence_transformers.base.modules import Dense, Normalize, Transformer  # noqa: E402
from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling, MultiVectorMask  # noqa: E402
from transformers import (AutoTokenizer, BertConfig, BertModel, ModernBertConfig,  # noqa: E402
                          ModernBertModel)

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.make_colbert_checkpoint import write_checkpoint  # noqa: E402
from espn.corpus import PASSAGE_JOINER, default_title_joiner, index_title_joiner, passage_text  # noqa: E402
from espn.encoders import encoder_from_spec  # noqa: E402
from espn.encoders.colbert import ColBERTEncoder  # noqa: E402
from espn.encoders.hf import default_model_dir  # noqa: E402
from espn.encoders.multivector import SentenceTransformersEncoder, is_sentence_transformers_save  # noqa: E402
from espn.search.explain import passage_spans  # noqa: E402
from espn.search.searcher import Searcher  # noqa: E402
from espn_indexing.build import BuildConfig, build_index  # noqa: E402

SAMPLE = Path(__file__).parents[1] / "espn" / "data" / "sample_corpus.jsonl"
QUERIES = ["How does the Sun produce energy?", "phases of the moon", "why do volcanoes erupt, and where?",
           "a query much longer than the query length allows, with many words: " + "energy " * 40]
DOCS = ["The Sun is a G-type main-sequence star; it fuses hydrogen into helium.",
        "The Moon's phases occur because we see different portions of its sunlit half.",
        "Short.", "word, " * 150, "  leading and trailing spaces  "]
HIDDEN = 32
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


# -- checkpoints, saved by Sentence Transformers itself ----------------------------------
def _backbone(out: Path, arch: str, seed: int) -> Path:
    """A seeded tiny BERT or ModernBERT with MiniLM's WordPiece tokenizer, as a Hugging Face directory."""
    out.mkdir(parents=True, exist_ok=True)
    source = default_model_dir()
    for name in _TOKENIZER_FILES:
        shutil.copy2(source / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    torch.manual_seed(seed)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64)
    if arch == "bert":
        model: torch.nn.Module = BertModel(BertConfig(**sizes, max_position_embeddings=512))
    else:
        ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                   eos_token_id=tokenizer.sep_token_id, cls_token_id=tokenizer.cls_token_id,
                   sep_token_id=tokenizer.sep_token_id)
        # One RoPE theta for both attention types, as GTE-ModernColBERT's backbone (gte-modernbert) has.
        rope = {layer: {"rope_type": "default", "rope_theta": 160000.0}
                for layer in ("full_attention", "sliding_attention")}
        model = ModernBertModel(ModernBertConfig(**sizes, **ids, max_position_embeddings=512, rope_parameters=rope))
    model.save_pretrained(str(out))  # type: ignore[operator]
    return out


def save_st(out: Path, base: Path, *, prompts: dict[str, str] | None = None, expansion: dict[str, Any] | None = None,
            skiplist: list[str] | None = None, skiplist_tasks: list[str] | None = None, pool: int | None = None,
            similarity: str | None = None, seed: int = 1) -> Path:
    """A MultiVectorEncoder built from `base` (Transformer -> Dense -> MultiVectorMask [-> TokenPooling]
    -> Normalize) and saved in Sentence Transformers 6's own format."""
    transformer = Transformer(str(base), document_length=64, query_expansion=expansion,
                              query_length=None if expansion else 20)
    torch.manual_seed(seed)
    modules: list[torch.nn.Module] = [
        transformer,
        Dense(in_features=HIDDEN, out_features=16, bias=False, activation_function=torch.nn.Identity(),
              module_input_name="token_embeddings"),
        MultiVectorMask(skiplist_words=skiplist, skiplist_tasks=skiplist_tasks),
    ]
    if pool:
        modules.append(HierarchicalTokenPooling(pool_factor=pool))
    modules.append(Normalize(module_input_name="token_embeddings"))
    model = MultiVectorEncoder(modules=modules, prompts=prompts, device="cpu", similarity_fn_name=similarity)
    model.save(str(out))
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {arch: _backbone(root / arch, arch, seed) for arch, seed in (("bert", 0), ("modernbert", 3))}


PUNCTUATION = list(string.punctuation)
CASES: dict[str, dict[str, Any]] = {
    "bert-plain": dict(arch="bert"),
    "bert-prompts-expansion-skiplist": dict(arch="bert", prompts={"query": "[Q] ", "document": "[D] "},
                                            expansion={"strategy": "fixed", "attend": False, "length": 24},
                                            skiplist=PUNCTUATION),
    "bert-attended-expansion-skiplist-both": dict(arch="bert", prompts={"query": "query: ", "document": "passage: "},
                                                  expansion={"strategy": "fixed", "attend": True, "length": 24},
                                                  skiplist=PUNCTUATION, skiplist_tasks=["query", "document"],
                                                  similarity="meanmaxsim"),
    "bert-token-pooling": dict(arch="bert", expansion={"strategy": "fixed", "attend": False, "length": 24},
                               skiplist=PUNCTUATION, pool=2),
    "modernbert-prompts-expansion-skiplist": dict(arch="modernbert", prompts={"query": "[Q] ", "document": "[D] "},
                                                  expansion={"strategy": "fixed", "attend": False, "length": 24},
                                                  skiplist=PUNCTUATION),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, bases: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("st")
    return {name: save_st(root / name, bases[case["arch"]], **{k: v for k, v in case.items() if k != "arch"})
            for name, case in CASES.items()}


def assert_encodes_like(encoder: Any, reference: MultiVectorEncoder) -> None:
    """espn's query and document vectors == the reference's encode_query / encode_document (counts exact)."""
    q, d = encoder.encode_queries(QUERIES), encoder.encode_documents(DOCS)
    for i, expected in enumerate(reference.encode_query(QUERIES)):
        got = q.bow[i][q.mask[i]]
        assert got.shape == tuple(expected.shape), f"query {i}"
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=0)
    for (_, got), expected in zip(d.split(), reference.encode_document(DOCS)):
        assert got.shape == tuple(expected.shape)
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_a_sentence_transformers_save_encodes_as_its_encode(checkpoints: dict[str, Path], name: str,
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoints[name]
    assert is_sentence_transformers_save(path)
    reference = MultiVectorEncoder(str(path), device="cpu", local_files_only=True)
    encoder = encoder_from_spec(f"colbert:{path}", device="cpu")
    assert isinstance(encoder, SentenceTransformersEncoder) and encoder.query_backend == "auto"
    assert encoder.bow_reduction == ("mean" if CASES[name].get("similarity") == "meanmaxsim" else "sum")
    monkeypatch.setenv("HOME", str(tmp_path))  # the ONNX graph cache goes under ~/.cache/espn/onnx
    assert_encodes_like(encoder, reference)  # ONNX queries (BERT and ModernBERT export)
    assert encoder._query_graph() is not None  # noqa: SLF001  # BERT and ModernBERT both export
    encoder.query_backend, encoder._graph = "torch", None  # noqa: SLF001  # the torch path as well
    assert_encodes_like(encoder, reference)


def test_hf_spec_of_a_sentence_transformers_save_loads_it_as_such(checkpoints: dict[str, Path]) -> None:
    encoder = encoder_from_spec(f"hf:{checkpoints['bert-plain']}", device="cpu")
    assert isinstance(encoder, SentenceTransformersEncoder)
    # A single-vector Sentence Transformers model is no multi-vector checkpoint (the library would
    # give it a random projection): MiniLM stays the generic encoder.
    assert not is_sentence_transformers_save(default_model_dir())
    with pytest.raises(Exception, match="settings are its own"):
        encoder_from_spec(f"colbert:{checkpoints['bert-plain']}?query_length=8", device="cpu")


# -- PyLate and colbert-ai checkpoints: espn's own loader, the same reference --------------
@pytest.mark.parametrize("fmt", ["pylate", "colbert-ai"])
def test_pylate_and_colbert_ai_checkpoints_encode_as_sentence_transformers(bases: dict[str, Path], fmt: str,
                                                                           tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / fmt, fmt=fmt, dim=16, seed=5, source=bases["bert"])
    encoder = encoder_from_spec(f"colbert:{path}", device="cpu")
    assert isinstance(encoder, ColBERTEncoder)
    encoder.query_backend = "torch"
    assert_encodes_like(encoder, MultiVectorEncoder(str(path), device="cpu", local_files_only=True))


# -- an index: the exhaustive ranking is the reference's similarity ------------------------
@pytest.fixture(scope="module")
def st_index(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]) -> Path:
    out = tmp_path_factory.mktemp("st-index") / "index"
    build_index(BuildConfig(corpus=SAMPLE, out=out, encoder=f"colbert:{checkpoints['bert-prompts-expansion-skiplist']}",
                            nlist=4, bow_dtype="float16", loader_workers=0, progress=False, text_index=None,
                            device="cpu"))
    return out


def test_exhaustive_search_ranks_as_the_reference_similarity(st_index: Path, checkpoints: dict[str, Path]) -> None:
    reference = MultiVectorEncoder(str(checkpoints["bert-prompts-expansion-skiplist"]), device="cpu",
                                   local_files_only=True)
    rows = [json.loads(line) for line in SAMPLE.open()]
    ids = [row["_id"] for row in rows]
    # PyLate's and Sentence Transformers' BEIR passage: title, a space, text (the ColBERT default).
    documents = reference.encode_document([passage_text(r.get("title", ""), r["text"], " ") for r in rows])
    queries = reference.encode_query(QUERIES[:3])
    scores = reference.similarity(queries, documents).numpy()
    stored = reference.similarity(queries, [d.half().float() for d in documents]).numpy()
    manifest = json.loads((st_index / "manifest.json").read_text())
    assert manifest["encoder"]["kind"] == "multivector" and manifest["passage"] == {"title_joiner": " "}
    with Searcher.open(st_index) as searcher:
        assert isinstance(searcher.encoder, SentenceTransformersEncoder)
        assert searcher.weight == 0.0 and searcher.bow_reduction == "sum"
        hits = searcher.search_exhaustive(searcher.encoder.encode_queries(QUERIES[:3]), k=10, rerank_count=len(ids))
    for i in range(3):
        order = np.argsort(-stored[i], kind="stable")[:10]  # the records hold fp16 vectors
        assert [h.doc_id for h in hits[i]] == [ids[j] for j in order]
        np.testing.assert_allclose([h.score for h in hits[i]], scores[i][order], rtol=5e-3)


def test_explain_reports_the_title_the_joiner_and_the_text(st_index: Path) -> None:
    with Searcher.open(st_index) as searcher:
        result = searcher.search(["The Sun nuclear fusion"], k=3, explain=True)[0]
        document = searcher.document(result.hits[0].doc_id)
    title, text = document.title, document.text
    fields = {span.field for m in result.hits[0].explanation.matches for span in m.spans}
    assert "text" in fields
    for match in result.hits[0].explanation.matches:
        for span in match.spans:
            source = title if span.field == "title" else text
            assert span.field in ("title", "text") and 0 <= span.start < span.end <= len(source)


# -- the title joiner ------------------------------------------------------------------------
def test_the_title_joiner_is_recorded_and_used(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(row) for row in (
        {"_id": "a", "title": "Solar fusion", "text": "Hydrogen becomes helium in the core."},
        {"_id": "b", "title": "", "text": "No title here."},
        {"_id": "c", "title": "Moon", "text": "Phases of the moon."})) + "\n")
    path = checkpoints["bert-plain"]
    out = tmp_path / "index"
    build_index(BuildConfig(corpus=corpus, out=out, encoder=f"colbert:{path}", nlist=1, bow_dtype="float16",
                            loader_workers=0, progress=False, text_index=None, device="cpu", title_joiner=" | "))
    manifest = json.loads((out / "manifest.json").read_text())
    assert index_title_joiner(manifest) == " | "
    encoder = SentenceTransformersEncoder(path, device="cpu", query_backend="torch")
    expected = encoder.encode_documents(["Solar fusion | Hydrogen becomes helium in the core.", "No title here.",
                                         "Moon | Phases of the moon."])
    q = encoder.encode_queries(["moon"])
    with Searcher.open(out) as searcher:
        hits = {h.doc_id: h.score for h in searcher.search_exhaustive(q, k=3, rerank_count=3)[0]}
    for doc_id, (_, bow) in zip("abc", expected.split()):
        want = float((q.bow[0][q.mask[0]] @ bow.astype(np.float16).astype(np.float32).T).max(1).sum())
        assert hits[doc_id] == pytest.approx(want, rel=1e-3)
    # An online write (PUT, espn add) encodes its passage with the index's joiner, as the build did.
    from espn.live.checks import NewDocument
    from espn.live.live_index import LiveIndex

    with LiveIndex.open(out) as writer:
        writer.upsert([NewDocument("d", "Craters of the moon.", title="Moon")])
    (_, written), = encoder.encode_documents(["Moon | Craters of the moon."]).split()
    want = float((q.bow[0][q.mask[0]] @ written.astype(np.float16).astype(np.float32).T).max(1).sum())
    with Searcher.open(out) as searcher:
        hits = {h.doc_id: h.score for h in searcher.search_exhaustive(q, k=4, rerank_count=4)[0]}
    assert hits["d"] == pytest.approx(want, rel=1e-3)
    # The defaults: a space for ColBERT-family models, ". " for the others and for indexes that
    # recorded none (built before the joiner was recorded).
    assert default_title_joiner("colbert") == default_title_joiner("multivector") == " "
    assert default_title_joiner("hf") == PASSAGE_JOINER == ". "
    assert index_title_joiner({"format_version": 1}) == ". "
    # Explanations place spans by the index's joiner.
    title, text = "Solar fusion", "Hydrogen"
    spans = passage_spans(title, text, [(0, 5), (12, 15), (15, 23)], joiner=" | ")
    assert [(s.field, s.start, s.end) for s in spans] == [("title", 0, 5), ("joiner", 0, 3), ("text", 0, 8)]
    with pytest.raises(Exception, match="--title-joiner"):
        BuildConfig(corpus=corpus, out=tmp_path / "x", title_joiner="a\nb").validate()


# -- the guide's commands ----------------------------------------------------------------------
def test_the_guide_commands_parse() -> None:
    """Every `espn ...` line of the ColBERT guide's shell blocks is a command the CLI accepts (its
    arguments parsed, nothing run), and each popular checkpoint has its copy-paste index command."""
    import re
    import shlex

    from espn.cli.app import build_parser

    guide = (ROOT / "docs" / "guides" / "colbert-models.md").read_text()
    lines = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", guide, re.S)
             for line in block.replace("\\\n", " ").splitlines() if line.strip().startswith("espn ")]
    assert lines
    parser = build_parser()
    for line in lines:
        parser.parse_args(shlex.split(line)[1:])  # SystemExit on an unknown or missing argument
    for checkpoint in ("colbertv2.0", "answerai-colbert-small-v1", "mxbai-colbert-large-v1", "GTE-ModernColBERT-v1"):
        assert any(line.startswith("espn index") and f"--encoder colbert:./{checkpoint}" in line for line in lines)
    assert any(line.startswith("espn search") and "--queries" in line for line in lines)
