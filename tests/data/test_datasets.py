"""Prompt files (JSONL, Parquet) and the Grain prompt loader."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sao_jax.data.datasets import DatasetError, prompt_loader, read_prompts
from sao_jax.envs.base import Prompt

RECORDS = [
    {"prompt": "Q: 1+2=?", "answer": "3"},
    {"prompt": "Q: 2*3=?", "answer": 6, "id": 40, "difficulty": 2, "metadata": {"expression": "2*3"}},
    {"prompt": "Q: 1/4=?", "answer": 0.25, "source": "gsm", "metadata": {"level": "easy"}},
    {"prompt": "Q: 5-7=?", "answer": "-2", "id": None, "difficulty": None, "metadata": None},
]
EXPECTED = [  # written out by hand from RECORDS and the field rules
    Prompt(id=0, text="Q: 1+2=?", answer="3", difficulty=1, metadata={}),
    Prompt(id=40, text="Q: 2*3=?", answer="6", difficulty=2, metadata={"expression": "2*3"}),
    Prompt(id=2, text="Q: 1/4=?", answer="0.25", difficulty=1, metadata={"level": "easy", "source": "gsm"}),
    Prompt(id=3, text="Q: 5-7=?", answer="-2", difficulty=1, metadata={}),
]


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_jsonl_fields_defaults_and_extra_fields(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", RECORDS[:2] + ["", "   "] + RECORDS[2:])  # blank lines are allowed
    assert read_prompts(path) == EXPECTED


def test_parquet_reads_the_same_prompts(tmp_path):
    # Parquet has one schema for all rows: absent values are nulls, and metadata is a struct column
    rows = [{"prompt": r["prompt"], "answer": str(r["answer"]), "id": r.get("id"), "difficulty": r.get("difficulty"),
             "source": r.get("source")} for r in RECORDS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    prompts = read_prompts(tmp_path / "p.parquet")
    assert [(p.id, p.text, p.answer, p.difficulty) for p in prompts] == \
        [(e.id, e.text, e.answer, e.difficulty) for e in EXPECTED]
    assert [p.metadata for p in prompts] == [{"source": None}, {"source": None}, {"source": "gsm"}, {"source": None}]


BAD_LINES = [  # (second line of the file, field named in the error)
    ('{"prompt": "Q", "answer": ', "not valid JSON"),
    ('["Q", "1"]', "expected an object"),
    ({"answer": "1"}, "field 'prompt': missing"),
    ({"prompt": "", "answer": "1"}, "field 'prompt': must be a non-empty string"),
    ({"prompt": 5, "answer": "1"}, "field 'prompt'"),
    ({"prompt": "Q"}, "field 'answer': missing"),
    ({"prompt": "Q", "answer": [1]}, "field 'answer': must be a string or a number"),
    ({"prompt": "Q", "answer": True}, "field 'answer'"),
    ({"prompt": "Q", "answer": "1", "id": "a7"}, "field 'id': must be an integer >= 0"),
    ({"prompt": "Q", "answer": "1", "id": -1}, "field 'id'"),
    ({"prompt": "Q", "answer": "1", "difficulty": 0}, "field 'difficulty': must be an integer >= 1"),
    ({"prompt": "Q", "answer": "1", "difficulty": 1.5}, "field 'difficulty'"),
    ({"prompt": "Q", "answer": "1", "metadata": [1]}, "field 'metadata': must be an object"),
    ({"prompt": "Q", "answer": "1", "tag": 1, "metadata": {"tag": 2}}, "field 'tag': is also a key of 'metadata'"),
    ({"prompt": "Q", "answer": "1", "id": 0}, "field 'id': 0 repeats the id of .*line 1"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_malformed_jsonl_line_names_file_line_and_field(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], line, RECORDS[1]])
    with pytest.raises(DatasetError, match=rf"bad\.jsonl, line 2: .*{message}"):
        read_prompts(path)


def test_malformed_parquet_row_names_the_row(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"prompt": "Q", "answer": "1"}, {"prompt": None, "answer": "2"}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad\.parquet, row 1: field 'prompt'"):
        read_prompts(tmp_path / "bad.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        read_prompts(tmp_path / "junk.parquet")


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        read_prompts(tmp_path / "none.jsonl")
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        read_prompts(tmp_path / "p.csv")


# --- the Grain loader -------------------------------------------------------------------------------------

PROMPTS = [Prompt(id=100 + i, text=f"Q{i}", answer=str(i), difficulty=1) for i in range(23)]


def take(iterator, n):
    return [next(iterator).id for _ in range(n)]


def test_shards_are_disjoint_and_cover_the_prompts():
    shards = [list(prompt_loader(PROMPTS, seed=3, num_epochs=1, shard_index=i, shard_count=3)) for i in range(3)]
    ids = [[p.id for p in shard] for shard in shards]
    assert all(isinstance(p, Prompt) for shard in shards for p in shard)
    assert sorted(sum(ids, [])) == [p.id for p in PROMPTS]  # each prompt exactly once
    assert [len(s) for s in ids] == [8, 8, 7]
    assert list(prompt_loader(PROMPTS, seed=3, num_epochs=1)) != PROMPTS  # default: process 0 of 1, shuffled
    assert sorted(p.id for p in prompt_loader(PROMPTS, seed=3, num_epochs=1)) == [p.id for p in PROMPTS]


def test_same_seed_same_order_and_each_epoch_reshuffles():
    first = take(iter(prompt_loader(PROMPTS, seed=11)), 3 * len(PROMPTS))
    assert first == take(iter(prompt_loader(PROMPTS, seed=11)), 3 * len(PROMPTS))
    assert first != take(iter(prompt_loader(PROMPTS, seed=12)), 3 * len(PROMPTS))
    epochs = [first[k * len(PROMPTS): (k + 1) * len(PROMPTS)] for k in range(3)]
    assert all(sorted(e) == [p.id for p in PROMPTS] for e in epochs)  # every epoch is a permutation
    assert epochs[0] != epochs[1] != epochs[2]
    assert len(list(prompt_loader(PROMPTS, seed=11, num_epochs=2))) == 2 * len(PROMPTS)


def test_restored_state_continues_exactly():
    loader = prompt_loader(PROMPTS, seed=5, shard_index=1, shard_count=2)
    iterator = iter(loader)
    take(iterator, 17)  # into the second epoch of the 11-prompt shard
    state = json.loads(json.dumps(iterator.get_state()))  # JSON-able
    expected = take(iterator, 30)
    resumed = iter(prompt_loader(PROMPTS, seed=5, shard_index=1, shard_count=2))
    resumed.set_state(state)
    assert take(resumed, 30) == expected


@pytest.mark.parametrize("kwargs, message", [
    (dict(shard_index=2, shard_count=2), "shard_index < shard_count"),
    (dict(shard_index=0, shard_count=30), "cannot fill 30 shards"),
    (dict(seed=-1), "seed must be in"),
    (dict(num_epochs=0), "num_epochs must be >= 1"),
])
def test_loader_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prompt_loader(PROMPTS, **{"seed": 0, **kwargs})


def test_as_many_prompts_as_shards_gives_one_prompt_per_shard():
    shards = [[p.id for p in prompt_loader(PROMPTS[:3], seed=0, num_epochs=1, shard_index=i, shard_count=3)]
              for i in range(3)]
    assert shards == [[100], [101], [102]]


def test_the_largest_seed_is_accepted_and_one_more_is_refused():
    assert len(list(prompt_loader(PROMPTS, seed=2**32 - 1, num_epochs=1))) == len(PROMPTS)
    with pytest.raises(ValueError, match="seed must be in"):
        prompt_loader(PROMPTS, seed=2**32)


# --- what a user's file may hold ---------------------------------------------------------------------------


def test_an_unterminated_line_names_the_column_where_it_ends_not_the_next_line(tmp_path):
    """The line's own newline is not part of its JSON: an object cut short at column 27 is named there
    (json counts the newline as a second line and said column 1)."""
    path = tmp_path / "cut.jsonl"
    path.write_text('{"prompt": "Q", "answer": 1}\n{"prompt": "Q", "answer": \n')
    with pytest.raises(DatasetError, match=r"^.*cut\.jsonl, line 2: not valid JSON \(Expecting value at column 27\)$"):
        read_prompts(path)
    path.write_text('{"prompt": "Q", "answer": 1}\r\n{"prompt": "Q" "answer": 1}\r\n')  # Windows line ends
    with pytest.raises(DatasetError, match=r"line 2: not valid JSON \(Expecting ',' delimiter at column 16\)$"):
        read_prompts(path)


def test_a_byte_that_is_not_utf8_names_file_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "Q", "answer": 1}\n{"prompt": "\xe9t\xe9 Q", "answer": 1}\n')
    with pytest.raises(DatasetError, match=r"latin1\.jsonl, line 2: not UTF-8 text \(byte 0xe9 at column 13\)"):
        read_prompts(path)
    path.write_bytes('{"prompt": "été → Q", "answer": 1}\n{"prompt": "ok", "x": "é'.encode() + b'\xff"}\n')
    with pytest.raises(DatasetError, match=r"line 2: not UTF-8 text \(byte 0xff at column 25\)"):
        read_prompts(path)  # columns count characters, not bytes


@pytest.mark.parametrize("name", ["p.jsonl.gz", "p.jsonl"])
def test_gzipped_json_lines_are_read_as_they_stand(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS)))
    assert read_prompts(path) == read_prompts(write_jsonl(tmp_path / "plain.jsonl", RECORDS))
    path.write_bytes(gzip.compress(b'{"prompt": "Q", "answer": 1}\n' * 50)[:-20])  # cut short
    with pytest.raises(DatasetError, match=rf"{name}: not a readable gzip file"):
        read_prompts(path)
