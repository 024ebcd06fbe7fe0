"""A model directory from outside, read as data: espn.untrusted's rules applied to checkpoints.

Every encoder that loads a user's directory (`hf:`, `colbert:`, `colberter:`) goes through
here before transformers, tokenizers, torch or safetensors reads a byte of it:

- **No code.** A `config.json` or `tokenizer_config.json` with an `auto_map`, or a
  `model_type` transformers does not ship, needs the directory's own Python code. It is
  refused in one line unless the operator passed `--trust-remote-code` (`trust_remote_code`
  here); transformers is always called with `trust_remote_code` given explicitly, so it never
  asks a question on stdin (where `yes |` or a pipe would answer it).
- **Data only.** The files are regular files under the directory. A symbolic link is taken only
  when it resolves inside the directory, or, for a Hugging Face cache snapshot
  (`.../models--ORG--NAME/snapshots/REV`), inside that repository (its files link to
  `../../blobs/`). A link out, a link to a directory, a FIFO or a device is refused, before
  anything is read and again when the files are copied into an index.
- **Bounded.** Each file has a size limit by kind (below), and the directory a file count and
  a total; JSON is bounded by size and depth before it is parsed.
- **One line.** Weights that do not load as plain tensors, a tokenizer file that is not a
  tokenizer, are refused naming the file, never with advice to load them unsafely.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import pickle
import shutil
import stat
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from ..errors import RefusedInputError
from ..untrusted import load_json, read_bounded, regular_file, regular_files_under
from .backbone_config import refused_config

__all__ = ["MAX_CONFIG_BYTES", "MAX_TOKENIZER_BYTES", "MAX_WEIGHTS_BYTES", "MAX_OTHER_BYTES", "MAX_MODEL_FILES",
           "MAX_MODEL_BYTES", "NOT_COPIED", "TOKENIZER_FILE_NAMES", "WEIGHT_SUFFIXES", "file_limit", "hf_cache_root",
           "model_file", "read_model_json", "scan_model_dir", "copy_model_dir", "remote_code_reason",
           "check_remote_code", "check_tokenizer_files", "check_weights", "load_weights", "loading", "check_model_dir",
           "position_limit"]

#: A configuration file (config.json, tokenizer_config.json, modules.json, artifact.metadata, ...):
#: real ones are a few KB, the largest (label maps of classifiers) under 1 MB; 4 MiB parses in
#: milliseconds, where a 400 MB one took 99 s and 1.6 GB of memory.
MAX_CONFIG_BYTES = 4 << 20
#: A tokenizer file (tokenizer.json, vocab.txt, merges.txt, a SentencePiece model): XLM-RoBERTa's
#: 250k-token tokenizer.json is 17 MB, Gemma's 34 MB.
MAX_TOKENIZER_BYTES = 64 << 20
#: One weights file (model.safetensors, pytorch_model.bin, a shard): 16 GiB holds an 8B-parameter
#: model in fp16, far past the late-interaction models espn serves (0.1-3 GB).
MAX_WEIGHTS_BYTES = 16 << 30
#: Any other file copied with a checkpoint (remote-code .py files, README-like text).
MAX_OTHER_BYTES = 64 << 20
#: Files and bytes of a whole model directory (what is copied into an index's encoder/model).
MAX_MODEL_FILES = 1024
MAX_MODEL_BYTES = 64 << 30

#: Files never needed to encode (other frameworks' weights, training state, exports, git); left
#: out of the checks and of the copy.
NOT_COPIED = ("*.onnx", "onnx", "openvino", "*.msgpack", "*.h5", "*.ot", "optimizer.pt", "scheduler.pt",
              "training_args.bin", "rng_state*.pth", ".git", "*.md", "runs", "checkpoint-*", ".cache")
TOKENIZER_FILE_NAMES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "added_tokens.json",
                        "spiece.model", "sentencepiece.bpe.model", "tokenizer.model", "*.model")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_CONFIG_SUFFIXES = (".json", ".metadata")


def file_limit(name: str) -> int:
    """The size limit of a model file by its name (see the MAX_* constants)."""
    if any(fnmatch.fnmatch(name, pattern) for pattern in TOKENIZER_FILE_NAMES):
        return MAX_TOKENIZER_BYTES
    if name.endswith(WEIGHT_SUFFIXES):
        return MAX_WEIGHTS_BYTES
    if name.endswith(_CONFIG_SUFFIXES):
        return MAX_CONFIG_BYTES
    return MAX_OTHER_BYTES


def hf_cache_root(directory: Path) -> Path | None:
    """The repository folder `models--ORG--NAME` of a Hugging Face cache snapshot
    `.../models--ORG--NAME/snapshots/REV`, resolved; None for any other directory."""
    directory = Path(os.path.abspath(directory))
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent.resolve()
    return None


def _link_root(directory: Path) -> Path:
    return hf_cache_root(directory) or Path(directory).resolve()


def _not_copied(patterns: Iterable[str]) -> Callable[[Path], bool]:
    patterns = tuple(patterns)
    return lambda relative: any(fnmatch.fnmatch(part, p) for part in relative.parts for p in patterns)


def model_file(directory: Path, name: str, what: str = "model directory") -> Path | None:
    """The real path of `directory/name` when it exists: a regular file, or a link to one inside
    the directory (or its cache repository); None when absent; anything else is refused."""
    path = Path(directory) / name
    if not os.path.lexists(path):
        return None
    real = path
    if path.is_symlink():
        real, allowed = path.resolve(), _link_root(Path(directory))
        if real != allowed and allowed not in real.parents:
            raise RefusedInputError(f"{what}: refused, {path} links to {real}, outside {allowed}")
    info = regular_file(real, what)
    limit = file_limit(path.name)
    if info.st_size > limit:
        raise RefusedInputError(f"{what}: refused, {path} is {info.st_size} bytes (at most {limit} for this file)")
    return real


def read_model_json(path: Path, what: str = "model directory", max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """A JSON file of a model directory (config.json, modules.json, ...), bounded before it is parsed;
    `path` as `directory / name`: a link is followed only as `model_file` allows."""
    real = model_file(path.parent, path.name, what)
    if real is None:
        raise RefusedInputError(f"{what}: {path} does not exist")
    data = read_bounded(real, what, max_bytes=max_bytes)
    return load_json(data, f"{what} ({path})", max_bytes=max_bytes)


def scan_model_dir(directory: Path, what: str = "model directory", not_copied: Iterable[str] = NOT_COPIED,
                   keep: Callable[[Path], bool] | None = None) -> dict[Path, Path]:
    """{relative path: real path} of the files of a model directory (those `not_copied` left out,
    and only those `keep` accepts), each a regular file within its size limit; anything else
    refused in one line. Reads no file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise RefusedInputError(f"{what}: {directory} is not a directory")
    leave_out = _not_copied(not_copied)
    files: dict[Path, Path] = {}
    for relative, real in regular_files_under(directory, what, max_files=MAX_MODEL_FILES, max_bytes=MAX_MODEL_BYTES,
                                              link_root=_link_root(directory), skip=leave_out):
        if keep is not None and not keep(relative):
            continue
        size, limit = real.stat().st_size, file_limit(relative.name)
        if size > limit:
            raise RefusedInputError(f"{what}: refused, {directory / relative} is {size} bytes "
                                    f"(at most {limit} for this file)")
        files[relative] = real
    return files


def copy_model_dir(source: Path, target: Path, what: str = "model directory", not_copied: Iterable[str] = NOT_COPIED,
                   keep: Callable[[Path], bool] | None = None) -> list[Path]:
    """Copy the data files of `source` (as `scan_model_dir` accepts them) into `target`; returns
    the relative paths copied. Each file is opened without following a link and without blocking,
    checked to be regular on its descriptor, and copied up to its limit: a file swapped for a
    FIFO or grown after the scan is refused, not followed."""
    files = scan_model_dir(source, what, not_copied, keep)
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for relative, real in files.items():
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        _copy_regular(real, destination, file_limit(relative.name), what)
    return sorted(files)


def _copy_regular(source: Path, destination: Path, limit: int, what: str) -> None:
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(source, flags)
    except OSError as exc:
        raise RefusedInputError(f"{what}: cannot open {source} ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as src:
        info = os.fstat(src.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise RefusedInputError(f"{what}: refused, {source} is not a regular file")
        with open(destination, "wb") as dst:
            copied = 0
            while True:
                chunk = src.read(min(8 << 20, limit + 1 - copied))
                if not chunk:
                    break
                copied += len(chunk)
                if copied > limit:
                    raise RefusedInputError(f"{what}: refused, {source} is over {limit} bytes")
                dst.write(chunk)
    shutil.copystat(source, destination, follow_symlinks=False)


# -- remote code ------------------------------------------------------------------------
def remote_code_reason(directory: Path, what: str = "model directory") -> str | None:
    """Why loading `directory` with transformers would run code from it, or None: an `auto_map`
    in config.json or tokenizer_config.json, or a `model_type` transformers does not ship."""
    # Here, not at the top: transformers takes seconds to import and `espn --help` imports this module.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    directory = Path(directory)
    for name in ("config.json", "tokenizer_config.json"):
        if model_file(directory, name, what) is None:
            continue
        config = read_model_json(directory / name, what)
        if not isinstance(config, dict):
            continue
        if config.get("auto_map"):
            auto_map = config["auto_map"]
            names = sorted(auto_map) if isinstance(auto_map, dict) else [str(auto_map)[:80]]
            return f"{name} auto_map {names}"
        model_type = config.get("model_type")
        if name == "config.json" and isinstance(model_type, str) and model_type not in CONFIG_MAPPING_NAMES:
            return f"config.json model_type {model_type!r} is not an architecture transformers ships"
    return None


def check_remote_code(directory: Path, trust_remote_code: bool, what: str = "model directory") -> bool:
    """True when `directory` needs its own code and `trust_remote_code` allows it; refused in one
    line (naming the directory and the flag) when it needs it and the flag was not given."""
    reason = remote_code_reason(directory, what)
    if reason is None:
        return False
    if not trust_remote_code:
        raise RefusedInputError(
            f"{directory}: the backbone needs remote code ({reason}); refused: espn runs no code from a model "
            "directory unless given --trust-remote-code (on `espn index`, and again on `espn serve`/`espn search`)")
    return True


# -- tokenizer and weights --------------------------------------------------------------
def check_tokenizer_files(directory: Path, what: str = "model directory") -> None:
    """Each tokenizer file present parses as what its name says, or a one-line refusal naming it:
    tokenizer.json loads in `tokenizers`, the JSON files are bounded JSON objects, vocab.txt is text."""
    directory = Path(directory)
    for name in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json"):
        if model_file(directory, name, what) is not None:
            if not isinstance(read_model_json(directory / name, what, file_limit(name)), dict):
                raise RefusedInputError(f"{what}: refused, {directory / name} is not a JSON object")
    real = model_file(directory, "tokenizer.json", what)
    if real is not None:
        data = read_bounded(real, what, max_bytes=MAX_TOKENIZER_BYTES)
        load_json(data, f"{what} ({directory / 'tokenizer.json'})", max_bytes=MAX_TOKENIZER_BYTES)
        try:
            Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 -- the Rust library raises its own exception type
            raise RefusedInputError(f"{what}: refused, {directory / 'tokenizer.json'} is not a tokenizer "
                                    f"({_first_line(exc)})") from None
    for name in ("vocab.txt", "merges.txt"):
        real = model_file(directory, name, what)
        if real is not None:
            try:
                read_bounded(real, what, max_bytes=MAX_TOKENIZER_BYTES).decode("utf-8")
            except UnicodeDecodeError:
                raise RefusedInputError(f"{what}: refused, {directory / name} is not UTF-8 text") from None


def check_weights(path: Path, what: str = "model directory", name: str | None = None) -> None:
    """A weights file loads as plain tensors without executing anything, checked cheaply (a
    safetensors header; a torch zip file unpickled with `weights_only` over a memory map).
    name: the file's name in its directory when `path` is a cache blob (which has none)."""
    with _weights_errors(path, what):
        if (name or path.name).endswith(".safetensors"):
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
            return
        mmap = zipfile.is_zipfile(path)  # the legacy (pre-1.6) format cannot be mapped
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        _check_state(state, path, what)


def load_weights(path: Path, what: str = "model directory", name: str | None = None) -> dict[str, Any]:
    """The tensors of a weights file (model.safetensors or pytorch_model.bin), read as data only:
    a pickle that names anything but tensors is refused in one line naming the file."""
    with _weights_errors(path, what):
        if (name or path.name).endswith(".safetensors"):
            return dict(load_file(str(path), device="cpu"))
        state = torch.load(path, map_location="cpu", weights_only=True)
    return _check_state(state, path, what)


def _check_state(state: Any, path: Path, what: str) -> dict[str, Any]:
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RefusedInputError(f"{what}: refused, {path} is not a state dict of tensors")
    return dict(state)


@contextlib.contextmanager
def _weights_errors(path: Path, what: str) -> Iterator[None]:
    """Weights that do not load, as one line naming the file. torch's own message advises loading
    the file with weights_only=False (running its code): that advice is never passed on."""
    try:
        yield
    except RefusedInputError:
        raise
    except Exception as exc:  # noqa: BLE001 -- torch and safetensors raise many types for a bad file
        text = str(exc)
        if isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in text:
            raise RefusedInputError(f"{what}: refused, {path} is not plain tensors ({_unpickler_detail(text)}); "
                                    "espn loads weights only as data") from None
        raise RefusedInputError(f"{what}: refused, {path} cannot be read as weights ({_first_line(exc)})") from None


def _unpickler_detail(text: str) -> str:
    """What the pickle tried ("Trying to load unsupported GLOBAL posix.system ..."), without torch's
    paragraphs about weights_only (which advise loading the file unsafely) or its documentation."""
    text = text.split("WeightsUnpickler error:")[-1]
    for paragraph in (p.strip() for p in text.split("\n\n")):
        if paragraph and not any(word in paragraph for word in ("weights_only", "Weights only", "documentation")):
            return paragraph.splitlines()[0][:300]
    return "not a weights-only pickle"


def _first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    # torch's advice to re-run unsafely, wherever it appears, is not repeated
    for marker in ("Re-running", "weights_only"):
        if marker in line:
            line = line.split(marker)[0].rstrip(" .,:;") or type(exc).__name__
    return line[:300]


@contextlib.contextmanager
def loading(directory: Path, part: str) -> Iterator[None]:
    """transformers' failures loading `part` ("the tokenizer", "the model") of `directory`, as
    one line naming it (after `check_model_dir` these are rare: a config that names a class the
    files do not fit, a weights shape mismatch)."""
    try:
        yield
    except RefusedInputError:
        raise
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RuntimeError, pickle.UnpicklingError) as exc:
        raise RefusedInputError(f"{directory}: cannot load {part} ({_first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 -- a strict config's validation error has no common base with the above
        line = refused_config(exc, _written_config(Path(directory)), str(directory))
        if line is None:
            raise
        raise RefusedInputError(line) from None


def _written_config(directory: Path) -> Mapping[str, Any] | None:
    """`directory`'s config.json as written (for an error line), None where it cannot be read."""
    try:
        config = read_model_json(directory / "config.json")
    except (RefusedInputError, OSError, ValueError):
        return None
    return config if isinstance(config, Mapping) else None


def check_model_dir(directory: Path, trust_remote_code: bool = False, what: str = "model directory",
                    weights: Iterable[str] = ("model.safetensors", "pytorch_model.bin")) -> bool:
    """Everything above, before transformers reads the directory: its files (kinds, links, sizes),
    config.json, remote code, the tokenizer files and the first of `weights` present. Returns
    whether the directory's own code will run (`check_remote_code`)."""
    directory = Path(directory)
    scan_model_dir(directory, what)
    config = read_model_json(directory / "config.json", what) if model_file(directory, "config.json", what) else None
    if config is not None and not isinstance(config, dict):
        raise RefusedInputError(f"{what}: refused, {directory / 'config.json'} is not a JSON object")
    remote = check_remote_code(directory, trust_remote_code, what)
    check_tokenizer_files(directory, what)
    for name in weights:
        real = model_file(directory, name, what)
        if real is not None:
            check_weights(real, what, name)
            break
    return remote


def position_limit(config: Mapping[str, Any], tokenizer: Any = None) -> int | None:
    """The most tokens the backbone takes: config.json's max_position_embeddings, lowered to the
    tokenizer's model_max_length where that is set (RoBERTa-like models reserve two positions)."""
    limit = config.get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return None
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 1 <= declared < limit:
        limit = declared
    return int(limit)
