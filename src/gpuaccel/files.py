"""Files a run writes, written so that a crash, a full disk or a second process cannot
leave them wrong: atomic replacement, appends that never leave a torn line for readers,
a lock on the run directory, and one clear message for a full disk.

train/, bench/ and deploy/ all write through this module.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .errors import GpuaccelError

TEMPORARY_SUFFIX = ".tmp"


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def disk_full_error(path, exc: OSError) -> GpuaccelError:
    return GpuaccelError(f"no space left on device while writing {path}; free some space and resume the run")


def _chain(exc: BaseException | None):
    """``exc`` and the exceptions it was raised from or while handling, newest first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, is a full disk
    or quota: torch.save reports one as RuntimeError("[enforce fail at inline_container.cc...]"),
    raised while handling the OSError of the write that failed."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, RuntimeError) and ("No space left" in str(e) or "file write failed" in str(e)):
            return True
    return False


def _interrupted(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt (Ctrl-C, or SIGTERM as the command maps it) is behind ``exc``:
    torch.save's zip writer turns one that arrives mid-write into a RuntimeError as it closes."""
    return any(isinstance(e, KeyboardInterrupt) for e in _chain(exc))


@contextlib.contextmanager
def replaced_atomically(path):
    """A temporary file name beside ``path``, for writers that take a name (exporters, ONNX
    Runtime's quantiser, torch.save). When the block ends without an error, the file written
    there is fsynced and renamed over ``path`` (atomic on POSIX file systems) and the directory
    fsynced: ``path`` is always either the old file or the whole new one. On an error the
    temporary file goes; a killed process leaves it, named ``.<name>.<random>.tmp``, for
    :func:`remove_stale_temporaries`. The new file gets the permissions a plain ``open`` would
    give (the umask's), not mkstemp's 0600."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX)
    try:
        os.fchmod(fd, 0o666 & ~_current_umask())
        os.close(fd)
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if _is_disk_full(exc):
            raise disk_full_error(path, exc) from None
        if _interrupted(exc) and not isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # the interrupt, as the command handles it, not the writer's error
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write(path, write) -> None:
    """Calls ``write(file)`` on a temporary file beside ``path`` that then replaces it
    (:func:`replaced_atomically`)."""
    with replaced_atomically(path) as tmp, open(tmp, "wb") as f:
        write(f)


def new_directory(path) -> Path:
    """Creates ``path``, or ``path~2``, ``path~3`` ... where that is taken (by an earlier run,
    or by another process that started in the same second): the directory returned was made by
    this call, so no other process writes into it by accident."""
    path = Path(path)
    make_directory(path.parent)
    candidate, suffix = path, 1
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            suffix += 1
            candidate = path.with_name(f"{path.name}~{suffix}")
        except OSError as exc:
            raise _cannot_create(candidate, exc) from None


# the files a run directory holds for itself (train/run_dir.py): no command's --out replaces them
RUN_FILES = frozenset({"config.json", "metrics.jsonl", "checkpoint.pt", "checkpoint.json", "model.pt", "best.pt",
                       "summary.json", ".lock"})


def owned_by_run(path) -> bool:
    """Whether ``path`` is one of a run directory's own files (checkpoints, settings, logs)."""
    path = Path(path)
    return (path.parent / "config.json").is_file() and (
        path.name in RUN_FILES or (path.name.startswith("gpu") and path.name.endswith(".jsonl")))


def output_file(path, *, force: bool = False, option: str = "--out") -> Path:
    """``path`` checked before any work: not a directory, not a run's own file (never replaced),
    not an existing file unless ``force``; its directory made where missing."""
    path = Path(path)
    if path.is_dir():
        raise GpuaccelError(f"{option} {path} is a directory; give a file name, e.g. {path / 'predictions.csv'}")
    if owned_by_run(path):
        raise GpuaccelError(f"{option} {path} is the run's own {path.name}; write the output elsewhere")
    if path.exists() and not force:
        raise GpuaccelError(f"{option} {path} exists; pass --force to replace it, or choose another file")
    make_directory(path.parent)
    return path


def make_directory(path) -> Path:
    """``path`` and its parents, made where missing; a one-line error where they cannot be (a
    read-only file system, no permission, a file in the way)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cannot_create(path, exc) from None
    if not os.access(path, os.W_OK):
        raise GpuaccelError(f"cannot write into {path}: permission denied; choose a directory you can write")
    return path


def _cannot_create(path: Path, exc: OSError) -> GpuaccelError:
    if _is_disk_full(exc):
        return disk_full_error(path, exc)
    return GpuaccelError(f"cannot create {path}: {exc.strerror or exc}; choose a directory you can write")


def write_json(path, data) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(data, indent=2, default=str) + "\n").encode()))


@contextlib.contextmanager
def scratch_directory(beside):
    """A directory for a command's intermediate files (an ONNX export to quantise, ONNX
    Runtime's prepared model), made beside the file ``beside`` names and removed at the end. A
    killed process leaves it, named ``.<name>.<random>.tmp`` like :func:`replaced_atomically`'s
    files, for :func:`remove_stale_temporaries` to remove; in the system's temporary directory
    it would stay until a reboot."""
    beside = Path(beside)
    path = Path(tempfile.mkdtemp(dir=beside.parent, prefix=f".{beside.name}.", suffix=TEMPORARY_SUFFIX))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_temporaries(directory) -> list[Path]:
    """Deletes the temporary files and scratch directories a killed process left behind in
    ``directory`` (an atomic write interrupted before its rename). Call it only while holding
    the directory's lock."""
    removed = []
    for tmp in Path(directory).glob(f".*{TEMPORARY_SUFFIX}"):
        try:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()
            removed.append(tmp)
        except FileNotFoundError:
            pass
    return removed


class MetricsFile:
    """``metrics.jsonl``: one JSON object per line, appended as one write.

    A process killed or a disk filled mid-append can leave a partial last line; readers skip
    a last line that does not parse (it is the one being written), and :meth:`repair`
    removes it before a resumed run appends again.
    """

    def __init__(self, path):
        self.path = Path(path)

    def append(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            written = os.write(fd, line)
            if written != len(line):  # a short write: the disk filled
                raise OSError(errno.ENOSPC, "short write")
        except OSError as exc:
            if _is_disk_full(exc):
                raise disk_full_error(self.path, exc) from None
            raise
        finally:
            os.close(fd)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        records = []
        lines = self.path.read_bytes().split(b"\n")
        for number, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                if number >= len(lines) - 2:  # the last line, torn by a crash: not a record yet
                    break
                raise GpuaccelError(f"{self.path}: line {number + 1} is not JSON") from None
        return records

    def rewrite(self, records: list[dict]) -> None:
        atomic_write(self.path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))

    def repair(self, keep=lambda record: True) -> list[dict]:
        """Rewrites the file with the readable records that ``keep`` accepts; returns them."""
        kept = [r for r in self.read() if keep(r)]
        if self.path.exists():
            self.rewrite(kept)
        return kept


@contextlib.contextmanager
def run_directory_lock(directory):
    """The run lock of ``directory`` while a command writes into it (export, quantize, prune),
    where it is a run directory (it holds config.json): a process training there, or another
    command writing there, makes this one a one-line error instead of a mix of files."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        yield
        return
    with RunLock(directory):
        remove_stale_temporaries(directory)
        yield


class RunLock:
    """An exclusive lock on a run directory while a process trains in it.

    ``.lock`` holds the owner's process id and host. A second process gets a one-line error
    naming the holder; a lock whose process is gone (killed, crashed) is taken over.
    """

    NAME = ".lock"

    def __init__(self, directory):
        self.path = Path(directory) / self.NAME
        self.held = False

    def acquire(self) -> "RunLock":
        me = f"{os.getpid()} {os.uname().nodename}"
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                holder = self._holder()
                if holder is not None:
                    pid, host = holder
                    raise GpuaccelError(f"{self.path.parent} is in use by process {pid}"
                                        f"{'' if host == os.uname().nodename else ' on ' + host}; "
                                        f"wait for it to finish or choose another --run-dir")
                try:  # the holder is gone: take the lock over
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            except OSError as exc:
                if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise GpuaccelError(f"cannot write into {self.path.parent} ({exc.strerror}): a command locks a "
                                        f"run directory while it writes there; copy the run to a folder you can "
                                        f"write, or write the output elsewhere (--out)") from None
                raise
            with os.fdopen(fd, "w") as f:
                f.write(me + "\n")
            self.held = True
            return self
        raise GpuaccelError(f"could not lock {self.path.parent}: another process keeps taking it")

    def _holder(self) -> tuple[int, str] | None:
        """(pid, host) of a live holder; None when the lock is stale (or vanished)."""
        try:
            text = self.path.read_text().split()
        except FileNotFoundError:
            return None
        if len(text) < 2 or not text[0].isdigit():
            # being written right now, or garbage: a fresh one is live, an old one is stale
            try:
                return (0, "?") if time.time() - self.path.stat().st_mtime < 5 else None
            except FileNotFoundError:
                return None
        pid, host = int(text[0]), text[1]
        if host != os.uname().nodename:
            return pid, host  # another machine's process cannot be checked: assume it is alive
        if pid == os.getpid():
            return None  # this process's own (a second Trainer in one process, after the first)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid, host

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
