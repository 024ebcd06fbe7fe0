"""Query encoding latency of each way espn can run a multi-vector checkpoint, per backbone.

    python -m benchmarks.bench_st_encoders                  # BERT-base and ModernBERT-base sized, 1 thread
    python -m benchmarks.bench_st_encoders --queries 50 --threads 2

Two seeded checkpoints of base size (no download): a BERT (768 hidden, 12 layers) and a
ModernBERT (768 hidden, 22 layers), each with MiniLM's WordPiece tokenizer, a Dense 768 -> 128,
query expansion to 32 tokens ([MASK], not attended) and a punctuation skiplist. Each is saved
twice with the same weights: in Sentence Transformers 6's own format (`MultiVectorEncoder.save`)
and in PyLate's format (read by espn's own loader, `espn.encoders.colbert`). Measured, one query
at a time over SciFact's test queries (shuffled, after a warm-up), in one process:

- `st-encode`: Sentence Transformers' own `MultiVectorEncoder.encode_query`;
- `espn-st-torch`: espn's Sentence Transformers loader (`espn.encoders.multivector`), torch;
- `espn-st-onnx`: the same, the backbone on ONNX Runtime (BERT-like backbones only);
- `espn-own-torch` / `espn-own-onnx`: espn's own PyLate loader on the PyLate copy.

Every path's vectors are checked against `encode_query` first (max |difference| in the table).
Writes benchmarks/results/st_encoders.json and prints the markdown table of
docs/benchmarks/query-latency.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import string
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .common import SCIFACT, machine, machine_line, markdown_table, percentiles, set_omp_env, write_results
from .make_colbert_checkpoint import write_checkpoint

DIM = 128
QUERY_LENGTH = 32
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def base_backbone(out: Path, arch: str, seed: int, tiny: bool = False) -> Path:
    """A base-sized seeded backbone with MiniLM's tokenizer, as a Hugging Face directory (tiny: 64
    hidden units and two layers, for smoke runs)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel, ModernBertConfig, ModernBertModel

    from espn.encoders.hf import default_model_dir

    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copy2(default_model_dir() / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    torch.manual_seed(seed)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if tiny else {}
    if arch == "bert":  # bert-base-uncased's shape
        model: Any = BertModel(BertConfig(vocab_size=len(tokenizer), **sizes))
    else:  # ModernBERT-base's shape
        ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.cls_token_id,
                   eos_token_id=tokenizer.sep_token_id, cls_token_id=tokenizer.cls_token_id,
                   sep_token_id=tokenizer.sep_token_id)
        model = ModernBertModel(ModernBertConfig(vocab_size=len(tokenizer), **sizes, **ids))
    model.save_pretrained(str(out))
    return out


def _sentence_transformers_save(out: Path, base: Path, linear: Any) -> Path:
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    transformer = Transformer(str(base), document_length=180,
                              query_expansion={"strategy": "fixed", "attend": False, "length": QUERY_LENGTH})
    dense = Dense(in_features=linear.shape[1], out_features=linear.shape[0], bias=False,
                  activation_function=torch.nn.Identity(), init_weight=linear, module_input_name="token_embeddings")
    model = MultiVectorEncoder(modules=[transformer, dense, MultiVectorMask(skiplist_words=list(string.punctuation)),
                                        Normalize(module_input_name="token_embeddings")],
                               prompts={"query": "[unused0] ", "document": "[unused1] "}, device="cpu")
    model.save(str(out))
    return out


def _time_interleaved(encoders: dict[str, Callable[[str], Any]], queries: list[str], warmup: int,
                      seed: int = 0) -> dict[str, list[float]]:
    """ms per query of each path, the paths taken in a shuffled order for every query: on a shared
    machine a burst of load then falls on every path alike, and the ratios hold."""
    for text in queries[:warmup]:
        for encode in encoders.values():
            encode(text)
    times: dict[str, list[float]] = {name: [] for name in encoders}
    order = list(encoders)
    rng = random.Random(seed)
    for text in queries:
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            encoders[name](text)
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def _vectors(encoder: Any, text: str) -> np.ndarray:
    q = encoder.encode_queries([text])
    return q.bow[0][q.mask[0]]


def measure(arch: str, work: Path, queries: list[str], warmup: int) -> list[dict[str, Any]]:
    from sentence_transformers import MultiVectorEncoder

    from benchmarks.make_colbert_checkpoint import seeded_projection
    from espn.encoders.colbert import ColBERTEncoder
    from espn.encoders.multivector import SentenceTransformersEncoder

    base = base_backbone(work / f"{arch}-base", arch, seed=0)
    linear = seeded_projection(768, DIM, seed=1)
    native = _sentence_transformers_save(work / f"{arch}-st", base, linear)
    pylate = write_checkpoint(work / f"{arch}-pylate", fmt="pylate", dim=DIM, seed=1, source=base)
    settings = json.loads((pylate / "config_sentence_transformers.json").read_text())
    settings.update(query_length=QUERY_LENGTH, document_length=180)
    (pylate / "config_sentence_transformers.json").write_text(json.dumps(settings))

    reference = MultiVectorEncoder(str(native), device="cpu", local_files_only=True)
    probe = queries[0]
    # Each path against Sentence Transformers' encode of the checkpoint it loads.
    expected = {native: reference.encode_query([probe])[0].numpy(),
                pylate: MultiVectorEncoder(str(pylate), device="cpu", local_files_only=True).encode_query([probe])[0]
                .numpy()}
    paths: list[tuple[str, Path, Callable[[], Any]]] = [
        ("espn-st-torch", native, lambda: SentenceTransformersEncoder(native, device="cpu", query_backend="torch")),
        ("espn-st-onnx", native, lambda: SentenceTransformersEncoder(native, device="cpu", query_backend="onnx")),
        ("espn-own-torch", pylate, lambda: ColBERTEncoder(pylate, device="cpu", query_backend="torch")),
        ("espn-own-onnx", pylate, lambda: ColBERTEncoder(pylate, device="cpu", query_backend="onnx")),
    ]
    rows: list[dict[str, Any]] = []
    encoders: dict[str, Callable[[str], Any]] = {"st-encode": lambda t: reference.encode_query([t])}
    differences = {"st-encode": 0.0}
    for name, checkpoint, make in paths:
        try:
            encoder = make()
            got = _vectors(encoder, probe)
        except Exception as exc:  # noqa: BLE001  # a backend this backbone cannot run is a row, not a crash
            reason = str(exc).splitlines()[0].split(": ", 1)[-1].split(" (")[0]  # "the ONNX export takes ..."
            logging.warning("%s %s: %s", arch, name, reason)
            rows.append({"model": arch, "backend": name, "max_diff": float("nan"), "skipped": reason,
                         **percentiles([])})
            continue
        want = expected[checkpoint]
        differences[name] = float(np.abs(got - want).max()) if got.shape == want.shape else float("inf")
        encoders[name] = (lambda e: lambda t: e.encode_queries([t]))(encoder)
    for name, times in _time_interleaved(encoders, queries, warmup).items():
        rows.append({"model": arch, "backend": name, "max_diff": differences[name], **percentiles(times)})
    order = ["st-encode"] + [name for name, _, _ in paths]
    rows.sort(key=lambda r: order.index(r["backend"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=100, help="queries timed per path (SciFact test, shuffled)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime intra-op threads")
    parser.add_argument("--models", default="bert,modernbert")
    parser.add_argument("--work", type=Path, help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args()
    set_omp_env()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import torch

    torch.set_num_threads(args.threads)
    texts = [json.loads(line)["text"] for line in (SCIFACT / "queries.jsonl").open()]
    random.Random(0).shuffle(texts)
    queries = texts[: args.queries]
    info = machine()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-st-") as tmp:
        work = args.work or Path(tmp)
        os.environ["HOME"] = str(work / "onnx-home")  # a fresh ONNX graph cache: every graph is exported and checked here
        for arch in args.models.split(","):
            rows += measure(arch, work, queries, args.warmup)
            if args.work is None:
                for path in work.glob(f"{arch}-*"):
                    shutil.rmtree(path, ignore_errors=True)
    print(machine_line(info))
    print(f"{len(queries)} SciFact test queries one at a time, {args.threads} thread(s), "
          f"query length {QUERY_LENGTH} (expansion), Dense 768 -> 128")
    print(markdown_table(["model", "backend", "mean ms", "p50 ms", "p99 ms", "max |diff| vs encode_query"],
                         [[r["model"], r["backend"] + (f" (not run: {r['skipped']})" if "skipped" in r else ""),
                           r["mean"], r["p50"], r["p99"], r["max_diff"]] for r in rows]))
    write_results("st_encoders", {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})


if __name__ == "__main__":
    main()
