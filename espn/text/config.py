"""How passages become index terms: the tokenizer chain of the full-text index, per language.

The chain is fixed at build time and recorded in the manifest (`text.analyzer`); every
reader and the live writer rebuild the identical chain from it, so a query is analysed
exactly like the passages were.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..choices import STEMMER_LANGUAGES
from ..errors import InvalidParameterError

__all__ = ["TextConfig", "STEMMER_LANGUAGES", "STOP_WORD_LANGUAGES", "TOKENIZER_NAME"]

#: Languages Tantivy ships a stop-word list for.
STOP_WORD_LANGUAGES = ("danish", "dutch", "english", "finnish", "french", "german", "hungarian", "italian",
                       "norwegian", "portuguese", "russian", "spanish", "swedish")
#: The name the analyzer is registered under in the engine's schema.
TOKENIZER_NAME = "espn_text"


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The analyzer: split on non-alphanumerics, drop tokens over `max_token_chars`, lowercase,
    optionally fold accents to ASCII, drop the language's stop words, stem.

    language:   Snowball stemmer / stop-word language (see STEMMER_LANGUAGES)
    stemmer:    stem terms ("running" and "runs" both index as "run")
    stop_words: drop the language's stop words (needs a list for the language)
    ascii_fold: fold accented letters ("café" -> "cafe")
    """

    language: str = "english"
    stemmer: bool = True
    stop_words: bool = True
    ascii_fold: bool = False
    max_token_chars: int = 40

    def validate(self) -> "TextConfig":
        if self.language not in STEMMER_LANGUAGES:
            raise InvalidParameterError(
                f"text language must be one of {', '.join(STEMMER_LANGUAGES)}, got {self.language!r}")
        if self.stop_words and self.language not in STOP_WORD_LANGUAGES:
            raise InvalidParameterError(
                f"no stop-word list for {self.language!r}; build with stop words off (--text-stop-words none)")
        if isinstance(self.max_token_chars, bool) or not isinstance(self.max_token_chars, int) \
                or not 1 <= self.max_token_chars <= 255:
            raise InvalidParameterError(f"max_token_chars must be an integer in [1, 255], got {self.max_token_chars!r}")
        return self

    def analyzer(self) -> Any:
        """A `tantivy.TextAnalyzer` for this chain."""
        import tantivy

        builder = tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
        builder = builder.filter(tantivy.Filter.remove_long(self.max_token_chars)).filter(tantivy.Filter.lowercase())
        if self.ascii_fold:
            builder = builder.filter(tantivy.Filter.ascii_fold())
        if self.stop_words:
            builder = builder.filter(tantivy.Filter.stopword(self.language))
        if self.stemmer:
            builder = builder.filter(tantivy.Filter.stemmer(self.language))
        return builder.build()

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "TextConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in obj.items() if key in known}).validate()
