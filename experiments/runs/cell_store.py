"""Finished cells on disk, one JSON file each, so an interrupted or failed run resumes.

A sweep keeps its cells in `OUT/cells/` for good (they are its cache); `compare` keeps
them in `OUT.partial/` while it runs and removes that folder once the report is in place,
so a compare that was interrupted or lost a worker reruns only the cells it had not
finished. A file is named by `CellConfig.key()`, which hashes the whole configuration
including its provenance (code version, input file digests): stale cells are never
reused. A file counts only if it parses and holds the results its protocol produces (under
serving, every request's record too: `runner.PER_REQUEST`); a torn, empty or error file is
run again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from experiments.runs.output_dir import write_file_atomically
from experiments.runs.runner import PER_REQUEST, CellConfig

#: the result sections each protocol produces
SECTIONS = {"replay": ("replay",), "serving": ("serving",), "both": ("replay", "serving")}


class CellStore:
    """A folder of finished cells keyed by `CellConfig.key()`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, cfg: CellConfig) -> Path:
        return self.directory / f"{cfg.key()}.json"

    def load(self, cfg: CellConfig) -> dict[str, Any] | None:
        """The cell's saved result, or None when it has none that is whole and current."""
        try:
            res = json.loads(self.path(cfg).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(res, dict) or res.get("config") != json.loads(json.dumps(cfg.as_dict())):
            return None
        if not all(isinstance(res.get(s), dict) for s in SECTIONS[cfg.protocol]):
            return None
        if "serving" in SECTIONS[cfg.protocol] and not isinstance(res.get(PER_REQUEST), list):
            return None  # per_request.jsonl needs every request's record
        return res

    def save(self, cfg: CellConfig, result: dict[str, Any]) -> None:
        """Write atomically: an interrupted write never looks like a finished cell."""
        self.directory.mkdir(parents=True, exist_ok=True)
        write_file_atomically(self.path(cfg), json.dumps(result) + "\n")

    def discard(self) -> None:
        """Remove the whole folder (a compare's cells, once its report is in place)."""
        shutil.rmtree(self.directory, ignore_errors=True)
