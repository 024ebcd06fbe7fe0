"""Tiny seeded checkpoints written by the libraries users save them with, and each library's own encode.

    python tests/model_fixtures/make_fixtures.py                    # every fixture (venvs made once)
    python tests/model_fixtures/make_fixtures.py --only pylate-1.6-modernbert st-6.2-bert-plain
    python tests/model_fixtures/make_fixtures.py --venvs /tmp/fixture-venvs --list

Each library runs in its own virtual environment (under `--venvs`, made on first use from PyPI with
torch 2.13.0 CPU beside it), at the release its users run, with the transformers that release
resolves to or pins; this script then runs itself inside that environment (`--inside NAME`), where
it imports only that library, torch, transformers and tokenizers (never espn):

- a tokenizer trained here on the fixture texts (a WordPiece for BERT, a byte-level BPE with
  ModernBERT's special tokens for ModernBERT) and saved by that release's own tokenizer class;
- a seeded tiny backbone (hidden 32, two layers) built from that release's config class;
- the library's own model over it (PyLate's `ColBERT`, Sentence Transformers' `MultiVectorEncoder`,
  colbert-ai's `ColBERT`), saved by the library's own save;
- the reference: the library's encode of `QUERY_COUNT` sample queries and of every passage of
  espn/data/sample_corpus.jsonl, scored by the library's own similarity, written as
  `reference.json` beside the checkpoint.

colpali-engine (ColPali, ColQwen2) has no fixture: its 0.3.x releases that take torch 2.13
(0.3.18, on transformers >= 5.3) import torchvision (Qwen2-VL's image processor), and
torchvision 0.28.0 from PyPI does not import beside the CPU torch 2.13.0: its `_C.so` links
against the CUDA build (`libtorch_cuda.so`, `libc10_cuda.so`), fails to load, and then
`torchvision/_meta_registrations.py` stops the import ("operator torchvision::nms does not
exist"); the CPU build of torchvision is only on PyTorch's own index, and the releases before
0.3.14 pin torch < 2.9. Without torchvision, ColQwen2 still cannot be built (transformers 5.3.0's
Qwen2VLProcessor demands a video processor, which imports torchvision; 5.4.0 and later need it
for the image processor or at colpali_engine's import), and ColPali under transformers 5.3.0
saves its projection as `base_model\\.model\\.custom_text_proj.*`, which its own
`from_pretrained` does not read back. The tiny page models of the tests are written by
transformers and Sentence Transformers (benchmarks/make_visual_checkpoint.py).

The outputs live in tests/model_fixtures/<name>/ (checkpoint files plus reference.json); the test
matrix (tests/test_model_fixtures.py) indexes each one with espn and compares. A new format is
supported by adding its fixture here, not by guessing its files. Why here and not in benchmarks/:
the outputs are test data, read by the test suite, and the script is how they are remade.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CORPUS = ROOT / "espn" / "data" / "sample_corpus.jsonl"
QUERIES = ROOT / "espn" / "data" / "sample_queries.jsonl"
#: Sample queries in the reference, plus the long one below (longer than any fixture's query length).
QUERY_COUNT = 8
LONG_QUERY = ("a question pasted from an agent's trace, far longer than the query length of the model, about how the "
              "moon's phases and the tides depend on the sun, the earth and their orbits, asked again and again "
              "with more words: " + "tides and phases of the moon " * 12).strip()
#: A ColBERT index joins a title and its text with a space (espn's default title joiner for these models).
TITLE_JOINER = " "
HIDDEN = 32
SEED = 0
#: torch for every environment: the CPU build on this project's machines (a bare `torch` pulls CUDA).
TORCH = "torch==2.13.0"
PUNCTUATION = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")

#: Environment name -> (pip requirements, requirements installed after them with --no-deps, why).
ENVIRONMENTS: dict[str, tuple[list[str], list[str], str]] = {
    "st-6.2": ([TORCH, "sentence-transformers==6.2.*"], [], "Sentence Transformers 6.2, the transformers it resolves"),
    # PyLate 1.6.0 pins sentence-transformers 5.3.0 and transformers <= 5.3.0; its fast-plaid pin needs
    # torch 2.11.0 (a CUDA build from PyPI), so PyLate is installed without its dependencies and they
    # are listed here, fast-plaid (the PLAID index, never used to encode or save) aside.
    "pylate-1.6": ([TORCH, "sentence-transformers==5.3.0", "transformers==5.3.0", "datasets", "accelerate>=0.31.0",
                    "pandas>=2.2.1", "ujson==5.12.0", "ninja==1.11.1.4", "fastkmeans==0.5.0"], ["pylate==1.6.0"],
                   "PyLate 1.6.0 with the transformers (5.3.0) and Sentence Transformers (5.3.0) it pins"),
    # colbert-ai 0.2.22 does not pin transformers, but fails under transformers 5 (HF_ColBERT.from_pretrained:
    # "'HF_ColBERT' object has no attribute 'all_tied_weights_keys'"); its users run transformers 4.
    "colbert-ai-0.2.22": ([TORCH, "colbert-ai==0.2.22", "transformers<5"], [],
                          "colbert-ai 0.2.22 with transformers 4 (it fails under 5)"),
}
#: Fixture name -> (environment, builder, its options).
FIXTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "pylate-1.6-bert": ("pylate-1.6", "pylate", {"arch": "bert"}),
    "pylate-1.6-modernbert": ("pylate-1.6", "pylate", {"arch": "modernbert"}),
    "st-6.2-bert-plain": ("st-6.2", "st", {"arch": "bert"}),
    "st-6.2-bert-prompts-expansion": ("st-6.2", "st", {"arch": "bert", "prompts": True, "expansion": True}),
    "st-6.2-bert-pooling": ("st-6.2", "st", {"arch": "bert", "pool": 2}),
    "st-6.2-modernbert-plain": ("st-6.2", "st", {"arch": "modernbert"}),
    "st-6.2-modernbert-prompts-expansion": ("st-6.2", "st", {"arch": "modernbert", "prompts": True,
                                                             "expansion": True}),
    "st-6.2-modernbert-pooling": ("st-6.2", "st", {"arch": "modernbert", "pool": 2}),
    "colbert-ai-0.2.22-bert": ("colbert-ai-0.2.22", "colbert_ai", {"arch": "bert"}),
}


# -- outside: environments and the runs inside them ------------------------------------------
def environment(root: Path, name: str) -> Path:
    """The Python of environment `name` under `root`, made (or remade when its requirements changed)."""
    requirements, no_deps, _ = ENVIRONMENTS[name]
    where = root / name
    python = where / "bin" / "python"
    stamp = hashlib.sha256(json.dumps([requirements, no_deps]).encode()).hexdigest()[:16]
    marker = where / ".fixture-requirements"
    if python.is_file() and marker.is_file() and marker.read_text() == stamp:
        return python
    if where.exists():
        shutil.rmtree(where)
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile"]
    subprocess.run(pip + requirements, check=True)
    if no_deps:
        subprocess.run(pip + ["--no-deps"] + no_deps, check=True)
    marker.write_text(stamp)
    return python


def make(name: str, venvs: Path, out_root: Path) -> None:
    env, _, _ = FIXTURES[name]
    python = environment(venvs, env)
    out = out_root / name
    with tempfile.TemporaryDirectory() as work:
        staged = Path(work) / name
        subprocess.run([str(python), str(Path(__file__).resolve()), "--inside", name, "--out", str(staged)],
                       check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                                        "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}, cwd=work)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staged, out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{name}: {size / 1024:.0f} KiB in {out}")


# -- inside: shared pieces ------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def texts() -> tuple[list[str], list[str], list[str]]:
    """(queries, document ids, passages) of the reference: title, a space, text, as a ColBERT index joins them."""
    queries = [row["text"] for row in read_jsonl(QUERIES)[:QUERY_COUNT]] + [LONG_QUERY]
    rows = read_jsonl(CORPUS)
    passages = [f"{row['title']}{TITLE_JOINER}{row['text']}" if row.get("title") else row["text"] for row in rows]
    return queries, [row["_id"] for row in rows], passages


def train_tokenizer(arch: str, corpus: list[str]) -> Any:
    """A small tokenizer trained on `corpus`, wrapped in the installed transformers' own class."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if arch == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"[unused{i}]" for i in range(4)]
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials,
                                                                  initial_alphabet=PUNCTUATION, show_progress=False))
    else:
        specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=450, special_tokens=specials, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    names = dict(unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    if arch == "bert":
        import transformers

        bert = getattr(transformers, "BertTokenizerFast", None) or transformers.BertTokenizer
        return bert(tokenizer_object=tok, do_lower_case=True, **names)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=512, **names)


def save_backbone(out: Path, arch: str, corpus: list[str]) -> Path:
    """A seeded tiny BERT or ModernBERT with its tokenizer, as this transformers release saves them."""
    import torch
    from transformers import BertConfig, BertModel, ModernBertConfig, ModernBertModel

    tokenizer = train_tokenizer(arch, corpus)
    torch.manual_seed(SEED)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=512)
    if arch == "bert":
        model: Any = BertModel(BertConfig(**sizes))
    else:
        ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                   eos_token_id=tokenizer.sep_token_id, cls_token_id=tokenizer.cls_token_id,
                   sep_token_id=tokenizer.sep_token_id)
        model = ModernBertModel(ModernBertConfig(**sizes, **ids))
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def write_reference(out: Path, library: str, queries: list[str], doc_ids: list[str], scores: Any,
                    query_vectors: list[Any], settings: dict[str, Any]) -> None:
    """reference.json: the queries, the library's score of every (query, document), and the query
    vectors' counts and first rows (enough to see a recipe drift without committing every vector)."""
    import numpy as np

    scores = np.asarray(scores, dtype=np.float64)
    top = [[doc_ids[j] for j in np.argsort(-row, kind="stable")[:10]] for row in scores]
    reference = {
        "library": library, "settings": settings, "title_joiner": TITLE_JOINER, "corpus": "espn/data/sample_corpus.jsonl",
        "queries": queries, "doc_ids": doc_ids, "top10": top,
        "scores": [[float(f"{x:.7g}") for x in row] for row in scores],
        "query_vector_counts": [int(len(v)) for v in query_vectors],
        "query_first_vectors": [[round(float(x), 6) for x in np.asarray(v)[0]] for v in query_vectors],
    }
    (out / "reference.json").write_text(json.dumps(reference, separators=(",", ":")) + "\n")


def versions(*names: str) -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in names}


# -- inside: one builder per library ------------------------------------------------------------
def build_pylate(out: Path, arch: str) -> None:
    import torch
    from pylate import models, scores

    queries, doc_ids, passages = texts()
    with tempfile.TemporaryDirectory() as base:
        save_backbone(Path(base), arch, passages + queries)
        torch.manual_seed(SEED + 1)
        model = models.ColBERT(model_name_or_path=base, embedding_size=16, device="cpu")
        model.save(str(out))
    model = models.ColBERT(model_name_or_path=str(out), device="cpu")
    q = model.encode(queries, is_query=True, convert_to_tensor=False)
    d = model.encode(passages, is_query=False, convert_to_tensor=False)
    matrix = [[float(scores.colbert_scores(torch.as_tensor(qv)[None], torch.as_tensor(dv)[None])[0, 0]) for dv in d]
              for qv in q]
    write_reference(out, f"pylate {versions('pylate')['pylate']}", queries, doc_ids, matrix, q,
                    {**versions("pylate", "transformers", "sentence-transformers", "torch"), "arch": arch})


def build_st(out: Path, arch: str, prompts: bool = False, expansion: bool = False, pool: int = 0) -> None:
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling, MultiVectorMask

    queries, doc_ids, passages = texts()
    with tempfile.TemporaryDirectory() as base:
        save_backbone(Path(base), arch, passages + queries)
        torch.manual_seed(SEED + 1)
        if not (prompts or expansion or pool):  # the library's own default chain for a bare backbone
            model = MultiVectorEncoder(base, device="cpu", local_files_only=True)
        else:
            transformer = Transformer(base, document_length=96,
                                      query_expansion={"strategy": "fixed", "attend": False, "length": 24}
                                      if expansion else None, query_length=None if expansion else 24)
            modules: list[Any] = [transformer, Dense(in_features=HIDDEN, out_features=16, bias=False,
                                                     activation_function=torch.nn.Identity(),
                                                     module_input_name="token_embeddings"),
                                  MultiVectorMask(skiplist_words=PUNCTUATION)]
            if pool:
                modules.append(HierarchicalTokenPooling(pool_factor=pool))
            modules.append(Normalize(module_input_name="token_embeddings"))
            model = MultiVectorEncoder(modules=modules, device="cpu",
                                       prompts={"query": "query: ", "document": "passage: "} if prompts else None)
        model.save(str(out))
    model = MultiVectorEncoder(str(out), device="cpu", local_files_only=True)
    q = model.encode_query(queries)
    d = model.encode_document(passages)
    matrix = model.similarity(q, d).numpy()
    write_reference(out, f"sentence-transformers {versions('sentence-transformers')['sentence-transformers']}",
                    queries, doc_ids, matrix, [v.numpy() for v in q],
                    {**versions("sentence-transformers", "transformers", "torch"), "arch": arch, "prompts": prompts,
                     "expansion": expansion, "pool": pool})


def build_colbert_ai(out: Path, arch: str) -> None:
    import torch
    from colbert.infra import ColBERTConfig
    from colbert.modeling.checkpoint import Checkpoint
    from colbert.modeling.colbert import ColBERT

    queries, doc_ids, passages = texts()
    with tempfile.TemporaryDirectory() as base:
        save_backbone(Path(base), arch, passages + queries)
        torch.manual_seed(SEED + 1)
        config = ColBERTConfig(dim=16, query_maxlen=32, doc_maxlen=180, checkpoint=base)
        ColBERT(name=base, colbert_config=config).save(str(out))
    checkpoint = Checkpoint(str(out), colbert_config=ColBERTConfig(), verbose=0)
    with torch.inference_mode():
        q = checkpoint.queryFromText(queries, bsize=16)
        d, lengths = checkpoint.docFromText(passages, bsize=32, keep_dims="flatten", showprogress=False)
    q_vectors = [row.float() for row in q]
    docs, start = [], 0
    for length in (lengths.tolist() if hasattr(lengths, "tolist") else lengths):
        docs.append(d[start:start + length].float())
        start += length
    matrix = [[float((qv @ dv.T).max(1).values.sum()) for dv in docs] for qv in q_vectors]
    write_reference(out, f"colbert-ai {versions('colbert-ai')['colbert-ai']}", queries, doc_ids, matrix,
                    [v.numpy() for v in q_vectors], {**versions("colbert-ai", "transformers", "torch"), "arch": arch})


BUILDERS: dict[str, Callable[..., None]] = {"pylate": build_pylate, "st": build_st, "colbert_ai": build_colbert_ai}


def inside(name: str, out: Path) -> None:
    _, builder, options = FIXTURES[name]
    out.mkdir(parents=True, exist_ok=True)
    BUILDERS[builder](out, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="these fixtures (default: all)")
    parser.add_argument("--venvs", type=Path, default=Path.home() / ".cache" / "espn" / "fixture-venvs",
                        help="where the libraries' environments live (default ~/.cache/espn/fixture-venvs)")
    parser.add_argument("--out", type=Path, default=HERE, help="where the fixtures go (default: beside this script)")
    parser.add_argument("--list", action="store_true", help="list the fixtures and their libraries, and exit")
    parser.add_argument("--inside", choices=sorted(FIXTURES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        inside(args.inside, args.out)
        return 0
    if args.list:
        for name, (env, _, _) in FIXTURES.items():
            print(f"{name}: {ENVIRONMENTS[env][2]}")
        return 0
    failed = []
    for name in args.only or list(FIXTURES):
        try:
            make(name, args.venvs, args.out)
        except subprocess.CalledProcessError as exc:
            failed.append(name)
            print(f"{name}: failed ({exc})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
