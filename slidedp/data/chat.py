"""Chat templates rendered as `transformers` renders them, and which characters the loss is on.

A model's chat template is Jinja code (from `tokenizer_config.json`, `chat_template.jinja` or
`chat_template.json`). It is compiled here with `jinja2` in the same sandboxed environment
`transformers`' `apply_chat_template` uses (trim_blocks, lstrip_blocks, loop controls, its `tojson`,
`raise_exception`, `strftime_now`, and the `{% generation %}` tag), so the text, and with the same
tokenizer the token ids, are the same; `transformers` itself is not needed at run time.

The trained characters of a conversation are the assistant turns:
- where the template marks them with `{% generation %}` ... `{% endgeneration %}`, those spans (what
  `return_assistant_tokens_mask=True` uses);
- otherwise (most models' templates) by rendering prefixes: the text the template adds for assistant
  message i is render(messages[:i+1]) minus render(messages[:i], add_generation_prompt=True), i.e. the
  reply and the end-of-turn marks the model must learn to produce. That needs each render to extend
  the one before; a template that rewrites earlier turns is refused with a message naming it.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import DataError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@lru_cache(maxsize=8)
def compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: records the character span its body renders to."""

        tags = {"generation"}

        def __init__(self, environment) -> None:
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._blocks: list[str] | None = None
            self._spans: list[tuple[int, int]] = []

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_support"), [], [], body).set_lineno(lineno)

        def _support(self, caller) -> str:
            rv = caller()
            if self._blocks is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(rv)))
            return rv

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            self._blocks, self._spans = blocks, spans
            try:
                yield
            finally:
                self._blocks = None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    """One model's chat template with the special-token strings its tokenizer config gives it."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        self.source, self.special_tokens, self.origin = source, dict(special_tokens), origin
        self.tracks_generation = bool(_GENERATION_TAG.search(source))
        try:
            self._template = compile_template(source)
        except Exception as e:  # jinja2's TemplateSyntaxError and friends
            raise DataError(f"{origin}: the chat template does not compile: {e}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               spans: list[tuple[int, int]] | None = None) -> str:
        blocks: list[str] = []
        kwargs = {**self.special_tokens, "messages": messages, "tools": None, "documents": None,
                  "add_generation_prompt": add_generation_prompt}
        if spans is None:
            return "".join(self._template.generate(**kwargs))
        with self._template.environment.track_generation(blocks, spans):
            for block in self._template.generate(**kwargs):
                blocks.append(block)
        return "".join(blocks)

    def render_with_spans(self, messages: list[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its assistant turns (trained)."""
        try:
            if self.tracks_generation:
                spans: list[tuple[int, int]] = []
                return self.render(messages, spans=spans), spans
            text, spans = self.render(messages), []
            for i, m in enumerate(messages):
                if m.get("role") != "assistant":
                    continue
                before = self.render(messages[:i], add_generation_prompt=True)
                through = self.render(messages[:i + 1])
                if not (text.startswith(through) and through.startswith(before)):
                    raise DataError(
                        f"{where}: the chat template of {self.origin} renders earlier turns differently once later "
                        f"ones follow, so the assistant turns cannot be found by rendering prefixes; give a template "
                        f"with {{% generation %}} marks (data.chat_template)")
                end = len(before) + len(through[len(before):].rstrip())  # the newline between turns is layout
                if end > len(before):
                    spans.append((len(before), end))
            return text, spans
        except DataError:
            raise
        except Exception as e:  # a template's raise_exception, a bad message the template trips over
            raise DataError(f"{where}: the chat template of {self.origin} failed on this conversation: "
                            f"{type(e).__name__}: {e}") from None


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters overlap a span, as `return_assistant_tokens_mask` marks them."""
    mask = [0] * len(offsets)
    s = 0
    for i, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0]:
            mask[i] = 1
    return mask


def check_messages(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    """A conversation as the template gets it: a list of {role, content, ...} objects (None values dropped)."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} must be a non-empty list of {{\"role\", \"content\"}} objects, "
                        f"got {_kind(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {key}[{i}] must be an object with \"role\" and \"content\", got {_kind(m)}")
        if not isinstance(m.get("role"), str):
            raise DataError(f"{where}: {key}[{i}] has no string \"role\" (got {_kind(m.get('role'))})")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {key}[{i}] (role {m['role']!r}) has no string \"content\" "
                            f"(got {_kind(m.get('content'))})")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _kind(v: Any) -> str:
    if v is None:
        return "nothing"
    return f"{type(v).__name__} {json.dumps(v)[:60]}" if not isinstance(v, (dict, list)) else type(v).__name__
