"""Page images: ColPali-class checkpoints (ColPali, ColQwen2, ColModernVBert), encoded by Sentence Transformers 6.

A visual checkpoint is a Sentence Transformers `MultiVectorEncoder` save whose Transformer
module takes images (`modality_config` with an `image` entry; `espn.encoders.st_format.is_visual_save`),
or a transformers-native `*ForRetrieval` directory that the library reads the same way. It is
loaded as `espn.encoders.multivector` loads text checkpoints (the model directory checked as data
first, no remote code unless allowed, offline), and encodes exactly as the library does:

- queries are text, through the model's processor and forward (`encode_query`);
- documents are pages, PIL images through the processor and forward (`encode_document` on
  images): one vector per image patch plus the visual prompt's tokens, as many as the library
  gives (ColPali at 448 px: 1,024 patches and 6 prompt tokens);
- text documents are refused: the processor of these models renders any text as a query.

The stored CLS vector is the normalised mean of a page's vectors, for the first stage only; the
score is the model's MaxSim. On a GPU the model runs under autocast in bfloat16 where the card has
it, else float16 (that path cannot run on the CPU-only test machines: it is exercised by
benchmarks/bench_gpu.py style runs only); on a CPU in float32, identical to the library's encode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from sentence_transformers.util import batch_to_device

from ..errors import InvalidParameterError
from ..pages.grids import PageGrid, unknown_grids
from .base import DocumentEmbeddings, Encoder, trimmed_span
from .multivector import SentenceTransformersEncoder
from .st_format import is_visual_save

__all__ = ["VisualEncoder", "TEXT_DOCUMENTS_REFUSED"]

TEXT_DOCUMENTS_REFUSED = ("a visual index takes pages: give a folder of images or PDFs, a PDF, or a JSONL of "
                          "{\"_id\", \"image\"} records, not text documents (a ColPali-class model reads any text "
                          "as a query)")


_UNKNOWN = object()


class VisualEncoder(SentenceTransformersEncoder):
    """Text queries and page images through one ColPali-class model, as its library encodes them.

    encode_queries(texts)  -> QueryEmbeddings  (bow [B, L, d] float32, mask [B, L])
    encode_pages(images)   -> DocumentEmbeddings (bow [sum(counts), d] float32, one row per patch
                              or prompt vector of each page; cls [n, d] the normalised mean)
    """

    kind = "visual"
    #: What the build reads for this encoder: pages, not passages (indexing.build checks it).
    modality = "image"

    def __init__(self, checkpoint_dir: str | Path, device: str | None = None, name: str | None = None,
                 query_backend: str = "torch", weights_sha256: str | None = None,
                 trust_remote_code: bool = False) -> None:
        """As SentenceTransformersEncoder; query_backend is always "torch" (the ONNX export takes
        BERT-like text backbones only)."""
        if not is_visual_save(checkpoint_dir):
            raise InvalidParameterError(f"visual: {checkpoint_dir} is not a checkpoint whose documents are images "
                                        "(a Sentence Transformers save with an image modality, or a transformers "
                                        "*ForRetrieval model)")
        del query_backend
        super().__init__(checkpoint_dir, device=device, name=name, query_backend="torch",
                         weights_sha256=weights_sha256, trust_remote_code=trust_remote_code)
        # bf16 keeps fp32's range (no overflow in the vision tower); fp16 where the card lacks it.
        self._grid: object = _UNKNOWN  # page_grid(), found on first use
        self.autocast_dtype = (torch.bfloat16 if self.device.startswith("cuda") and torch.cuda.is_bf16_supported()
                               else torch.float16)

    @classmethod
    def from_pretrained(cls, location: str | Path, device: str | None = None, trust_remote_code: bool = False,
                        precision: str = "fp32") -> "VisualEncoder":
        """precision: fp32 only (a page model has no ONNX path)."""
        if precision != "fp32":
            raise InvalidParameterError(f"visual: a page model has no ONNX path; precision {precision!r} is refused "
                                        "(fp32 only)")
        path, _, query = str(location).partition("?")
        if query:
            raise InvalidParameterError(f"visual: {path} is a Sentence Transformers save, whose settings are its own; "
                                        f"drop ?{query}")
        return cls(Path(path), device=device, trust_remote_code=trust_remote_code)

    # -- preprocessing ---------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], is_query: bool) -> Mapping[str, Any]:
        if not is_query:
            raise InvalidParameterError(TEXT_DOCUMENTS_REFUSED)
        features = dict(super().tokenize(texts, is_query=True))
        features.pop("truncated", None)  # the processor reads a query whole (espn.search.long_queries)
        return features

    def batch_order(self, texts: Sequence[str]) -> list[int]:
        # Pages come as images (the build batches them in corpus order, indexing.pages): no text to bucket.
        return list(range(len(texts)))

    def preprocess_pages(self, images: Sequence[Image.Image]) -> Mapping[str, Any]:
        """The processor's output for a batch of pages (pixel values, the visual prompt's ids), as
        `encode_document` makes it; picklable, so it may run in a loader worker."""
        if not images:
            raise InvalidParameterError("encode_pages needs at least one page")
        for image in images:
            if not isinstance(image, Image.Image):
                raise InvalidParameterError(f"a page must be a PIL image, got {type(image).__name__}")
        features = dict(self.model.preprocess([image.convert("RGB") if image.mode != "RGB" else image
                                               for image in images],
                                              prompt=self.prompts["document"], task="document"))
        features["task"] = "document"
        return features

    # -- model -----------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, tokens: Mapping[str, Any], graph: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> vectors [B, T, D] float32, keep [B, T] bool (the scoring mask the pipeline leaves)."""
        del graph  # queries run on torch
        task = str(tokens["task"])
        features = batch_to_device({k: v for k, v in tokens.items() if k not in ("task", "truncated")},
                                   torch.device(self.device))
        with torch.autocast("cuda", dtype=self.autocast_dtype, enabled=self.device.startswith("cuda")):
            features = self.model(features, task=task)
        return features["token_embeddings"].float(), features["attention_mask"].bool()

    def embed_pages(self, features: Mapping[str, Any]) -> DocumentEmbeddings:
        """Vectors of pages preprocessed by `preprocess_pages`."""
        if features.get("task") != "document" or "pixel_values" not in features:
            raise InvalidParameterError(TEXT_DOCUMENTS_REFUSED)
        vectors, keep = self._run(features)
        return DocumentEmbeddings(cls=self._mean_cls(vectors, keep), bow=vectors[keep].cpu().numpy(),
                                  counts=keep.sum(1).to(torch.int32).cpu().numpy(),
                                  grids=self._page_grids(features, keep.cpu()))

    def embed_documents(self, tokens: Mapping[str, Any]) -> DocumentEmbeddings:
        return self.embed_pages(tokens)

    def encode_documents(self, texts: Sequence[str]) -> DocumentEmbeddings:
        raise InvalidParameterError(TEXT_DOCUMENTS_REFUSED)

    def encode_pages(self, images: Sequence[Image.Image]) -> DocumentEmbeddings:
        """Page images -> their patch vectors, as `MultiVectorEncoder.encode_document(images)` gives them."""
        return self.embed_pages(self.preprocess_pages(images))

    # -- explanations ----------------------------------------------------------------
    # No text spans for a page: its vectors are patches, explained by their place in the patch grid
    # (`page_grid`, espn.search.explain.explain_pages); the query side by `query_tokens`.
    vector_spans = Encoder.vector_spans  # type: ignore[assignment]
    vector_labels = Encoder.vector_labels  # type: ignore[assignment]

    def page_grid(self) -> PageGrid | None:
        """The one grid every page of this model has, for pages stored without their own
        (`espn.pages.images`: an index written before grids were kept); None when pages differ
        (ColQwen's dynamic resolution) or hold no single grid. Found once from a blank page."""
        if self._grid is _UNKNOWN:
            features = self.preprocess_pages([Image.new("RGB", (64, 64), (255, 255, 255))])
            ids = features.get("input_ids")
            if "image_grid_thw" in features or not isinstance(ids, torch.Tensor):
                self._grid = None
            else:
                keep = features.get("attention_mask", torch.ones_like(ids)).bool()
                self._grid = PageGrid.from_row(self._page_grids(features, keep)[0])
        return self._grid  # type: ignore[return-value]

    def _page_grids(self, features: Mapping[str, Any], keep: torch.Tensor) -> np.ndarray:
        """[B, 4] int32 (espn.pages.grids.GRID_FIELDS) of pages preprocessed into `features`, whose
        kept vectors are `keep` [B, T]: the kept positions holding the image token are the
        patches, row-major as the vision tower emits them, contiguous. Their grid is the
        processor's `image_grid_thw` after the tower's merge (ColQwen: rows and columns differ
        from page to page), else the square of their count (ColPali). Zeros for a page whose
        image tokens are not one such grid (tiled models such as ColModernVBert)."""
        processor = getattr(self.model[0], "processor", None)
        image_token = getattr(processor, "image_token_id", None)
        ids = features.get("input_ids")
        out = unknown_grids(len(keep))
        if image_token is None or not isinstance(ids, torch.Tensor) or tuple(ids.shape) != tuple(keep.shape):
            return out
        patch = (ids.to(keep.device) == int(image_token)) & keep
        count = patch.sum(1)
        place = keep.cumsum(1) - 1  # a position's index among the stored vectors
        first = torch.where(patch, place, place.new_full((), keep.shape[1])).amin(1)
        last = torch.where(patch, place, place.new_full((), -1)).amax(1)
        thw = features.get("image_grid_thw")
        if thw is None:
            rows = columns = count.double().sqrt().round().long()
        else:
            merge = getattr(getattr(processor, "image_processor", None), "merge_size", None)
            if merge is None or tuple(thw.shape) != (len(keep), 3) or bool((thw[:, 0] != 1).any()):
                return out
            rows, columns = thw[:, 1] // int(merge), thw[:, 2] // int(merge)
        fits = (count > 0) & (rows * columns == count) & (last - first + 1 == count)
        found = torch.stack([first, rows, columns, keep.sum(1)], 1).to(torch.int32).numpy()
        out[fits.numpy()] = found[fits.numpy()]
        return out

    def query_tokens(self, texts: Sequence[str], mask: np.ndarray) -> list[list[tuple[str, str, int, int]]] | None:
        """Per query, per kept vector (`mask` [B, L] as `encode_queries` gave it): (kind, token, start,
        end) with kind "text" (start:end the query's characters the token came from), "marker" (the
        processor's query prefix and template), "expansion" (augmentation padding) or "special"; None
        when the processor's tokens do not line up with `mask`.

        Each token's characters come from the tokenizer's offsets over the query as the processor
        frames it (its query prefix before, ColPali's BOS first), aligned with the ids the model was
        given: a token that merges the prefix's last characters with the query's first is text, with
        the query's part of it as its span. A query whose framing cannot be aligned (a processor of
        another shape) gets its text tokens without spans."""
        features = self.tokenize(texts, is_query=True)
        ids = features["input_ids"]
        if tuple(ids.shape) != tuple(mask.shape):
            return None
        processor = getattr(self.model[0], "processor", None)
        tokenizer = getattr(processor, "tokenizer", None) or self.backbone.tokenizer
        prefix = str(getattr(processor, "query_prefix", "") or "")
        specials = set(tokenizer.all_special_ids)
        pad = tokenizer.pad_token_id
        out = []
        for row, text in enumerate(texts):
            row_ids = ids[row].tolist()
            spans = _query_offsets(tokenizer, row_ids, prefix, text)
            entries = []
            for position in np.flatnonzero(np.asarray(mask[row], dtype=bool)).tolist():
                token = row_ids[position]
                name = str(tokenizer.convert_ids_to_tokens(token))
                span = spans.get(position)
                if token == pad:
                    entries.append(("expansion", name, 0, 0))
                elif token in specials:
                    entries.append(("special", name, 0, 0))
                elif span is None:
                    entries.append(("marker", name, 0, 0))
                else:
                    entries.append(("text", text[span[0]:span[1]], span[0], span[1]))
            out.append(entries)
        return out

    # -- persistence -----------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {**super().config(), "modality": self.modality}

    @classmethod
    def load(cls, directory: Path, config: Mapping[str, Any], device: str | None = None,
             trust_remote_code: bool = False) -> "VisualEncoder":
        return cls(Path(directory) / "model", device=device, name=config.get("name"),
                   weights_sha256=config.get("weights_sha256"), trust_remote_code=trust_remote_code)


def _query_offsets(tokenizer: Any, row_ids: list[int], prefix: str, text: str) -> dict[int, tuple[int, int]]:
    """{position in `row_ids`: (start, end) in `text`} for the tokens holding query characters,
    found by tokenising the query as the processor frames it (`prefix` + text, with the BOS token
    first where the ids start with it) with offsets and finding those ids in `row_ids`; empty
    where no framing lines up. Whitespace at a span's ends is left out."""
    for framing in (prefix, f"{tokenizer.bos_token or ''}{prefix}"):
        encoded = tokenizer(framing + text, add_special_tokens=False, return_offsets_mapping=True)
        found, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
        start = _find_run(row_ids, found)
        if start < 0:
            continue
        spans = {}
        for index, (a, b) in enumerate(offsets):
            a, b = trimmed_span(text, int(a) - len(framing), int(b) - len(framing))
            if a < b:
                spans[start + index] = (a, b)
        return spans
    return {}


def _find_run(sequence: list[int], run: list[int]) -> int:
    """The first index where `run` occurs in `sequence` as a contiguous run, -1 where it does not."""
    if not run:
        return -1
    for index in range(len(sequence) - len(run) + 1):
        if sequence[index:index + len(run)] == run:
            return index
    return -1
