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

One run per folder: `FolderLock` holds an exclusive `flock` on the folder itself for as long as the
run works, writing nothing in it. The kernel drops the lock with the process, however it ends (kill -9
included), so nothing left behind can block a restart; a second run on a folder still held is refused
in one line. A URL is locked through a lock file beside its local mirror: that keeps two runs on one
machine apart (another machine's run on the same URL is not seen).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import os
import shutil
import tempfile
from pathlib import Path

from sao_jax.errors import UserError


class OutputFolderError(UserError):
    """A local output folder that cannot be created or written."""


class FolderBusyError(UserError):
    """Another process holds the folder's lock: one run per folder."""


class FolderLock:
    """An exclusive, non-blocking `flock` on `folder` itself (made if missing), or with `name` on the
    file `folder/name` (made empty if missing), held from `__enter__` to `__exit__` or until the process
    ends, however it ends; a second holder gets `FolderBusyError` naming the folder (`shown`) and the
    config `key`. On a filesystem without locks it holds nothing."""

    def __init__(self, folder: str | Path, name: str | None = None, *, key: str, shown: str | None = None):
        self.folder, self.name = Path(folder), name
        self.key, self.shown = key, shown or str(folder)
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = (os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY) if self.name is None
              else os.open(self.folder / self.name, os.O_RDWR | os.O_CREAT, 0o644))  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return self  # a filesystem without locks (some network mounts): run unlocked
            raise FolderBusyError(f"another sao-train is running in {self.shown} ({self.key}); wait for it to end, "
                                  f"or choose another {self.key}") from None
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing it drops the lock
            self._fd = None


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

    @staticmethod
    def local_path(url: str, process_index: int = 0) -> Path:
        """Where process `process_index` of this machine mirrors `url`: under the system's temp dir."""
        digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / "sao_jax_outputs" / f"{digest}_p{process_index}"

    @classmethod
    def fresh(cls, url: str, process_index: int = 0) -> OutputMirror:
        """A mirror of `url` in an emptied directory under the system's temp dir, one per process
        (processes of one run on one host must not share it; a run locks it first: `FolderLock`)."""
        local = cls.local_path(url, process_index)
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
