"""The query encoder's transformer on ONNX Runtime: the same weights, 2-3x less time per query.

Measured on SciFact's test queries one at a time (21 tokens on average, one core of the
2-vCPU EPYC, `python -m benchmarks.bench_query`): MiniLM-L6 through torch eager takes
16-19 ms, most of it per-op dispatch overhead (six layers of small matmuls); the same
weights as an ONNX graph on ONNX Runtime take 6-7 ms, and the hidden states agree to
2e-6 (nDCG@10 unchanged to four places). The graph stays fp32 unless the encoder's precision
is int8 (opt-in, within a quality budget: espn.encoders.int8, `int8_graph` here). BERT-like
backbones take token types (fed as zeros); ModernBERT and its kin take ids and mask only.

The graph is exported from the encoder's own torch module (`torch.onnx.export`, the
TorchScript exporter: no download, no network) the first time a process needs it, and
cached under `cache_dir` keyed by the weights' sha256 and the exporting versions, so the
next process (or worker) loads it in milliseconds, without loading the torch model at
all. Where the cache cannot be written (a read-only container) the graph is exported into
memory instead. Before a new graph is used or cached, one padded probe batch is run
through both torch and the graph: a graph that disagrees is neither used nor cached (the
encoder stays on torch, with a warning).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import logging
import os
import tempfile
import threading
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import InvalidParameterError
from .int8 import Fidelity, int8_refusal, measure_fidelity, quantized_graph_bytes

__all__ = ["OnnxEncoderGraph", "QueryGraphOwner", "checked_query_graph", "int8_graph", "onnx_unavailable_reason",
           "default_cache_dir", "GRAPH_TOLERANCE"]

log = logging.getLogger(__name__)

#: Largest |difference| of a hidden-state element allowed between the graph and torch on
#: the probe batch (measured: 2e-6; fp32 summation order is all that differs).
GRAPH_TOLERANCE = 1e-4
#: Bumped when the exported graph's inputs, outputs or settings change.
_GRAPH_FORMAT = 2  # 2: a cached graph has passed the check against torch
_OPSET = 17


def onnx_unavailable_reason() -> str | None:
    """Why the ONNX Runtime path cannot run here (with the install command), or None."""
    for module in ("onnxruntime", "onnx"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install onnxruntime onnx)"
    return None


def default_cache_dir() -> Path:
    """Where exported graphs are kept between processes: ~/.cache/espn/onnx."""
    return Path.home() / ".cache" / "espn" / "onnx"


def _backbone_inputs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, Any]:
    """The keyword inputs of `model`'s forward: ids and mask, and token types 0 where the backbone
    takes them (BERT-like); ModernBERT and its kin take none."""
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        inputs["token_type_ids"] = torch.zeros_like(input_ids)
    return inputs


class _HiddenStates(torch.nn.Module):
    """input_ids, attention_mask [B, T] int64 -> last hidden state [B, T, H] (token types 0 where taken)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(**_backbone_inputs(self.model, input_ids, attention_mask)).last_hidden_state


def _export(model: torch.nn.Module, out: Any) -> None:
    """Trace `model` into an ONNX graph written to `out` (a path or a binary file)."""
    wrapped = _HiddenStates(model).eval()
    # A padded batch of two, so the trace takes the general (masked) attention path.
    ids = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]], dtype=torch.int64)
    ids = ids % int(getattr(model.config, "vocab_size", 30522))  # ids the model has (a small vocabulary)
    mask = (ids != 0).to(torch.int64)
    axes = {0: "batch", 1: "tokens"}
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes on Python-level conditions
        torch.onnx.export(wrapped, (ids, mask), out, input_names=["input_ids", "attention_mask"],
                          output_names=["hidden"], dynamic_axes={"input_ids": axes, "attention_mask": axes,
                                                                 "hidden": axes},
                          opset_version=_OPSET, dynamo=False)


def _cache_key(weights_sha256: str) -> str:
    """The weights, what turned them into a graph and the runtime that checked it."""
    versions = ":".join([weights_sha256, torch.__version__, version("transformers"), version("onnxruntime"),
                         str(_GRAPH_FORMAT), str(_OPSET)])
    return hashlib.sha256(versions.encode()).hexdigest()[:24]


class OnnxEncoderGraph:
    """A Hugging Face encoder's transformer as an ONNX Runtime session: ids -> hidden states.

    source: the graph's path or bytes. threads: intra-op threads (the server sizes torch's per
    worker; pass the same). The pool does not spin between calls: on a small machine a
    spinning pool steals the core that FAISS and the read engine need.
    """

    def __init__(self, source: str | bytes, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, int(threads))
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        self.threads = options.intra_op_num_threads
        self.cached = False  # True once the graph is in (or came from) the cache
        self.source = source  # what int8_graph quantises
        self.precision = "fp32"
        self._session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] ids and mask -> [B, T, H] float32 last hidden state (a CPU tensor)."""
        feeds = {"input_ids": input_ids.numpy().astype(np.int64, copy=False),
                 "attention_mask": attention_mask.numpy().astype(np.int64, copy=False)}
        (hidden,) = self._session.run(None, feeds)
        return torch.from_numpy(hidden)

    def max_difference(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       positions: torch.Tensor | None = None) -> float:
        """Largest |graph - torch| over the hidden states of one batch at `positions` [B, T] bool
        (default: the unmasked ones; ColBERT queries also keep their unattended expansion tokens)."""
        with torch.inference_mode():
            expected = model(**_backbone_inputs(model, input_ids, attention_mask)).last_hidden_state
        got = self.hidden_states(input_ids, attention_mask)
        valid = attention_mask.bool() if positions is None else positions.bool()
        return float((got - expected.float()).abs()[valid].max())


class QueryGraphOwner:
    """What an encoder with an ONNX path shares: its graph, made once on first use by its
    `_make_graph` (None there: it runs on torch), however many threads ask at once, and its
    precision: with int8 (espn.encoders.int8) the graph is the quantised one, measured against the
    fp32 graph through the encoder's `_kept_vectors` and used for documents as well as queries.
    The encoder sets `_graph = None`, `_graph_lock` and `precision` in its __init__."""

    _graph: Any
    _graph_lock: threading.Lock
    name: str
    #: "fp32", "int8" or "int8-unchecked" (espn.encoders.int8.PRECISIONS).
    precision: str = "fp32"
    #: The int8 graph's measurement, once made; why it was refused (queries then run in fp32).
    int8_fidelity: Fidelity | None = None
    int8_refused: str | None = None

    def _make_graph(self) -> Any:
        raise NotImplementedError

    def _kept_vectors(self, texts: Sequence[str], is_query: bool, graph: Any) -> list[np.ndarray]:
        """Each text's vectors as the encoder keeps them, its backbone run on `graph`."""
        raise NotImplementedError

    def _query_graph(self) -> Any:
        """The ONNX Runtime graph for queries, made on first use; None where queries run on torch."""
        if self._graph is None:
            with self._graph_lock:
                if self._graph is None:
                    self._graph = self._with_precision(self._make_graph()) or False
        return self._graph or None

    def describe(self) -> str:
        """How queries are encoded: the backend, its precision and threads."""
        graph = self._query_graph()
        if graph is None:
            return f"{self.name}: torch {torch.__version__}, {torch.get_num_threads()} threads"
        import onnxruntime  # loaded already: the graph runs on it

        return f"{self.name}: onnxruntime {onnxruntime.__version__} {graph.precision}, {graph.threads} threads"

    def _document_graph(self) -> Any:
        """The graph documents run on: the int8 one where the encoder is int8, else None (torch)."""
        graph = self._query_graph() if self.precision != "fp32" else None
        return graph if graph is not None and graph.precision == "int8" else None

    def _with_precision(self, graph: "OnnxEncoderGraph | None") -> "OnnxEncoderGraph | None":
        if graph is None or self.precision == "fp32":
            return graph
        int8, self.int8_fidelity = int8_graph(graph, lambda reference, candidate: measure_fidelity(
            self._kept_vectors, reference, candidate))
        self.int8_refused = int8_refusal(self.int8_fidelity, self.precision, self.name)
        if self.int8_refused is None:
            log.info("%s: int8 encoder, %s", self.name, self.int8_fidelity.to_json())
            return int8
        log.warning("%s; encoding in fp32", self.int8_refused)
        return graph

    def prepare_precision(self) -> None:
        """Make the graph now and refuse (InvalidParameterError, one line) an int8 encoder that has no
        ONNX graph or measures below the budget: what `espn index --encoder-precision int8` runs first."""
        if self.precision == "fp32":
            return
        graph = self._query_graph()
        if graph is None:
            raise InvalidParameterError(f"{self.name}: precision {self.precision!r} needs the ONNX graph, which "
                                        "this encoder does not have here (see the log)")
        if self.int8_refused is not None:
            raise InvalidParameterError(self.int8_refused)

    def precision_config(self) -> dict[str, Any]:
        """The manifest's record of the precision: nothing for fp32, else it and the measurement."""
        if self.precision == "fp32":
            return {}
        return {"precision": self.precision,
                **({"int8_fidelity": self.int8_fidelity.to_json()} if self.int8_fidelity is not None else {})}


def int8_graph(fp32: OnnxEncoderGraph, measure: Callable[[OnnxEncoderGraph, OnnxEncoderGraph], Fidelity]
               ) -> tuple[OnnxEncoderGraph, Fidelity]:
    """`fp32` quantised to int8 (espn.encoders.int8) and its fidelity from `measure(fp32, int8)`. A
    cached fp32 graph's int8 twin and its measurement are cached beside it (`-int8.onnx`, `-int8.json`,
    the measurement written first, the graph renamed into place after it) and used as they are."""
    path = Path(fp32.source) if isinstance(fp32.source, str) else None
    twin = path.with_name(f"{path.stem}-int8.onnx") if path is not None else None
    record = twin.with_suffix(".json") if twin is not None else None
    if twin is not None and record is not None and twin.is_file() and record.is_file():
        with contextlib.suppress(OSError, ValueError):
            fidelity = Fidelity.from_json(json.loads(record.read_text()))
            if fidelity is not None:
                graph = OnnxEncoderGraph(str(twin), fp32.threads)
                graph.cached, graph.precision = True, "int8"
                return graph, fidelity
    data = quantized_graph_bytes(fp32.source)
    graph = OnnxEncoderGraph(data, fp32.threads)
    graph.precision = "int8"
    fidelity = measure(fp32, graph)
    if twin is not None and record is not None:
        try:
            record.write_text(json.dumps(fidelity.to_json()))
            fd, tmp = tempfile.mkstemp(dir=twin.parent, prefix=twin.name, suffix=".tmp")
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, twin)
            graph.cached = True
        except OSError as exc:
            log.info("cannot cache the int8 graph in %s (%s); it stays in memory", twin.parent, exc.strerror)
    return graph, fidelity


def checked_query_graph(load_model: Callable[[], torch.nn.Module], name: str, query_backend: str, device: str,
                        weights_sha256: str, threads: int, cache_dir: Path | None, probe: Any,
                        refusal: str | None = None) -> OnnxEncoderGraph | None:
    """The encoder's backbone on ONNX Runtime for queries, or None where queries run on torch:
    a GPU, `query_backend="torch"`, ONNX unavailable, `refusal` (why this backbone cannot be
    exported), a failed export or a graph that differs. With `query_backend="onnx"` each of
    these raises instead of falling back.

    A graph enters the cache only after it agreed with torch on `probe` (a tokenised batch:
    input_ids, attention_mask and optionally `keep`, the positions compared), so a cached graph
    is used as it is and `load_model` is not called: a server whose graph is cached never loads
    the torch model unless it writes."""
    if query_backend == "torch" or (query_backend == "auto" and not device.startswith("cpu")):
        return None
    reason = onnx_unavailable_reason() or refusal
    if reason is not None:
        if query_backend == "onnx":
            raise InvalidParameterError(f"query_backend='onnx': {reason}")
        log.info("queries are encoded with torch: %s", reason)
        return None
    path = Path(cache_dir or default_cache_dir()) / f"hidden-{_cache_key(weights_sha256)}.onnx"
    try:
        graph = _cached_graph(path, threads) or _exported_and_checked(load_model(), name, path, threads, probe)
    except Exception:
        if query_backend == "onnx":
            raise
        log.warning("could not build the ONNX graph of %s; queries are encoded with torch", name, exc_info=True)
        return None
    if graph is not None:
        log.info("queries are encoded with ONNX Runtime (%d threads, graph %s)", graph.threads,
                 "cached" if graph.cached else "in memory")
    return graph


def _cached_graph(path: Path, threads: int) -> OnnxEncoderGraph | None:
    """The cached graph (checked before it was cached), or None when there is none or it cannot load."""
    if not path.is_file():
        return None
    try:
        graph = OnnxEncoderGraph(str(path), threads)
    except Exception as exc:  # a damaged file: export again, which replaces it
        log.warning("cannot load the cached ONNX graph %s (%s); exporting it again", path, exc)
        return None
    graph.cached = True
    return graph


def _exported_and_checked(model: torch.nn.Module, name: str, path: Path, threads: int,
                          probe: Any) -> OnnxEncoderGraph | None:
    """Export into a temporary file beside `path` (into memory where it cannot be written),
    compare with torch on `probe`, and move the file into the cache only if they agree."""
    tmp: str | None = None
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        except OSError as exc:
            log.info("cannot cache the ONNX graph in %s (%s); exporting it into memory", path.parent, exc.strerror)
            buffer = io.BytesIO()
            _export(model, buffer)
            source: str | bytes = buffer.getvalue()
        else:
            with os.fdopen(fd, "wb") as file:
                _export(model, file)
                file.flush()
                os.fsync(file.fileno())
            source = tmp
        graph = OnnxEncoderGraph(source, threads)
        difference = graph.max_difference(model, probe["input_ids"], probe["attention_mask"], probe.get("keep"))
        if difference > GRAPH_TOLERANCE:
            log.warning("the ONNX graph of %s differs from torch by %.2g (> %.0e); queries are encoded with torch",
                        name, difference, GRAPH_TOLERANCE)
            return None
        if tmp is not None:
            os.chmod(tmp, 0o644)  # mkstemp made it private; other workers' users read it too
            os.replace(tmp, path)  # concurrent exporters write identical bytes; one rename wins
            tmp = None
            graph.cached, graph.source = True, str(path)
            log.info("exported the query encoder's ONNX graph to %s", path)
        return graph
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
