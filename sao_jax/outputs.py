"""A run's output directory, on local disk or at a URL.

A local `output_dir` is written in place. A URL (`gs://bucket/runs/name`, or any other filesystem
fsspec opens; Cloud Storage needs the `gcs` extra, i.e. gcsfs) is written through a local mirror:
the run writes config.yaml, metrics.jsonl, TensorBoard events, plots and summary.json to a local
directory as usual, and `OutputMirror.push` copies each file that changed since the last push to
the URL. The trainer pushes after every checkpoint save, so the bucket's metrics always reach the
newest checkpoint, and at the end. A run on a fresh machine (a preempted TPU VM comes back with
an empty disk) first pulls its metric file and config.yaml back (`pull`), so a resumed run appends
to them exactly as it would in a local directory, and a new one sees that the URL holds a run.
Checkpoints do not pass through the mirror: Orbax writes them to `OUTPUT_DIR/checkpoints` at the
URL itself.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import tempfile
from pathlib import Path

from sao_jax.errors import UserError


class OutputFolderError(UserError):
    """A local output folder that cannot be created or written."""


def check_writable(folder: str | Path, key: str) -> None:
    """Create the local `folder` if needed and write a file in it, or raise `OutputFolderError` naming
    the folder and the config `key`. A URL is not checked here (its mirror is local; Orbax writes to it)."""
    if is_url(folder):
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OutputFolderError(f"cannot write the folder ({e.strerror or e}), {folder} ({key})") from None


def is_url(path: str | Path) -> bool:
    """Whether `path` names a remote location (`scheme://...`) rather than a local directory."""
    return "://" in str(path)


def join(directory: str | Path, name: str) -> str:
    """`directory/name` for a local path or a URL (pathlib would fold a URL's `//`)."""
    return f"{str(directory).rstrip('/')}/{name}" if is_url(directory) else str(Path(directory) / name)


class OutputMirror:
    """A local directory (`local`) whose files `push` copies to `url`."""

    def __init__(self, url: str, local: Path):
        import fsspec  # an orbax / etils dependency; the gs:// protocol itself needs gcsfs

        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except ImportError as error:  # e.g. gs:// without gcsfs
            raise ImportError(f"output_dir={url}: {error} (pip install 'sao_jax[gcs]' for gs://)") from error
        self.local = Path(local)
        self._pushed: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) last pushed

    @classmethod
    def fresh(cls, url: str, process_index: int = 0) -> OutputMirror:
        """A mirror of `url` in an emptied directory under the system's temp dir, one per process
        (processes of one run on one host must not share it)."""
        digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
        local = Path(tempfile.gettempdir()) / "sao_jax_outputs" / f"{digest}_p{process_index}"
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        return cls(url, local)

    def pull(self, path: Path) -> bool:
        """Copy the URL's counterpart of `path` (a file inside the mirror) into it, if there is one.
        Only the process that writes a file may pull it: its next push overwrites the URL's copy."""
        relative = Path(path).relative_to(self.local).as_posix()
        remote = f"{self.root}/{relative}"
        if not self.fs.exists(remote):
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(remote, str(path))
        return True

    def push(self) -> list[str]:
        """Copy every file of the mirror that is new or changed since the last push to the URL;
        returns the relative paths copied."""
        pushed = []
        for path in sorted(self.local.rglob("*")):
            if not path.is_file():
                continue
            stat = path.stat()
            signature = (stat.st_size, stat.st_mtime_ns)
            relative = path.relative_to(self.local).as_posix()
            if self._pushed.get(relative) == signature:
                continue
            self.fs.put_file(str(path), f"{self.root}/{relative}")
            self._pushed[relative] = signature
            pushed.append(relative)
        return pushed


def free_name(path, tag: str):
    """`<stem>.<tag><suffix>` next to `path` (a pathlib or epath path), or `<stem>.<tag>-2<suffix>`,
    `-3`, …: the first name not taken. Where a run keeps what it must not overwrite."""
    for n in itertools.count(1):
        candidate = path.with_name(f"{path.stem}.{tag}{'' if n == 1 else f'-{n}'}{path.suffix}")
        if not candidate.exists():
            return candidate
