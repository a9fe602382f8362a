"""The built-in character-level tokenizer of the embedded default (no download).

Ids: 0 = <pad>, 1 = <bos>, 2 = <eos>, then the 95 printable ASCII characters and newline. Text outside
that alphabet is an error naming the character, not a silent `<unk>`: the toy tasks are ASCII by
construction, so an unknown character means a bug upstream.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

import numpy as np


class CharTokenizer:
    """Maps each printable ASCII character (and newline) to one id."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    specials = ("<pad>", "<bos>", "<eos>")

    def __init__(self) -> None:
        alphabet = "\n" + "".join(c for c in string.printable if c.isprintable())
        self._id_of = {c: i + len(self.specials) for i, c in enumerate(alphabet)}
        self._char_of = {i: c for c, i in self._id_of.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self._id_of)

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.fromiter((self._id_of[c] for c in text), np.int32, count=len(text))
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the character vocabulary (printable ASCII)") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are skipped."""
        return "".join(self._char_of.get(int(i), "") for i in ids)
