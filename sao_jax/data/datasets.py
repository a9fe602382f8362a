"""Prompt files and the Grain pipeline that feeds prompts to the rollout engine.

A prompt file is JSON Lines (`.jsonl`, one object per line in UTF-8; blank lines are allowed; gzipped,
`.jsonl.gz` or a `.jsonl` holding gzip, is read as it stands) or Parquet (`.parquet`, one row per
prompt). Fields of each record:

    prompt      str, not empty              -> Prompt.text
    answer      str, or a number (as text)  -> Prompt.answer
    id          int >= 0, optional          -> Prompt.id (default: the record's 0-based index)
    difficulty  int >= 1, optional          -> Prompt.difficulty (default 1)
    metadata    object, optional            -> Prompt.metadata, together with every other field

A null optional field counts as absent (Parquet writes absent values as nulls). Anything malformed is a
`DatasetError` naming the file, the line (1-based, JSONL) or row (0-based, Parquet) and the field (the
column, 1-based in characters, of a byte that is not UTF-8 or of where the JSON breaks); no record is
skipped unless the caller asks (`read_prompt_records(skipped=...)`, for `env.bad_prompts=skip`).
`read_prompt_records` also gives each prompt's place and line, for checks that need the run
(`sao_jax.train.build.check_prompt`: the tokenizer's vocabulary, the rollout's and SFT's length).

`prompt_loader` shuffles, repeats and shards a prompt list with Grain's own `MapDataset` pieces:

    MapDataset.source(prompts)[shard_index::shard_count].shuffle(seed).repeat(num_epochs)

Each epoch is a fresh permutation of the shard (Grain's shuffle folds the epoch into the seed), the
order is a function of (seed, shard) alone, and the iterator's state is `{"next_index": n}`.
"""

from __future__ import annotations

import gzip
import json
import numbers
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grain
import jax

from sao_jax.envs.base import Prompt
from sao_jax.errors import UserError

FIELDS = ("prompt", "answer", "id", "difficulty", "metadata")


class DatasetError(UserError, ValueError):
    """A prompt file that cannot be read; the message names the file, the record and the field."""


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of a `.jsonl` (or `.jsonl.gz`) or `.parquet` file (fields in the module docstring),
    in file order."""
    return [prompt for _, prompt, _ in read_prompt_records(path)]


def read_prompt_records(path: str | Path, *, skipped: list[str] | None = None) -> list[tuple[str, Prompt, str | None]]:
    """(where, prompt, line) for each prompt of the file, in file order: where it is ("FILE, line N"
    or "FILE, row N") and, for JSON Lines, the text of its line. With `skipped`, a malformed record is
    left out and its message appended there instead of raised; a problem of the whole file (missing,
    unreadable, no prompt left) still raises."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if path.suffix == ".jsonl" or path.suffixes[-2:] == [".jsonl", ".gz"]:
        records = _jsonl_records(path)
    elif path.suffix == ".parquet":
        records = _parquet_records(path)
    else:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r} (expected .jsonl, .jsonl.gz or .parquet)")
    out, first_seen = [], {}
    for index, (where, record, line) in enumerate(records):
        try:
            if isinstance(record, DatasetError):
                raise record
            prompt = _prompt(record, index, where)
            if prompt.id in first_seen:
                raise DatasetError(f"{where}: field 'id': {prompt.id} repeats the id of {first_seen[prompt.id]}")
        except DatasetError as e:
            if skipped is None:
                raise
            skipped.append(str(e))
            continue
        first_seen[prompt.id] = where
        out.append((where, prompt, line))
    if not out:
        malformed = f" that can be read ({len(skipped)} malformed; the first: {skipped[0]})" if skipped else ""
        raise DatasetError(f"{path}: no prompts in the file{malformed}")
    return out


GZIP_MAGIC = b"\x1f\x8b"


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(where, the line's JSON value or the DatasetError that names its problem, its text) of each line
    that is not blank."""
    with path.open("rb") as raw:
        gzipped = raw.read(2) == GZIP_MAGIC
    try:
        with (gzip.open(path, "rb") if gzipped else path.open("rb")) as lines:
            for number, data in enumerate(lines, start=1):
                where = f"{path}, line {number}"
                data = data.rstrip(b"\r\n")  # a line's end is no part of its JSON: columns count within it
                try:
                    line = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    column = len(data[: e.start].decode("utf-8", errors="replace")) + 1
                    yield where, DatasetError(f"{where}: not UTF-8 text (byte {data[e.start]:#04x} at column "
                                              f"{column}); save the file as UTF-8"), None  # fmt: skip
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    record = DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})")
                yield where, record, line
    except (OSError, EOFError, zlib.error) as e:  # a damaged or truncated gzip stream
        if not gzipped:
            raise
        raise DatasetError(f"{path}: not a readable gzip file ({type(e).__name__}: {e})") from None


def _parquet_records(path: Path) -> Iterator[tuple[str, Any, None]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 — pyarrow raises several types for a damaged file
        raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    for index, row in enumerate(rows):
        yield f"{path}, row {index}", row, None


def _prompt(record: Any, index: int, where: str) -> Prompt:
    if not isinstance(record, Mapping):
        raise DatasetError(f"{where}: expected an object with fields 'prompt' and 'answer', "
                           f"got {type(record).__name__}")

    def fail(field: str, problem: str):
        raise DatasetError(f"{where}: field {field!r}: {problem} (got {record.get(field)!r})")

    text, answer = record.get("prompt"), record.get("answer")
    if "prompt" not in record:
        fail("prompt", "missing")
    if not isinstance(text, str) or not text:
        fail("prompt", "must be a non-empty string")
    if "answer" not in record:
        fail("answer", "missing")
    if isinstance(answer, bool) or not isinstance(answer, (str, numbers.Real)):
        fail("answer", "must be a string or a number")
    prompt_id, difficulty = record.get("id"), record.get("difficulty")
    if prompt_id is not None and (isinstance(prompt_id, bool) or not isinstance(prompt_id, int) or prompt_id < 0):
        fail("id", "must be an integer >= 0")
    if difficulty is not None and (isinstance(difficulty, bool) or not isinstance(difficulty, int) or difficulty < 1):
        fail("difficulty", "must be an integer >= 1")
    metadata = record.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        fail("metadata", "must be an object")
    metadata = dict(metadata or {})
    for field, value in record.items():
        if field in FIELDS:
            continue
        if field in metadata:
            fail(field, f"is also a key of 'metadata' ({metadata[field]!r}); keep one")
        metadata[field] = value
    return Prompt(id=index if prompt_id is None else prompt_id, text=text, answer=str(answer),
                  difficulty=1 if difficulty is None else difficulty, metadata=metadata)


def prompt_loader(prompts: Sequence[Prompt], *, seed: int, num_epochs: int | None = None,
                  shard_index: int | None = None, shard_count: int | None = None) -> grain.IterDataset:
    """Shuffled, repeated, sharded prompts (module docstring) as a Grain `IterDataset`.

    `iter(loader)` yields Prompt objects; the iterator's `get_state()` is a JSON-able dict and
    `set_state(state)` on a fresh iterator of the same loader continues exactly where it stopped.
    seed: 0 <= seed < 2**32. num_epochs: None = forever. shard_index/shard_count: this host's slice
    `prompts[shard_index::shard_count]`, by default `jax.process_index()` / `jax.process_count()`.
    """
    shard_index = jax.process_index() if shard_index is None else shard_index
    shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"prompt_loader: need 0 <= shard_index < shard_count (got {shard_index}, {shard_count})")
    if len(prompts) < shard_count:
        raise ValueError(f"prompt_loader: {len(prompts)} prompts cannot fill {shard_count} shards")
    if not 0 <= seed < 2**32:
        raise ValueError(f"prompt_loader: seed must be in [0, 2**32) (got {seed})")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"prompt_loader: num_epochs must be >= 1 or None (got {num_epochs})")
    shard = grain.MapDataset.source(list(prompts))[shard_index::shard_count]
    # In-memory prompts: read on the calling thread (no worker threads, no prefetch buffer).
    return shard.shuffle(seed=seed).repeat(num_epochs).to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
