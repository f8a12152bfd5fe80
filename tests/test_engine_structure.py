"""The engine's shape, checked: no import cycles anywhere in the project, and on the engine
path no `hasattr` capability probe, no function longer than a screen and none with more than
8 parameters (the policy's array rules, `kernels.py`, take the rows' fields one by one)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cachelib", "backends", "attention", "experiments")
#: the engine path: what a serving or replay run executes (its timing models included)
ENGINE = (
    sorted((ROOT / "experiments" / "engine").rglob("*.py"))
    + sorted((ROOT / "experiments" / "timing").rglob("*.py"))
    + [ROOT / "tests" / "cached_runner.py"]
)
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 8
#: functions over arrays whose parameters are the rows' fields (compiled by numba: no objects)
MANY_PARAMETERS = {ROOT / "experiments" / "engine" / "kernels.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _runtime_imports(tree: ast.AST) -> list[str]:
    """Modules imported anywhere in `tree` (inside functions too), except under `if TYPE_CHECKING:`."""
    for node in ast.walk(tree):  # first drop the type-checking blocks: they never run
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = [ast.Pass()]
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's own submodules are not edges
    to it: they run while its `__init__` does)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for target in _runtime_imports(ast.parse(path.read_text())):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            parts = target.split(".") if target else []
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in mods and dep != name and not name.startswith(dep + "."):
                    targets.add(dep)
        graph[name] = targets
    return graph


def test_no_import_cycles_in_the_project():
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            assert state.get(t) != 1, f"import cycle: {' -> '.join([*path, m, t])}"
            if t not in state:
                visit(t, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_workloads_do_not_import_the_engine():
    graph = _graph()
    for m, targets in graph.items():
        if m.startswith("experiments.workloads"):
            assert not {t for t in targets if t.startswith("experiments.engine")}, m


def test_engine_path_has_no_hasattr_and_short_functions():
    for path in ENGINE:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "hasattr", f"{path.name}:{node.lineno}: hasattr (declare a capability)"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= MAX_FUNCTION_LINES, f"{path.name}:{node.lineno} {node.name} is {length} lines"
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [
                    x.arg for x in (a.vararg, a.kwarg) if x is not None
                ]
                params = len([n for n in names if n not in ("self", "cls")])
                if path not in MANY_PARAMETERS:
                    assert params <= MAX_PARAMETERS, f"{path.name}:{node.lineno} {node.name} takes {params} parameters"


# -- the import facts docs/architecture.md states ------------------------------------------------


def _imports_of(prefix: str) -> dict[str, set[str]]:
    """Module -> the project modules it imports at run time (under `prefix`)."""
    graph = _graph()
    return {m: t for m, t in graph.items() if m == prefix or m.startswith(prefix + ".")}


def _roots(targets: set[str]) -> set[str]:
    return {t.split(".")[0] for t in targets}


def test_the_contract_and_the_backends_import_no_experiment_and_no_attention():
    for prefix in ("cachelib", "backends"):
        for m, targets in _imports_of(prefix).items():
            assert not _roots(targets) & {"experiments", "attention"}, (m, targets)


def test_the_engine_imports_the_contract_itself_the_spec_and_the_errors_only():
    allowed = (
        "cachelib",
        "experiments.engine",
        "experiments.workloads.spec",
        "experiments.errors",
        "experiments.timing.zoo",
    )
    for m, targets in _imports_of("experiments.engine").items():
        for t in targets:
            if t in (
                "experiments",
                "experiments.workloads",
                "experiments.timing",
            ):  # packages a dotted import passes through
                continue
            if t.startswith("attention"):
                assert m == "experiments.engine.executors" and t in ("attention", "attention.model"), (m, t)
                continue
            assert any(t == a or t.startswith(a + ".") for a in allowed), (m, t)


def test_attention_model_is_imported_only_inside_functions_outside_attention():
    for name, path in _modules().items():
        if name.startswith(("attention", "experiments.bench")):
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level: only the config (shapes, no torch)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attention"):
                assert node.module == "attention.config", (name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("attention") for a in node.names), name


def test_workloads_import_no_engine_run_report_or_cli():
    for m, targets in _imports_of("experiments.workloads").items():
        bad = {
            t
            for t in targets
            if t.startswith(("experiments.engine", "experiments.runs", "experiments.report", "experiments.cli"))
        }
        assert not bad, (m, bad)
