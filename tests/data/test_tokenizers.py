import string

import numpy as np
import pytest

from sao_jax.data.tokenizers import CharTokenizer


def test_round_trip_every_printable_character():
    tok = CharTokenizer()
    text = "".join(c for c in string.printable if c.isprintable()) + "\n<calc>17*3</calc>"
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ids.min() >= len(CharTokenizer.specials) and ids.max() < tok.vocab_size
    assert tok.decode(ids) == text


def test_ids_are_distinct_and_specials_are_skipped_on_decode():
    tok = CharTokenizer()
    ids = tok.encode("ab")
    assert ids[0] != ids[1]
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == "ab"
    assert tok.vocab_size == 3 + 96


def test_unknown_character_is_named():
    with pytest.raises(ValueError, match="'é'"):
        CharTokenizer().encode("café")
