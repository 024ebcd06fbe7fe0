"""Int8 encoders on a CPU: the ONNX graph dynamically quantised, used only within a quality budget.

Opt-in (`espn index --encoder-precision int8`, recorded in the manifest): the backbone's ONNX graph
(espn.encoders.onnx, already checked against torch) is quantised by ONNX Runtime (int8 weights in
blocks, activations quantised dynamically, per block, at run time), and queries and documents
run through it (`quantized_graph_bytes`). Quantisation moves the vectors, so before the int8 graph is used its fidelity is
measured on a fixed probe: the sample queries and the first `PROBE_DOCUMENTS` sample passages
bundled with espn, each encoded through the fp32 graph and through the int8 one, ranked by the
model's own MaxSim; the fidelity is the mean share of the fp32 top 10 that the int8 top 10 keeps
(and the mean cosine of the token vectors, for the record). Below `INT8_MIN_OVERLAP` the int8
encoder is refused: `espn index` stops with the measurement, and an index whose int8 graph measures
below the budget when it is opened (another ONNX Runtime) encodes its queries in fp32, with a
warning. `int8-unchecked` accepts any measurement (it is still measured and recorded).

The measurement is cached beside the int8 graph (`hidden-<key>-int8.json`), keyed like the graph
by the weights and the versions that made it, so it is taken once per model and machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..choices import INT8_MIN_OVERLAP, PRECISIONS
from ..errors import InvalidParameterError

__all__ = ["PRECISIONS", "INT8_MIN_OVERLAP", "PROBE_DOCUMENTS", "QUANT_BLOCK", "loaded_precision", "Fidelity", "quantized_graph_bytes", "probe_texts",
           "measure_fidelity", "int8_refusal", "check_precision"]

#: Sample passages in the probe (espn/data/sample_corpus.jsonl); every sample query is a probe query.
PROBE_DOCUMENTS = 100
log = logging.getLogger(__name__)

_DATA = Path(__file__).resolve().parents[1] / "data"
_PROBE_BATCH = 16
#: Input values per int8 weight block (and per run-time activation block) of a quantised MatMul.
QUANT_BLOCK = 32


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """The int8 encoder against the fp32 one on the probe: mean top-10 overlap and mean token cosine."""

    overlap: float
    cosine: float
    queries: int
    documents: int

    def to_json(self) -> dict[str, Any]:
        return {"top10_overlap": round(self.overlap, 4), "token_cosine": round(self.cosine, 5),
                "probe_queries": self.queries, "probe_documents": self.documents}

    @classmethod
    def from_json(cls, found: Any) -> "Fidelity | None":
        try:
            return cls(float(found["top10_overlap"]), float(found["token_cosine"]), int(found["probe_queries"]),
                       int(found["probe_documents"]))
        except (KeyError, TypeError, ValueError):
            return None


def check_precision(precision: str, device: str, query_backend: str) -> None:
    """Refuse a precision that is not in PRECISIONS, or int8 where no ONNX graph runs (a GPU, torch queries)."""
    if precision not in PRECISIONS:
        raise InvalidParameterError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "fp32" and not device.startswith("cpu"):
        raise InvalidParameterError(f"precision {precision!r} is a CPU path (ONNX Runtime); the device is {device}")
    if precision != "fp32" and query_backend == "torch":
        raise InvalidParameterError(f"precision {precision!r} runs the ONNX graph; query_backend='torch' has none")


def loaded_precision(config: Any, device: str | None) -> str:
    """The precision an index's encoder opens with: the manifest's, except on a GPU (int8 is a CPU
    path), where it is fp32 with a warning rather than an index that does not open."""
    import torch

    precision = str(config.get("precision", "fp32")) if hasattr(config, "get") else "fp32"
    where = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if precision != "fp32" and not where.startswith("cpu"):
        log.warning("the index's encoder is %s on a CPU; on %s it encodes in fp32", precision, where)
        return "fp32"
    return precision


def quantized_graph_bytes(source: str | bytes) -> bytes:
    """The fp32 graph at `source` (a path or its bytes) with the weights of its MatMuls in int8, in blocks
    of QUANT_BLOCK along the input (ONNX Runtime's MatMulNBits, 8 bits, symmetric), the activations
    quantised per block at run time (accuracy level 4: int8 products). Per-tensor activations
    (`quantize_dynamic`) lose much more: MiniLM as a ColBERT checkpoint kept 0.62 of the fp32 top 10
    on the probe (0.81 with per-channel weights), blocks of 32 keep 0.96."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source)
    quantizer = MatMulNBitsQuantizer(model, bits=8, block_size=QUANT_BLOCK, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "int8.onnx"
        onnx.save(quantizer.model.model, str(out))
        return out.read_bytes()


def probe_texts() -> tuple[list[str], list[str]]:
    """(queries, passages) of the probe: every sample query, the first PROBE_DOCUMENTS sample passages."""
    queries = [json.loads(line)["text"] for line in (_DATA / "sample_queries.jsonl").read_text().splitlines()
               if line.strip()]
    passages = []
    for line in (_DATA / "sample_corpus.jsonl").read_text().splitlines()[:PROBE_DOCUMENTS]:
        row = json.loads(line)
        passages.append(f"{row['title']} {row['text']}" if row.get("title") else row["text"])
    return queries, passages


def _maxsim(queries: list[np.ndarray], documents: list[np.ndarray]) -> np.ndarray:
    """[Q, D] sum over each query's vectors of the best dot product with the document's."""
    return np.array([[float((q @ d.T).max(1).sum()) if len(d) and len(q) else 0.0 for d in documents]
                     for q in queries])


def measure_fidelity(encode: Callable[[Sequence[str], bool, Any], list[np.ndarray]], reference: Any,
                     candidate: Any) -> Fidelity:
    """`encode(texts, is_query, graph)` -> each text's kept vectors; the probe through `reference` (the
    fp32 graph) and `candidate` (the int8 one), compared by the top 10 of MaxSim and the token cosines."""
    queries, passages = probe_texts()
    ranked = []
    cosines = []

    def batched(texts: list[str], is_query: bool, graph: Any) -> list[np.ndarray]:
        return [vectors for start in range(0, len(texts), _PROBE_BATCH)
                for vectors in encode(texts[start:start + _PROBE_BATCH], is_query, graph)]

    for graph in (reference, candidate):
        ranked.append((batched(queries, True, graph), batched(passages, False, graph)))
    for ours, theirs in zip(ranked[0][0] + ranked[0][1], ranked[1][0] + ranked[1][1]):
        if len(ours):
            cosines.append(float(np.mean(np.sum(ours * theirs, 1) / (np.linalg.norm(ours, axis=1)
                                                                     * np.linalg.norm(theirs, axis=1) + 1e-12))))
    k = min(10, len(passages))
    tops = [np.argsort(-_maxsim(q, d), axis=1, kind="stable")[:, :k] for q, d in ranked]
    overlap = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(tops[0].tolist(), tops[1].tolist())]))
    return Fidelity(overlap=overlap, cosine=float(np.mean(cosines)), queries=len(queries), documents=len(passages))


def int8_refusal(fidelity: Fidelity, precision: str, name: str) -> str | None:
    """Why `name`'s int8 encoder is refused (one line), or None where it is within the budget or unchecked."""
    if precision != "int8" or fidelity.overlap >= INT8_MIN_OVERLAP:
        return None
    return (f"{name}: the int8 encoder keeps {fidelity.overlap:.3f} of the fp32 top 10 on the probe ({fidelity.queries} "
            f"sample queries, {fidelity.documents} passages), below the budget {INT8_MIN_OVERLAP}; refused "
            "(--encoder-precision int8-unchecked accepts it, fp32 keeps the exact vectors)")
