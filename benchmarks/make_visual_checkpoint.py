"""Write a tiny seeded ColPali or ColQwen2 checkpoint offline, as a Sentence Transformers 6
MultiVectorEncoder save: a model for testing page search end to end, not a model that retrieves
anything well.

    python -m benchmarks.make_visual_checkpoint /tmp/tiny-colpali
    python -m benchmarks.make_visual_checkpoint /tmp/tiny-colqwen2 --family colqwen2
    espn index PAGES --out IDX --encoder colbert:/tmp/tiny-colpali

Both are transformers' own retrievers built from a tiny config with random weights from `seed`,
with their own processors and a byte-level BPE tokenizer trained here, offline, with the
`tokenizers` library on a fixed word list (any other text is encoded from its 256 byte symbols).
Sentence Transformers loads the transformers save (`transformer_task="retrieval"`, text and image
modalities, a MultiVectorMask after it) and writes its own format; each directory is well under
1 MB and loads in well under a second. Vectors are `dim` (128, as the real models') wide.

- colpali (`write_checkpoint`): `ColPaliForRetrieval` (PaliGemma: a SigLIP vision tower and a
  Gemma language model) and `ColPaliProcessor` (a SigLIP image processor; the tokenizer has
  `<image>`, `<bos>`, `<eos>`, `<pad>` and `<unk>`, and the processor adds PaliGemma's
  `<locNNNN>`/`<segNNN>` tokens). Every page is resized to `image_size` px (64 by default) square
  and cut into `patch_size` px patches: a fixed (64 / 8)^2 = 64 patch vectors a page, plus the few
  vectors of the visual prompt ("Describe the image.").
- colqwen2 (`write_colqwen2_checkpoint`): `ColQwen2ForRetrieval` (Qwen2-VL, dynamic resolution)
  and `ColQwen2Processor` (Qwen2-VL's image processor; the tokenizer has Qwen's `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>`, `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>` and
  `<|video_pad|>`). Each page keeps its aspect ratio: it is resized to a multiple of
  `patch_size * merge_size` px (16) with between `min_pixels` and `max_pixels` pixels, cut into
  `patch_size` px patches, and each `merge_size` x `merge_size` block of patches is one vector, so
  pages of different shapes get different counts: a 64x64 page is an 8x8 patch grid
  (`image_grid_thw` (1, 8, 8)), 4x4 = 16 image vectors; a page has 4 to 36 of them by default,
  plus the visual prompt's.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import torch
from sentence_transformers import MultiVectorEncoder
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (ColPaliConfig, ColPaliForRetrieval, ColPaliProcessor, ColQwen2Config, ColQwen2ForRetrieval,
                          ColQwen2Processor, GemmaTokenizer, PreTrainedModel, ProcessorMixin, Qwen2Tokenizer)
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.siglip import SiglipImageProcessorPil
from transformers.utils import logging as hf_logging

__all__ = ["FAMILIES", "QWEN2_SPECIAL_TOKENS", "SPECIAL_TOKENS", "build_qwen2_tokenizer", "build_tokenizer",
           "write_checkpoint", "write_colqwen2_checkpoint"]

#: The --family choices and how the report names them.
FAMILIES = {"colpali": "ColPali", "colqwen2": "ColQwen2"}
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<image>")
QWEN2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                        "<|image_pad|>", "<|video_pad|>")
#: The tokenizer's training text: words a query about a page might use (a byte-level BPE encodes
#: any other text from its 256 byte symbols, so nothing is ever unknown).
_WORDS = ("the a of and page report shows table chart figure invoice revenue quarter summary map diagram "
          "question what which where how many year total sales growth circle square line red green blue "
          "black text title annual results first second third page number grid bar pie").split()


def _train_bpe(special_tokens: Sequence[str], vocab_size: int, unk_token: str | None) -> Tokenizer:
    """A byte-level BPE trained on `_WORDS`: small, offline, and the same on every run."""
    tokenizer = Tokenizer(models.BPE(unk_token=unk_token))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([" ".join(_WORDS)] * 4, trainer=trainer)
    return tokenizer


def build_tokenizer(vocab_size: int = 512) -> GemmaTokenizer:
    """A small byte-level BPE tokenizer with PaliGemma's special tokens, the same on every run."""
    return GemmaTokenizer(tokenizer_object=_train_bpe(SPECIAL_TOKENS, vocab_size, "<unk>"), bos_token="<bos>",
                          eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def build_qwen2_tokenizer(vocab_size: int = 512) -> Qwen2Tokenizer:
    """A small byte-level BPE tokenizer with Qwen2-VL's special tokens, the same on every run; as
    Qwen2-VL-Instruct's (ColQwen2's base), no BOS or unknown token, `<|im_end|>` ends and
    `<|endoftext|>` pads."""
    # unk_token=None is what Qwen's own tokenizer_config.json holds; transformers' hint says str.
    return Qwen2Tokenizer(tokenizer_object=_train_bpe(QWEN2_SPECIAL_TOKENS, vocab_size, None), bos_token=None,
                          eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None)  # type: ignore[arg-type]


def write_checkpoint(out: Path, image_size: int = 64, patch_size: int = 8, dim: int = 128, hidden: int = 32,
                     seed: int = 0) -> Path:
    """Write the ColPali checkpoint into `out` (replaced) and return it; the same files for the same arguments."""
    if image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
    patches = (image_size // patch_size) ** 2
    image_processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size},
                                              image_seq_length=patches)
    processor = ColPaliProcessor(image_processor=image_processor, tokenizer=build_tokenizer())
    vocab = len(processor.tokenizer)
    config = ColPaliConfig(
        vlm_config={
            "model_type": "paligemma",
            "vision_config": {"model_type": "siglip_vision_model", "image_size": image_size, "patch_size": patch_size,
                              "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "vision_use_head": False},
            "text_config": {"model_type": "gemma", "hidden_size": hidden, "intermediate_size": 2 * hidden,
                            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "head_dim": hidden // 2, "vocab_size": vocab},
            "image_token_index": processor.image_token_id, "vocab_size": vocab,
            "projection_dim": hidden, "hidden_size": hidden,
        },
        embedding_dim=dim,
    )
    torch.manual_seed(seed)
    return _save(ColPaliForRetrieval(config).eval(), processor, out)


def write_colqwen2_checkpoint(out: Path, patch_size: int = 8, merge_size: int = 2, min_pixels: int = 16 * 16 * 4,
                              max_pixels: int = 96 * 96, dim: int = 128, hidden: int = 32, seed: int = 0) -> Path:
    """Write the ColQwen2 checkpoint into `out` (replaced) and return it; the same files for the same
    arguments. Pages keep their aspect ratio, so their vector counts differ (the module docstring)."""
    if hidden % 8:
        raise ValueError(f"hidden ({hidden}) must be a multiple of 8: 2 heads, each rotated in 3 even sections")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must be at most max_pixels ({max_pixels})")
    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size,
                                               merge_size=merge_size, temporal_patch_size=2)
    tokenizer = build_qwen2_tokenizer()
    processor = ColQwen2Processor(image_processor=image_processor, tokenizer=tokenizer)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN2_SPECIAL_TOKENS}
    vocab = len(tokenizer)
    rotary = hidden // 4  # half of a head's width, split over time, height and width as Qwen2-VL's [16, 24, 24]
    spatial = (rotary - rotary // 4) // 2
    config = ColQwen2Config(
        vlm_config={
            "model_type": "qwen2_vl",
            "text_config": {"model_type": "qwen2_vl_text", "hidden_size": hidden, "intermediate_size": 2 * hidden,
                            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "vocab_size": vocab, "bos_token_id": ids["<|endoftext|>"],
                            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [rotary - 2 * spatial, spatial, spatial]}},
            "vision_config": {"depth": 1, "embed_dim": hidden, "hidden_size": hidden, "num_heads": 2,
                              "patch_size": patch_size, "spatial_merge_size": merge_size,
                              "temporal_patch_size": 2, "in_channels": 3, "mlp_ratio": 2},
            "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "vocab_size": vocab,
        },
        embedding_dim=dim,
    )
    torch.manual_seed(seed)
    return _save(ColQwen2ForRetrieval(config).eval(), processor, out)


def _save(model: PreTrainedModel, processor: ProcessorMixin, out: Path) -> Path:
    """Save the transformers model and processor, then have Sentence Transformers read them and
    write its own format into `out`: the save espn and the library load, not one espn imitates."""
    hf_logging.disable_progress_bar()
    out = Path(out)
    with tempfile.TemporaryDirectory() as raw:
        model.save_pretrained(raw)
        processor.save_pretrained(raw)
        encoder = MultiVectorEncoder(raw, device="cpu", local_files_only=True)
        if out.exists():
            shutil.rmtree(out)
        encoder.save(str(out))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("out", type=Path, help="directory to write the checkpoint into (replaced)")
    parser.add_argument("--family", choices=FAMILIES, default="colpali", help="the retriever (default colpali)")
    parser.add_argument("--image-size", type=int, help="colpali: page side in px after resizing (default 64)")
    parser.add_argument("--max-pixels", type=int, help="colqwen2: most pixels a page keeps (default 96*96)")
    parser.add_argument("--patch-size", type=int, default=8, help="patch side in px (default 8)")
    parser.add_argument("--dim", type=int, default=128, help="vector dimensions (default 128, as the real models')")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    args = parser.parse_args(argv)
    if args.family == "colpali":
        if args.max_pixels is not None:
            parser.error("--max-pixels is for --family colqwen2 (colpali pages are --image-size square)")
        size = 64 if args.image_size is None else args.image_size
        path = write_checkpoint(args.out, size, args.patch_size, args.dim, seed=args.seed)
        shape = f"{(size // args.patch_size) ** 2} patches a page"
    else:
        if args.image_size is not None:
            parser.error("--image-size is for --family colpali (colqwen2 pages keep their shape: --max-pixels)")
        most = 96 * 96 if args.max_pixels is None else args.max_pixels
        path = write_colqwen2_checkpoint(args.out, args.patch_size, max_pixels=most, dim=args.dim, seed=args.seed)
        shape = f"up to {most // (2 * args.patch_size) ** 2} merged patches a page"
    print(f"wrote a tiny {FAMILIES[args.family]} checkpoint ({shape}, {args.dim} dims, seed {args.seed}) to {path}; "
          f"index pages with: espn index PAGES --out INDEX --encoder colbert:{path}")


if __name__ == "__main__":
    main()
