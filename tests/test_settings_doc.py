"""One source of truth for settings: the models in server/settings.py.

Every `ESPN_*` variable the code names is a field of `ServerSettings` or `RouterSettings`;
every field appears in `espn serve --help` / `espn route --help` with its variable and
default, and in the docs' generated tables (docs/reference/settings.md; `make settings-table` rewrites them).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from espn.cli import build_parser, main
from espn_server.router_settings import RouterSettings
from espn_server.settings import ENV_PREFIX, ROUTER_ENV_PREFIX, ServerSettings
from espn_server.settings_doc import settings_of, write_readme

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"serve": ServerSettings, "route": RouterSettings}


def _help(command: str, capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return "".join(capsys.readouterr().out.split())  # argparse wraps lines (even inside a URL): compare without spaces


def test_the_readme_tables_are_generated_from_the_models() -> None:
    assert not write_readme(ROOT / "docs" / "reference" / "settings.md", check=True), \
        "docs/reference/settings.md's settings tables are out of date: run `make settings-table`"


@pytest.mark.parametrize("command", sorted(MODELS))
def test_every_setting_is_in_help_with_its_variable_and_default(command: str, capsys: pytest.CaptureFixture) -> None:
    text = _help(command, capsys)
    for setting in settings_of(MODELS[command]):
        assert "".join(setting.help.split()) in text, f"{setting.env} missing from `espn {command} --help`"
        if setting.flag is not None:
            assert setting.flag in text


def test_every_espn_variable_in_the_code_is_a_setting() -> None:
    known = {s.env for model in MODELS.values() for s in settings_of(model)}
    prefixes = {ENV_PREFIX, ROUTER_ENV_PREFIX}
    sources = [*ROOT.joinpath("espn").rglob("*.py"), *ROOT.joinpath("indexing").rglob("*.py"),
               *ROOT.joinpath("server").rglob("*.py"), *ROOT.joinpath("deploy").glob("Dockerfile*"),
               ROOT / "deploy" / "espn.env.example"]
    stray = {}
    for path in sources:
        for name in re.findall(r"\bESPN_[A-Z0-9_]*", path.read_text()):
            if name not in known and name not in prefixes and not name.endswith("_LAYOUT"):  # ESPN_LAYOUT: a constant
                stray.setdefault(name, str(path.relative_to(ROOT)))
    assert not stray, f"ESPN_* names that are no setting (add a field to server/settings.py): {stray}"


def test_every_other_espn_variable_is_documented() -> None:
    """The benchmarks', tests' and deploy files' own variables: each named in the documentation (docs/)."""
    readme = "\n".join(page.read_text() for page in sorted(ROOT.joinpath("docs").rglob("*.md")))
    sources = [*ROOT.joinpath("benchmarks").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"), ROOT / "Makefile",
               *[p for p in ROOT.joinpath("deploy").rglob("*") if p.is_file() and p.suffix in ("", ".yaml", ".example")]]
    names = {name for path in sources for name in re.findall(r"\bESPN_[A-Z0-9_]*[A-Z0-9]", path.read_text())}
    names -= {"ESPN_LAYOUT"}  # a constant of espn_indexing.precomputed, not a variable
    undocumented = sorted(name for name in names if not re.search(rf"\b{name}\b", readme))
    assert not undocumented, f"ESPN_* variables the docs do not name: {undocumented}"


def test_flags_become_the_settings_they_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from espn_server.commands import _overrides

    (tmp_path / "manifest.json").write_text("{}")
    args = build_parser().parse_args(["serve", str(tmp_path), "--write-wait-s", "3.5", "--compact-max-segments", "2",
                                      "--no-warmup", "--no-direct", "--cors-origin", "http://a", "--cors-origin",
                                      "http://b", "--graceful-timeout", "7", "--max-pending", "64"])
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in {**_overrides(args), "ESPN_INDEX": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    settings = ServerSettings()
    assert (settings.write_wait_s, settings.compact_max_segments, settings.warmup, settings.direct) == (3.5, 2, False,
                                                                                                         False)
    assert settings.cors_origins == ["http://a", "http://b"]
    assert (settings.graceful_timeout_s, settings.max_pending) == (7, 64)
    route = build_parser().parse_args(["route", "--shards", "http://a:1,http://b:2", "--shards", "http://c:3",
                                       "--max-connections", "9"])
    routed = RouterSettings(**{k: v for k, v in vars(route).items() if k in RouterSettings.model_fields and v})
    assert routed.shards == ["http://a:1", "http://b:2", "http://c:3"] and routed.max_connections == 9


@pytest.mark.parametrize("key, message", [
    ("", "is empty; unset ESPN_API_KEY"),
    ("short-key", "has 9 characters; at least 16"),
    ("a key with spaces in it", "printable ASCII without spaces"),
])
def test_an_unusable_api_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str,
                                        message: str) -> None:
    (tmp_path / "manifest.json").write_text("{}")
    monkeypatch.setenv("ESPN_INDEX", str(tmp_path))
    monkeypatch.setenv("ESPN_API_KEY", key)
    with pytest.raises(ValidationError, match=re.escape(message)):
        ServerSettings()
