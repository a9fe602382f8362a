"""Judges for the style-shift task (docs/algorithms.md §11): r = r_quality × r_style ∈ {0, 1}.

Both judges implement `Judge.judge(text, *, topics, target_style) -> Verdict`:
  * `RuleJudge` (default): deterministic rules, below.
  * `LLMJudge`: asks any OpenAI-compatible chat endpoint (`POST {base_url}/chat/completions`).

Archetypes and their markers (case-insensitive; a marker only counts when no letter touches it, so
"thought" is not "thou"). Short, distinctive tokens a character-level model can learn:
  cute        "nya~", "uwu", "<3"
  chuunibyou  "behold", "dark flame", "fate"
  classical   "thou", "thee", "hath"
`style_of(text)` is the archetype with strictly the most marker occurrences, or None (no marker or a tie).

Rule judge: quality = 1 iff the text is printable ASCII, `min_chars` <= length <= `max_chars`, has at
least two words, and names every topic as a word; style = 1 iff `style_of(text) == target_style`.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Protocol

STYLE_MARKERS: dict[str, tuple[str, ...]] = {
    "cute": ("nya~", "uwu", "<3"),
    "chuunibyou": ("behold", "dark flame", "fate"),
    "classical": ("thou", "thee", "hath"),
}
STYLES = tuple(STYLE_MARKERS)

_MARKER_PATTERNS = {
    style: [re.compile(rf"(?<![a-z]){re.escape(m)}(?![a-z])", re.IGNORECASE) for m in markers]
    for style, markers in STYLE_MARKERS.items()
}


def style_of(text: str) -> str | None:
    """The archetype whose markers occur strictly most often in `text`; None if none occurs or a tie."""
    counts = {style: sum(len(p.findall(text)) for p in patterns) for style, patterns in _MARKER_PATTERNS.items()}
    best = max(counts.values())
    winners = [style for style, count in counts.items() if count == best]
    return winners[0] if best > 0 and len(winners) == 1 else None


def check_style(style: str) -> str:
    if style not in STYLE_MARKERS:
        raise ValueError(f"unknown style {style!r}; the archetypes are {STYLES}")
    return style


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A judge's decision: quality and style in {0, 1}; `detail` says why (or what went wrong)."""

    quality: int
    style: int
    detail: str = dataclasses.field(default="", compare=False)

    @property
    def reward(self) -> float:
        return float(self.quality * self.style)


class Judge(Protocol):
    def judge(self, text: str, *, topics: Sequence[str], target_style: str) -> Verdict: ...


class RuleJudge:
    """Deterministic judge (module docstring)."""

    def __init__(self, *, min_chars: int = 8, max_chars: int = 80) -> None:
        if not 0 < min_chars <= max_chars:
            raise ValueError(f"RuleJudge: need 0 < min_chars <= max_chars (got {min_chars}, {max_chars})")
        self.min_chars, self.max_chars = min_chars, max_chars

    def judge(self, text: str, *, topics: Sequence[str], target_style: str) -> Verdict:
        check_style(target_style)
        words = set(re.findall(r"[a-z]+", text.lower()))
        problems = [
            *(["not printable ASCII"] if not all(" " <= c <= "~" for c in text) else []),
            *([f"length {len(text)} outside [{self.min_chars}, {self.max_chars}]"]
              if not self.min_chars <= len(text) <= self.max_chars else []),
            *(["fewer than two words"] if len(text.split()) < 2 else []),
            *[f"topic {t!r} missing" for t in topics if t.lower() not in words],
        ]
        style = style_of(text)
        return Verdict(int(not problems), int(style == target_style), "; ".join(problems) or f"style={style}")


class JudgeError(RuntimeError):
    """The LLM judge could not be asked (unreachable, timed out, refused the request)."""


_RETRIABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})

_SYSTEM_PROMPT = (
    "You grade one short text. quality=1 if it is a well-formed, on-topic greeting that names every topic "
    "given; else 0. style=1 if its style is the target archetype; else 0. Archetypes: cute (kawaii, "
    "'nya~', 'uwu', '<3'), chuunibyou (grandiose dark-fantasy, 'behold', 'dark flame', 'fate'), classical "
    "(archaic English, 'thou', 'thee', 'hath'). Reply with JSON only: {\"quality\": 0 or 1, \"style\": 0 or 1}."
)


class LLMJudge:
    """Judge through an OpenAI-compatible chat completions endpoint.

    base_url     e.g. "http://127.0.0.1:8000/v1"; the request goes to {base_url}/chat/completions
    model        the model name sent in the request
    api_key_env  name of the environment variable holding the API key (sent as a Bearer token), or None
    timeout_s    per request; max_retries extra attempts after a timeout, a connection error or an
                 HTTP 408/429/500/502/503/504, waiting backoff_s, 2·backoff_s, 4·backoff_s, ... before
                 them. Other HTTP errors raise at once. When all attempts fail: `JudgeError` naming the
                 URL and the last error.
    A reply whose content is neither JSON with 0/1 "quality" and "style" nor "quality: 0/1, style: 0/1"
    text counts as quality 0, style 0 (its `detail` says so) — a bad grader answer is not a crash.
    """

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, timeout_s: float = 30.0,
                 max_retries: int = 3, backoff_s: float = 1.0, sleep: Callable[[float], None] = time.sleep) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"LLMJudge: base_url must start with http:// or https:// (got {base_url!r})")
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(f"LLMJudge: need max_retries >= 0, timeout_s > 0, backoff_s >= 0 "
                             f"(got {max_retries}, {timeout_s}, {backoff_s})")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.timeout_s, self.max_retries, self.backoff_s = model, timeout_s, max_retries, backoff_s
        self._sleep = sleep
        self._headers = {"Content-Type": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"LLMJudge: environment variable {api_key_env} (api_key_env) is not set")
            self._headers["Authorization"] = f"Bearer {key}"

    def judge(self, text: str, *, topics: Sequence[str], target_style: str) -> Verdict:
        check_style(target_style)
        request = {
            "model": self.model,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": _SYSTEM_PROMPT},
                {"role": "user", "content": f"Topics: {', '.join(topics)}\nTarget style: {target_style}\n"
                                            f"Text: {text}"},
            ],
        }
        reply = self._post(json.dumps(request).encode())
        try:
            content = json.loads(reply)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return Verdict(0, 0, f"malformed judge reply (not a chat completion): {reply[:200]!r}")
        return parse_verdict(content)

    def _post(self, body: bytes) -> bytes:
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return response.read()
            except urllib.error.HTTPError as e:
                if e.code not in _RETRIABLE_STATUS:
                    raise JudgeError(f"LLM judge at {self.url} refused the request: HTTP {e.code} {e.reason}") from e
                last_error = f"HTTP {e.code} {e.reason}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", e)
                last_error = "timed out" if isinstance(reason, TimeoutError) else f"{type(reason).__name__}: {reason}"
        raise JudgeError(f"LLM judge at {self.url} unreachable after {self.max_retries + 1} attempts: {last_error}")


def parse_verdict(content: str) -> Verdict:
    """Read {"quality": 0|1, "style": 0|1} (JSON anywhere in the text) or "quality: 0/1, style: 0/1"."""
    for blob in re.findall(r"\{[^{}]*\}", content):
        try:
            fields: Any = json.loads(blob)
        except ValueError:
            continue
        values = [fields.get(k) if isinstance(fields, dict) else None for k in ("quality", "style")]
        if all(v in (0, 1) for v in values):  # 0/1, false/true, 0.0/1.0
            return Verdict(int(values[0]), int(values[1]), "json")
    found = [re.search(rf"\b{k}\b\W{{0,3}}([01])(?![\d.])", content, re.IGNORECASE) for k in ("quality", "style")]
    if all(found):
        return Verdict(int(found[0].group(1)), int(found[1].group(1)), "text")
    return Verdict(0, 0, f"malformed judge reply: {content[:200]!r}")


JUDGES: dict[str, Callable[..., Judge]] = {"rule": RuleJudge, "llm": LLMJudge}
