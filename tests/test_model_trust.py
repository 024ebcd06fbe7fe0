"""A model directory is data: no code runs from it unless --trust-remote-code says so, only its own
regular files are read and copied, its files and settings are bounded, and every refusal is one line.

The model directories are made here: tiny seeded checkpoints (a BERT of 32 hidden units over a
WordPiece vocabulary of the sample corpus) in the hf:, colbert: (colbert-ai format) and
colberter: layouts, then broken the way an attacker or an accident would break them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertModel, BertTokenizerFast, DistilBertConfig

from espn.encoders import encoder_from_spec, load_encoder
from espn.encoders.colberter import ColBERTerEncoder
from espn.encoders.colberter_checkpoint import ColBERTerModel
from espn.encoders.model_files import MAX_CONFIG_BYTES
from espn.errors import IndexCorruptError, InvalidParameterError, RefusedInputError
from espn.files.durable import write_json_atomic
from espn.index import read_manifest
from espn.search.searcher import Searcher
from espn_indexing.build import BuildConfig, build_index
from server_fixtures import HTTP, running_server

SAMPLE = Path(__file__).parents[1] / "espn" / "data" / "sample_corpus.jsonl"
HIDDEN = 32
POSITIONS = 128
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused0]", "[unused1]", *".,;:!?'\"()-",
         *"abcdefghijklmnopqrstuvwxyz0123456789", *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"),
         "the", "sun", "moon", "star", "energy", "of", "and", "is", "a", "in"]


# -- tiny checkpoints -------------------------------------------------------------------
def _tokenizer() -> BertTokenizerFast:
    return BertTokenizerFast(vocab={word: i for i, word in enumerate(dict.fromkeys(WORDS))}, do_lower_case=True)


def _bert() -> BertModel:
    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=len(dict.fromkeys(WORDS)), hidden_size=HIDDEN, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=64,
                                max_position_embeddings=POSITIONS)).eval()


def write_hf(out: Path) -> Path:
    """A generic Hugging Face encoder directory (config.json, model.safetensors, tokenizer files)."""
    out.mkdir(parents=True)
    _bert().save_pretrained(str(out))
    _tokenizer().save_pretrained(str(out))
    return out


def write_colbert(out: Path) -> Path:
    """A colbert-ai checkpoint: HF_ColBERT config, `bert.`-prefixed weights and a root linear.weight."""
    out.mkdir(parents=True)
    model, tokenizer = _bert(), _tokenizer()
    tokenizer.save_pretrained(str(out))
    config = {**model.config.to_dict(), "architectures": ["HF_ColBERT"]}
    (out / "config.json").write_text(json.dumps(config))
    state = {f"bert.{key}": value.contiguous() for key, value in model.state_dict().items()}
    state["linear.weight"] = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1))
    save_file(state, str(out / "model.safetensors"))
    (out / "artifact.metadata").write_text(json.dumps({"query_maxlen": 16, "doc_maxlen": 64}))
    return out


def write_colberter(out: Path) -> Path:
    """A ColBERTer checkpoint over a 1-layer DistilBERT (its config in config.json's bert_config)."""
    out.mkdir(parents=True)
    bert = {"vocab_size": len(dict.fromkeys(WORDS)), "dim": HIDDEN, "hidden_dim": 64, "n_layers": 1, "n_heads": 2,
            "max_position_embeddings": POSITIONS}
    torch.manual_seed(0)
    model = ColBERTerModel(DistilBertConfig(**bert), d_cls=8, d_bow=4, stopwords=True)
    (out / "config.json").write_text(json.dumps({"bert_config": bert, "compression_dim": 4,
                                                 "retrieval_compression_dim": 8, "use_contextualized_stopwords": True,
                                                 "aggregate_unique_ids": True}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    _tokenizer().save_pretrained(str(out))
    return out


WRITERS: dict[str, Callable[[Path], Path]] = {"hf": write_hf, "colbert": write_colbert, "colberter": write_colberter}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: write(root / kind) for kind, write in WRITERS.items()}


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _load(kind: str, path: Path, trust: bool = False) -> object:
    if kind == "colberter":
        return ColBERTerEncoder.from_pretrained(path, device="cpu")
    return encoder_from_spec(f"{kind}:{path}", device="cpu", bow_dim=HIDDEN, trust_remote_code=trust)


def _one_line(message: str) -> str:
    assert "\n" not in message.strip(), message
    return message


def _small_corpus(tmp_path: Path, lines: int = 12) -> Path:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:lines]))
    return corpus


def _build(corpus: Path, out: Path, spec: str, **options: object) -> dict:
    config = BuildConfig(corpus=corpus, out=out, encoder=spec, bow_dim=HIDDEN, device="cpu", progress=False,
                         loader_workers=0, text_index=None, nlist=2, **options)  # type: ignore[arg-type]
    manifest = build_index(config)
    assert manifest is not None
    return manifest


def _espn(*args: object, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "espn.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# -- remote code --------------------------------------------------------------------------
def _remote_code_dir(source: Path, target: Path, marker: Path) -> Path:
    """`source` with an auto_map naming its own configuration and model classes; importing either
    module writes `marker` (what any remote code could do instead)."""
    _copy(source, target)
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_marker.MarkerConfig", "AutoModel": "modeling_marker.MarkerModel"}
    (target / "config.json").write_text(json.dumps(config))
    touch = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('remote code ran')\n"
    (target / "configuration_marker.py").write_text(
        touch + "from transformers import BertConfig\n\n\nclass MarkerConfig(BertConfig):\n    pass\n")
    (target / "modeling_marker.py").write_text(
        touch + "from transformers import BertModel\n\nfrom .configuration_marker import MarkerConfig\n\n\n"
        "class MarkerModel(BertModel):\n    config_class = MarkerConfig\n")
    return target


def test_hf_remote_code_is_refused_whatever_stdin_says(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    """`yes |` once answered transformers' prompt; now nothing asks: one line, no code run, no .partial."""
    marker = tmp_path / "marker"
    model = _remote_code_dir(checkpoints["hf"], tmp_path / "remote", marker)
    out = tmp_path / "index"
    proc = _espn("index", _small_corpus(tmp_path), "--out", out, "--encoder", f"hf:{model}", "--no-progress",
                 "--bow-dim", HIDDEN, stdin="y\n" * 100, env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert proc.returncode == 1, proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert "needs remote code" in line and str(model) in line and "--trust-remote-code" in line, line
    assert "Traceback" not in proc.stderr and "[y/N]" not in proc.stdout + proc.stderr
    assert not marker.exists()
    assert not out.exists() and not out.with_name("index.partial").exists()
    assert not (tmp_path / "modules").exists()  # transformers never copied the module to import it


@pytest.mark.parametrize("kind", ["hf", "colbert"])
def test_a_model_type_transformers_does_not_ship_is_remote_code(tmp_path: Path, checkpoints: dict[str, Path],
                                                                kind: str) -> None:
    model = _copy(checkpoints[kind], tmp_path / "custom")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "my-own-architecture"}))
    with pytest.raises(RefusedInputError, match="model_type 'my-own-architecture' is not an architecture") as info:
        _load(kind, model)
    assert "--trust-remote-code" in _one_line(str(info.value))
    tokenizer_config = _copy(checkpoints[kind], tmp_path / "custom-tokenizer")
    settings = json.loads((tokenizer_config / "tokenizer_config.json").read_text())
    (tokenizer_config / "tokenizer_config.json").write_text(json.dumps(
        {**settings, "auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}}))
    with pytest.raises(RefusedInputError, match="tokenizer_config.json auto_map"):
        _load(kind, tokenizer_config)


@pytest.mark.slow  # three processes that load torch and transformers: a minute on a busy 2-core machine
def test_trust_remote_code_runs_it_records_it_and_is_needed_again_to_open(tmp_path: Path,
                                                                          checkpoints: dict[str, Path]) -> None:
    marker = tmp_path / "marker"
    model = _remote_code_dir(checkpoints["hf"], tmp_path / "remote", marker)
    out = tmp_path / "index"
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = _espn("index", _small_corpus(tmp_path), "--out", out, "--encoder", f"hf:{model}", "--no-progress",
                 "--bow-dim", HIDDEN, "--nlist", 2, "--no-text-index", "--trust-remote-code", env=env)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "remote code ran"
    encoder = read_manifest(out)["encoder"]
    assert encoder["trust_remote_code"] is True
    assert (out / "encoder" / "model" / "modeling_marker.py").is_file()  # the index carries what it runs
    queries = tmp_path / "queries.tsv"
    queries.write_text("q1\tthe sun and the moon\n")
    marker.unlink()
    proc = _espn("search", out, "--queries", queries, "--out", tmp_path / "run", "--k", 3, stdin="y\n" * 100, env=env)
    assert proc.returncode == 1
    (line,) = _error_lines(proc.stderr)
    assert "built with --trust-remote-code" in line and "pass --trust-remote-code" in line, line
    assert not marker.exists()
    # With the flag again, the server opens it (the same door as `espn search --trust-remote-code`).
    with running_server(out, tmp_path, "--trust-remote-code", "--no-warmup", env=env) as server:
        ready = HTTP.get(f"{server.base_url}/readyz").json()
        hits = HTTP.post(f"{server.base_url}/v1/search", json={"query": "the sun", "k": 3}).json()["results"]
    assert ready["status"] == "ready" and ready["trust_remote_code"] is True
    assert len(hits) == 3 and marker.exists()
    # A manifest edited to hide it does not help: the model directory itself still asks for code.
    manifest = read_manifest(out)
    del manifest["encoder"]["trust_remote_code"]
    write_json_atomic(out / "manifest.json", manifest)
    with pytest.raises(RefusedInputError, match="needs remote code"):
        load_encoder(out / "encoder", manifest["encoder"], device="cpu")


# -- links and special files --------------------------------------------------------------
def _link_file_out(model: Path, outside: Path) -> None:
    (outside / "secret.txt").write_text("password hashes")
    (model / "extra.txt").symlink_to(outside / "secret.txt")


def _link_dir_out(model: Path, outside: Path) -> None:
    (outside / "etc").mkdir()
    (outside / "etc" / "shadow").write_text("password hashes")
    (model / "etc").symlink_to(outside / "etc")


def _link_dev_zero(model: Path, outside: Path) -> None:
    (model / "extra.bin").symlink_to("/dev/zero")


def _fifo(model: Path, outside: Path) -> None:
    os.mkfifo(model / "added_tokens.json")


BREAKS = {"file outside": (_link_file_out, "links to"), "directory outside": (_link_dir_out, "link to a directory"),
          "/dev/zero": (_link_dev_zero, "links to /dev/zero"), "FIFO": (_fifo, "is a FIFO")}


@pytest.mark.parametrize("kind", ["colbert", "hf", "colberter"])
@pytest.mark.parametrize("problem", sorted(BREAKS))
def test_links_out_and_special_files_are_refused_before_anything_is_read(
        tmp_path: Path, checkpoints: dict[str, Path], kind: str, problem: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    model = _copy(checkpoints[kind], tmp_path / "model")
    brake, message = BREAKS[problem]
    brake(model, outside)
    before = sorted(p.name for p in outside.rglob("*"))
    started = time.perf_counter()
    with pytest.raises(RefusedInputError, match=re.escape(message)) as info:
        _load(kind, model)
    assert time.perf_counter() - started < 5
    _one_line(str(info.value))
    assert sorted(p.name for p in outside.rglob("*")) == before  # nothing written beside what it names


@pytest.mark.parametrize("problem", sorted(BREAKS))
def test_a_refused_build_copies_nothing_and_leaves_no_partial(tmp_path: Path, checkpoints: dict[str, Path],
                                                             problem: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    model = _copy(checkpoints["colbert"], tmp_path / "model")
    BREAKS[problem][0](model, outside)
    out = tmp_path / "index"
    with pytest.raises(RefusedInputError):
        _build(_small_corpus(tmp_path), out, f"colbert:{model}")
    assert not out.exists() and not out.with_name("index.partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "model", "outside"]


def test_a_refusal_on_the_command_line_is_one_line_and_leaves_no_partial(tmp_path: Path,
                                                                        checkpoints: dict[str, Path]) -> None:
    model = _copy(checkpoints["colbert"], tmp_path / "model")
    (model / "extra.bin").symlink_to("/dev/zero")
    out = tmp_path / "index"
    proc = _espn("index", _small_corpus(tmp_path), "--out", out, "--encoder", f"colbert:{model}", "--no-progress")
    assert proc.returncode == 1
    (line,) = _error_lines(proc.stderr)
    assert "links to /dev/zero" in line and "Traceback" not in proc.stderr
    assert not out.exists() and not out.with_name("index.partial").exists()


def test_a_hugging_face_cache_snapshot_is_copied_as_regular_files(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    """A snapshot's files link to ../../blobs/: allowed (inside the repository), and copied as data."""
    repo = tmp_path / "hub" / "models--org--tiny-colbert"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, source in enumerate(sorted(checkpoints["colbert"].iterdir())):
        blob = repo / "blobs" / f"blob{number}"
        shutil.copy(source, blob)
        (snapshot / source.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (snapshot / "tokenizer.json").unlink()  # and a link to another file of the snapshot itself
    (snapshot / "tokenizer.json").symlink_to(next(p for p in (repo / "blobs").iterdir()
                                                  if (checkpoints["colbert"] / "tokenizer.json").read_bytes()
                                                  == p.read_bytes()).resolve())
    encoder = _load("colbert", snapshot)
    target = tmp_path / "saved"
    encoder.save(target)  # type: ignore[attr-defined]
    copied = sorted(p.relative_to(target / "model") for p in (target / "model").rglob("*"))
    assert copied == sorted(p.relative_to(checkpoints["colbert"]) for p in checkpoints["colbert"].rglob("*"))
    assert not any(p.is_symlink() for p in (target / "model").rglob("*"))
    # outside the repository, even in the same cache, a link is refused
    (snapshot / "extra.txt").symlink_to(tmp_path / "hub" / "elsewhere.txt")
    (tmp_path / "hub" / "elsewhere.txt").write_text("not this repository's")
    with pytest.raises(RefusedInputError, match="outside"):
        _load("colbert", snapshot)


# -- sizes and settings -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["colbert", "hf", "colberter"])
def test_an_oversized_config_is_refused_fast(tmp_path: Path, checkpoints: dict[str, Path], kind: str) -> None:
    model = _copy(checkpoints[kind], tmp_path / "model")
    with open(model / "config.json", "r+b") as config:
        config.truncate(400 << 20)  # sparse: 400 MB on paper, nothing on disk
    started = time.perf_counter()
    with pytest.raises(RefusedInputError, match=f"at most {MAX_CONFIG_BYTES}") as info:
        _load(kind, model)
    assert time.perf_counter() - started < 2
    assert "config.json" in _one_line(str(info.value))


def test_lengths_past_the_backbone_are_refused_at_build(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    model = checkpoints["colbert"]
    for setting in ("query_length", "document_length"):
        with pytest.raises(InvalidParameterError, match=rf"{setting} must be in \[3, {POSITIONS}\].*got 1000000000"):
            _load("colbert", f"{model}?{setting}=1000000000")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="skiplist_words must hold at most"):
        _load("colbert", f"{model}?skiplist_words={','.join(['w'] * 5000)}")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="query_prefix must be a token of at most 64"):
        _load("colbert", f"{model}?query_prefix={'x' * 100}")  # type: ignore[arg-type]
    out = tmp_path / "index"
    with pytest.raises(InvalidParameterError, match=r"query_length must be in \[3, 128\]") as info:
        _build(_small_corpus(tmp_path), out, f"colbert:{model}?query_length=1000000000")
    _one_line(str(info.value))
    assert not out.exists() and not out.with_name("index.partial").exists()


def test_an_index_built_with_an_out_of_range_length_is_refused_when_it_opens(tmp_path: Path,
                                                                            checkpoints: dict[str, Path]) -> None:
    out = tmp_path / "index"
    _build(_small_corpus(tmp_path, 6), out, f"colbert:{checkpoints['colbert']}")
    manifest = read_manifest(out)
    manifest["encoder"]["settings"]["query_length"] = 10 ** 9  # as an index built before the ranges existed
    write_json_atomic(out / "manifest.json", manifest)
    with pytest.raises(IndexCorruptError, match=r"encoder settings are refused: query_length must be in \[3, 128\]") \
            as info:
        Searcher.open(out, device="cpu")
    assert str(out / "encoder") in _one_line(str(info.value))


# -- weights and tokenizers ---------------------------------------------------------------
class _Payload:
    """What a malicious pickle carries: a call to a function of the attacker's choosing."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["hf", "colbert", "colberter"])
def test_a_malicious_pickle_is_refused_without_advice_to_load_it_unsafely(tmp_path: Path, checkpoints: dict[str, Path],
                                                                          kind: str) -> None:
    model = _copy(checkpoints[kind], tmp_path / "model")
    marker = tmp_path / "pwned"
    state = {"weights": torch.zeros(2), "payload": _Payload(marker)}
    (model / "model.safetensors").unlink()
    torch.save(state, model / "pytorch_model.bin")
    with pytest.raises(RefusedInputError) as info:
        _load(kind, model)
    message = _one_line(str(info.value))
    assert "pytorch_model.bin" in message and "is not plain tensors" in message, message
    assert "weights_only" not in message and "Re-running" not in message and "report" not in message
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["hf", "colbert", "colberter"])
@pytest.mark.parametrize("content", [b"\x00\xffnot json at all", b'{"version": "1.0", "model": {"type": "Nope"}}'])
def test_a_tokenizer_file_that_is_not_a_tokenizer_is_one_line_naming_it(tmp_path: Path, checkpoints: dict[str, Path],
                                                                        kind: str, content: bytes) -> None:
    model = _copy(checkpoints[kind], tmp_path / "model")
    (model / "tokenizer.json").write_bytes(content)
    with pytest.raises(RefusedInputError) as info:
        _load(kind, model)
    assert str(model / "tokenizer.json") in _one_line(str(info.value))


# -- the limits are documented as the code defines them -----------------------------------
def test_the_guides_quote_the_limits_the_code_enforces() -> None:
    from espn.encoders import colbert_checkpoint, model_files

    docs = Path(__file__).parents[1] / "docs" / "guides"
    guide = (docs / "models-and-encoders.md").read_text()

    def size(value: int) -> str:
        return f"{value >> 30} GiB" if value >= 1 << 30 else f"{value >> 20} MiB"

    for name in ("MAX_CONFIG_BYTES", "MAX_TOKENIZER_BYTES", "MAX_WEIGHTS_BYTES", "MAX_OTHER_BYTES", "MAX_MODEL_BYTES"):
        row = next(line for line in guide.splitlines() if f"`{name}`" in line)
        assert size(getattr(model_files, name)) in row, (name, row)
    assert f"{model_files.MAX_MODEL_FILES} files" in guide
    colbert = (docs / "colbert-models.md").read_text()
    for name in ("MIN_LENGTH", "MAX_PREFIX_CHARS", "MAX_SKIPLIST_WORDS", "MAX_SKIPLIST_WORD_CHARS"):
        assert f"{getattr(colbert_checkpoint, name)} (`{name}`)" in colbert or \
            f"{getattr(colbert_checkpoint, name)} characters (`{name}`)" in colbert or \
            f"{getattr(colbert_checkpoint, name)} words (`{name}`)" in colbert, name
    assert set(colbert_checkpoint.SETTING_RANGES) == set(colbert_checkpoint.SETTING_NAMES)
