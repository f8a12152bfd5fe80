"""Output folders that are never mixed or half-written.

- `OutputLock(OUT)` holds `OUT.lock` (a sibling file) with a non-blocking `flock`, so a
  second run into the same folder fails at once; the kernel drops the lock when the
  process dies, however it dies. The lock file itself stays (removing it would let two
  runs lock two different files of the same name); it is empty and harmless.
- `StagedDir(OUT)` is a fresh temporary sibling (same filesystem) that a run writes into;
  `publish()` swaps it with OUT in one `renameat2(RENAME_EXCHANGE)` call, so at every
  instant OUT holds the previous complete output or the new one, then removes the previous
  one. Where the filesystem or libc lacks the exchange, it falls back to renaming OUT aside
  and the new folder in: between those two renames (microseconds) OUT does not exist, and
  a crash exactly there leaves the previous output in `.OUT.old-*` beside it.
  Leaving the block unpublished (an error, Ctrl-C) removes the temporary folder; the
  temporary folders of a run that was killed are removed by the next run that takes the lock.
  Entries of the old folder that the run does not own (`owned`: glob patterns, e.g. a
  `replay --output OUT/replay.json` beside a report) are carried into the new folder, so
  replacing a report never deletes someone else's file; owned ones (a plot this run no
  longer draws) go with the old output, so nothing of two runs is mixed.
- `check_replaceable` refuses, before any work, to replace a folder that is neither new,
  empty nor a previous output (`--output-dir .` or `reports/` must not be swapped away).
- `check_writable_dir` / `check_writable_file` run before any work, so an unwritable output
  fails in a second with one line instead of after the experiment.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import fnmatch
import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from experiments.errors import InputError
from experiments.runs.interrupts import DeferredInterrupts

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class OutputError(InputError):
    """The output cannot be written or is in use by another run; one line for the user."""


def _staging_prefix(final: Path) -> str:
    return f".{final.name}.staging-"


def _old_prefix(final: Path) -> str:
    return f".{final.name}.old-"


def check_writable_dir(path: Path) -> None:
    """`path` can be created or replaced: its parent exists (made if needed), is a folder we
    can write, and `path` is not a file. Raises `OutputError`."""
    path = Path(os.path.abspath(path))
    if path.exists() and not path.is_dir():
        raise OutputError(f"output folder {path} exists and is not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.mkdtemp(prefix=_staging_prefix(path), dir=path.parent)
        os.rmdir(probe)
    except OSError as exc:
        raise OutputError(f"output folder {path} is not writable: {exc.strerror} ({exc.filename})") from None


def check_replaceable(path: Path, marker: str) -> None:
    """`path` is absent, empty, or a previous output (holds `marker`). Raises `OutputError`."""
    if path.is_dir() and any(path.iterdir()) and not (path / marker).is_file():
        raise OutputError(
            f"output folder {path} is not empty and holds no {marker}, so it is not a previous output "
            "and is not replaced; choose a new or empty folder"
        )


def check_writable_file(path: Path) -> None:
    """A file can be written at `path` (its folder made if needed). Raises `OutputError`."""
    if path.is_dir():
        raise OutputError(f"output {path} is a folder, not a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"output {path} is not writable: {exc.strerror} ({exc.filename})") from None


def write_file_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary sibling, then rename it over `path`: readers see the old
    file or the new one, never a torn one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class OutputLock:
    """An exclusive, non-blocking lock on an output folder (`OUT.lock` beside it)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(os.path.abspath(out_dir))  # "." has no name to put a lock beside
        self.path = out_dir.with_name(out_dir.name + ".lock")
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"output folder {self.out_dir} is not writable: {exc.strerror} ({self.path})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(
                f"output folder {self.out_dir} is in use by another run (it holds {self.path}); "
                "wait for it to finish or choose another --output-dir"
            ) from None
        self._fd = fd
        self._remove_stale()
        return self

    def _remove_stale(self) -> None:
        """Temporary siblings left by a run that was killed: under the lock none is live."""
        parent = self.out_dir.parent
        stale = [_staging_prefix(self.out_dir)]
        if self.out_dir.exists():  # otherwise an `.old-` folder may be the only complete output
            stale.append(_old_prefix(self.out_dir))
        for entry in parent.iterdir():
            if entry.is_dir() and entry.name.startswith(tuple(stale)):
                shutil.rmtree(entry, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


class StagedDir:
    """A temporary sibling of `final` to write a complete output into, then `publish()`.

    `owned`: glob patterns of the entries a run writes (default: all); the old folder's
    other entries are carried over."""

    def __init__(self, final: Path, owned: tuple[str, ...] = ("*",)) -> None:
        self.final = Path(os.path.abspath(final))  # "." or "x/.." have no name to stage beside
        self.owned = owned
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=_staging_prefix(final), dir=final.parent))
        self.published = False

    def __enter__(self) -> StagedDir:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.published:
            shutil.rmtree(self.path, ignore_errors=True)

    def publish(self) -> None:
        """Put the staged folder at `final`, replacing what was there, and remove the old one.

        SIGINT/SIGTERM are held back for the swap and its bookkeeping, so an interrupt
        lands before it (old output stays) or after it (new output is in place)."""
        self._carry_over()
        with DeferredInterrupts():
            previous = self._swap()
            self.published = True
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    def _carry_over(self) -> None:
        """Hard-link (copy where links fail) the old folder's entries the run does not own."""
        if not self.final.is_dir():
            return
        for entry in self.final.iterdir():
            target = self.path / entry.name
            if target.exists() or any(fnmatch.fnmatch(entry.name, p) for p in self.owned):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, target, symlinks=True, copy_function=link_or_copy)
            else:
                link_or_copy(entry, target)

    def _swap(self) -> Path | None:
        """Move the staged folder to `final`; returns where the previous output now is."""
        if not self.final.exists():
            os.rename(self.path, self.final)
            return None
        if _exchange(self.path, self.final):
            return self.path  # the staging name now holds the previous output
        aside = Path(tempfile.mkdtemp(prefix=_old_prefix(self.final), dir=self.final.parent))
        os.rename(self.final, aside / "previous")
        os.rename(self.path, self.final)
        return aside


def link_or_copy(src: str | Path, dst: str | Path) -> None:
    """Hard-link `src` at `dst` (no bytes copied), or copy it where links fail."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:  # not glibc >= 2.28 (macOS, musl before 1.2.?)
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # a filesystem without the exchange (some network and overlay mounts)
    raise OSError(err, os.strerror(err), str(b))
