"""Write a tiny seeded ColPali checkpoint offline, as a Sentence Transformers 6 MultiVectorEncoder save:
a model for testing page search end to end, not a model that retrieves anything well.

    python -m benchmarks.make_visual_checkpoint /tmp/tiny-colpali
    espn index PAGES --out IDX --encoder colbert:/tmp/tiny-colpali

transformers' own `ColPaliForRetrieval` (PaliGemma: a SigLIP vision tower and a Gemma language
model) built from a tiny config with random weights from `seed`, and its own `ColPaliProcessor`
(a SigLIP image processor and a byte-level BPE tokenizer trained here, offline, with the
`tokenizers` library on a fixed word list; it has `<image>`, `<bos>`, `<eos>`, `<pad>` and `<unk>`,
and the processor adds PaliGemma's `<locNNNN>`/`<segNNN>` tokens). Pages are resized to
`image_size` px (64 by default) and cut into `patch_size` px patches, so a page is
(64 / 8)^2 = 64 patch vectors plus the few vectors of the visual prompt ("Describe the image."),
each `dim` (128, as ColPali's) wide. Sentence Transformers loads the transformers save
(`transformer_task="retrieval"`, text and image modalities, a MultiVectorMask after it) and
writes its own format; the directory is about 0.6 MB and loads in well under a second.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from sentence_transformers import MultiVectorEncoder
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import ColPaliConfig, ColPaliForRetrieval, ColPaliProcessor, GemmaTokenizer
from transformers.models.siglip import SiglipImageProcessorPil
from transformers.utils import logging as hf_logging

__all__ = ["SPECIAL_TOKENS", "build_tokenizer", "write_checkpoint"]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<image>")
#: The tokenizer's training text: words a query about a page might use (a byte-level BPE encodes
#: any other text from its 256 byte symbols, so nothing is ever unknown).
_WORDS = ("the a of and page report shows table chart figure invoice revenue quarter summary map diagram "
          "question what which where how many year total sales growth circle square line red green blue "
          "black text title annual results first second third page number grid bar pie").split()


def build_tokenizer(vocab_size: int = 512) -> GemmaTokenizer:
    """A small byte-level BPE tokenizer with PaliGemma's special tokens, the same on every run."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([" ".join(_WORDS)] * 4, trainer=trainer)
    return GemmaTokenizer(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                          unk_token="<unk>")


def write_checkpoint(out: Path, image_size: int = 64, patch_size: int = 8, dim: int = 128, hidden: int = 32,
                     seed: int = 0) -> Path:
    """Write the checkpoint into `out` (created) and return it; the same files for the same arguments."""
    if image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
    hf_logging.disable_progress_bar()
    out = Path(out)
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
    model = ColPaliForRetrieval(config).eval()
    with tempfile.TemporaryDirectory() as raw:
        model.save_pretrained(raw)
        processor.save_pretrained(raw)
        # Sentence Transformers' own reading of a transformers-native retriever, saved in its format.
        encoder = MultiVectorEncoder(raw, device="cpu", local_files_only=True)
        if out.exists():
            shutil.rmtree(out)
        encoder.save(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the checkpoint into (replaced)")
    parser.add_argument("--image-size", type=int, default=64, help="page side in px after resizing (default 64)")
    parser.add_argument("--patch-size", type=int, default=8, help="patch side in px (default 8)")
    parser.add_argument("--dim", type=int, default=128, help="vector dimensions (default 128, as ColPali's)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    args = parser.parse_args()
    path = write_checkpoint(args.out, args.image_size, args.patch_size, args.dim, seed=args.seed)
    print(f"wrote a tiny ColPali checkpoint ({(args.image_size // args.patch_size) ** 2} patches a page, "
          f"{args.dim} dims, seed {args.seed}) to {path}; index pages with: "
          f"espn index PAGES --out INDEX --encoder colbert:{path}")


if __name__ == "__main__":
    main()
