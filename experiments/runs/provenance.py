"""What produced a result: the package's version and commit, and the content of its input files.

A sweep's cell files and a compare's resumable cells are keyed by this too (`CellConfig.
provenance`), so an edited trace or new code makes new cells instead of reusing stale ones.
The commit is the one of the package's *own* checkout (`git -C <package dir>`), never the
current directory's: running from another repository must not record that repository.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

#: the distribution this package belongs to (pyproject.toml)
DISTRIBUTION = "prefix-cache-lab"
#: the package's checkout: experiments/ lives at its top level (this file: experiments/runs/)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
#: the packages whose code decides a cell's numbers; their uncommitted changes count too
CODE_PATHS = ("cachelib", "backends", "attention", "experiments")
#: workload config keys that name input files (mooncake/jsonl/text `path`, text `tokenizer`)
INPUT_FILE_KEYS = ("path", "tokenizer")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(PACKAGE_ROOT), *args], capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_commit() -> str:
    """The short commit of the package's own checkout, or "unknown" when it is not one:
    the checkout's top level must be `PACKAGE_ROOT` itself, so a copy installed into
    site-packages of a venv that lies inside some repository never reports that repository."""
    out = _git("rev-parse", "--show-toplevel", "--short", "HEAD")
    lines = out.splitlines() if out else []
    if len(lines) != 2 or Path(lines[0]).resolve() != PACKAGE_ROOT:
        return "unknown"
    return lines[1]


def package_version() -> str:
    """The installed distribution's version (pyproject.toml), "0" when it is not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0"


@functools.cache
def code_version() -> str:
    """`<version>+g<commit>`, plus `.dirty-<digest>` when the code paths have uncommitted changes.

    Cached per process: a process runs the code it imported when it started, so its cells
    all carry one version even if files change on disk meanwhile."""
    version = package_version()
    commit = git_commit()
    if commit == "unknown":
        return version  # an installed copy: the version is all there is
    diff = _git("diff", "HEAD", "--", *CODE_PATHS) or ""
    dirty = f".dirty-{hashlib.sha256(diff.encode()).hexdigest()[:10]}" if diff else ""
    return f"{version}+g{commit}{dirty}"


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (relative names and bytes, sorted)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def provenance(workload_config: dict[str, Any], profile: str | None = None) -> dict[str, str]:
    """The code version and, for each input file the workload read and the profile table the
    executor reads (`--profile`), its content digest: a changed table is a new cell."""
    out = {"code": code_version()}
    for key in INPUT_FILE_KEYS:
        value = workload_config.get(key)
        if isinstance(value, str) and Path(value).exists():
            out[f"{key}_sha256"] = file_digest(Path(value))
    if profile is not None and Path(profile).is_file():
        out["profile_sha256"] = file_digest(Path(profile))
    return out
