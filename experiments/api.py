"""The Python API, for notebooks and scripts: the commands as functions returning results.

    from experiments import api
    res = api.compare(workload="shared_doc_qa", knobs={"zipf_a": 1.2},
                      backend=["apc", "radix"], capacity_fraction=[0.1, 0.5])
    df = res.to_pandas()          # one row per cell (needs pandas: the `pandas` extra)
    rows = res.per_request()      # per_request.jsonl as a DataFrame (serving cells)

Keyword arguments are the command's options, named as in a `--config` file
(experiments/runs/run_config.py): the flag without dashes, `-` as `_`, a list for an option that
takes several, `knobs` a dict. They go through the command line's own parser, so defaults,
checks and errors are the CLI's: bad input raises `InputError`, bad usage `UsageError`,
both before any work. Without `output_dir` the outputs go to a new temporary folder
(`Results.path`). `progress=False` (the default here) keeps a notebook's output clean.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from experiments.errors import InputError, UsageError
from experiments.report.labels import cell_label_of
from experiments.report.results import PER_REQUEST_FILE
from experiments.runs.run_config import to_argv

PANDAS_HINT = "pip install 'prefix-cache-lab[pandas]' (or pip install pandas)"


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises `UsageError` instead of printing and exiting: a library call
    must not end the user's interpreter."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


class Results:
    """The outputs of one `compare` or `run`: the results document and the files beside it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        file = self.path / "results.json" if self.path.is_dir() else self.path
        if not file.is_file():
            raise InputError(f"no results.json at {self.path}")
        self.path = file.parent
        self.document: dict[str, Any] = json.loads(file.read_text())

    @property
    def cells(self) -> list[dict[str, Any]]:
        return self.document["cells"]

    @property
    def run_config(self) -> dict[str, Any]:
        """The options the run resolved (what `--config` takes to repeat it)."""
        return self.document.get("run_config", {})

    def rows(self) -> list[dict[str, Any]]:
        """One flat dict per cell: its label and settings, then every number of its sections
        (`replay.hit_rate`, `serving.latency.ttft_ms.p99`, ...); lists (series) left out."""
        out = []
        for cell in self.cells:
            cfg = cell["config"]
            row: dict[str, Any] = {
                "backend": cell_label_of(cfg),
                "capacity_tokens": cfg["capacity_tokens"],
                "page_size": cfg["page_size"],
                "workload": cfg["workload"],
                "replicas": cfg.get("replicas", 1),
                "router": cfg.get("router"),
            }
            for section in ("kv_capacity", "replay", "serving", "cluster"):
                if isinstance(cell.get(section), dict):
                    _flatten(cell[section], section, row)
            out.append(row)
        return out

    def to_pandas(self) -> Any:
        """`rows()` as a pandas DataFrame (pandas is an optional extra)."""
        pd = _pandas()
        return pd.DataFrame(self.rows())

    def per_request(self) -> Any:
        """`per_request.jsonl` (every request of every serving cell) as a DataFrame."""
        pd = _pandas()
        path = self.path / PER_REQUEST_FILE
        if not path.is_file():
            raise InputError(f"{self.path} has no {PER_REQUEST_FILE} (no cell ran the serving protocol)")
        return pd.read_json(path, lines=True)

    def __repr__(self) -> str:
        doc = self.document
        return (
            f"Results({str(self.path)!r}: {doc['workload']['name']}, {len(self.cells)} cells, "
            f"backends {doc['backends']}, capacities {doc['capacities']})"
        )


def compare(*, output_dir: str | Path | None = None, progress: bool = False, **options: Any) -> Results:
    """`python -m experiments compare` with `options` (module docstring); the run's Results."""
    return _run("compare", output_dir, progress, options)


def run(backend: str, *, output_dir: str | Path | None = None, progress: bool = False, **options: Any) -> Results:
    """`python -m experiments run --backend BACKEND` with `options`; the run's Results."""
    return _run("run", output_dir, progress, {"backend": [backend], **options})


def load(path: str | Path) -> Results:
    """The Results of an earlier run: its output folder or its results.json."""
    return Results(path)


def _run(command: str, output_dir: str | Path | None, progress: bool, options: dict[str, Any]) -> Results:
    from experiments.cli.main import build_parser, commands

    parser = build_parser(_RaisingParser)
    sub = commands(parser)[command]
    for bad in ("output_dir", "no_progress", "config"):
        if bad in options:
            raise UsageError(f"{command}(): give {bad} as its own argument" if bad == "output_dir" else
                             f"{command}(): {bad} is not an API option (progress=True|False; settings as keywords)")  # fmt: skip
    out = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix=f"prefix-cache-{command}-"))
    argv = [command, *to_argv(sub, options, f"{command}()"), "--output-dir", str(out)]
    if not progress:
        argv.append("--no-progress")
    args = parser.parse_args(argv)
    args.argv = argv
    args.func(args)  # raises InputError / UsageError / TasksFailed; returns 0 when done
    return Results(out)


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise ImportError(f"Results.to_pandas() and per_request() need pandas: {PANDAS_HINT}") from None
    return pandas


def _flatten(tree: dict[str, Any], prefix: str, row: dict[str, Any]) -> None:
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            _flatten(value, name, row)
        elif isinstance(value, (int, float, str, bool)) or value is None:
            row[name] = value
