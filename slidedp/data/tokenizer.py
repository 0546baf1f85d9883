"""A tokenizer with what its folder's config says: special tokens, BOS/EOS rules, the chat template.

`tokenizer.json` is read with `tokenizers`; beside it, `tokenizer_config.json` gives the special
tokens and `add_bos_token`, and the chat template comes from data.chat_template, else
`chat_template.jinja`, `chat_template.json` or `tokenizer_config.json` (as `transformers` looks).
The end-of-sequence id is the config's `eos_token`, else the first of the common end-of-text tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat import ChatTemplate
from .errors import DataError
from .text import EOT_TOKENS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt")


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


@dataclass
class TokenizerBundle:
    """tokenizer.json with what its folder's config says: special tokens, BOS/EOS rules, the chat template."""

    path: Path
    tokenizer: Any  # tokenizers.Tokenizer
    config: dict[str, Any]
    template: ChatTemplate | None
    bos_id: int | None
    eos_id: int | None
    add_bos: bool

    @classmethod
    def load(cls, tokenizer_path: str | Path, chat_template: str | Path = "") -> "TokenizerBundle":
        from tokenizers import Tokenizer

        path = Path(tokenizer_path)
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise DataError(f"{path}: cannot load tokenizer: {e}") from None
        folder = path.parent
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = _read_json(folder / "tokenizer_config.json")
        special = {k: t for k, v in config.items() if k.endswith("_token") and (t := _token_text(v))}
        ids = {k: tok.token_to_id(t) for k, t in special.items()}
        eos = ids.get("eos_token")
        if eos is None:
            eos = next((i for t in EOT_TOKENS if (i := tok.token_to_id(t)) is not None), None)
        return cls(path, tok, config, _find_template(folder, config, special, chat_template), ids.get("bos_token"),
                   eos, bool(config.get("add_bos_token", False)))

    def encode_text(self, texts: list[str], bos: bool) -> list[list[int]]:
        """Token ids of each text; bos: with the BOS the tokenizer's post-processor or add_bos_token adds."""
        out = []
        for enc in self.tokenizer.encode_batch(texts, add_special_tokens=bos):
            ids = list(enc.ids)
            if bos and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
                ids.insert(0, self.bos_id)
            out.append(ids)
        return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not readable JSON: {e}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: must hold a JSON object")
    return value


def _find_template(folder: Path, config: dict[str, Any], special: dict[str, str],
                   override: str | Path) -> ChatTemplate | None:
    """data.chat_template, else chat_template.jinja, chat_template.json or tokenizer_config.json's."""
    if override:
        p = Path(override)
        return ChatTemplate(p.read_text(encoding="utf-8"), special, str(p))
    if (folder / "chat_template.jinja").is_file():
        p = folder / "chat_template.jinja"
        return ChatTemplate(p.read_text(encoding="utf-8"), special, str(p))
    source, origin = None, ""
    if (folder / "chat_template.json").is_file():
        source, origin = _read_json(folder / "chat_template.json").get("chat_template"), str(folder / "chat_template.json")
    if source is None and "chat_template" in config:
        source, origin = config["chat_template"], str(folder / "tokenizer_config.json")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise DataError(f"{origin}: chat_template must be a string (or named templates with a 'default')")
    return ChatTemplate(source, special, origin)
