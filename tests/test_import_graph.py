"""The package's import graph has no circle: every module can be understood from those below it; and its
folders stand in floors: no two top-level units (a package, or a module at the root) import each other,
and the core never imports a wing.

Imports are read with `ast` from the source, at module level, inside functions (a lazy import still
ties the two modules together) and under `if TYPE_CHECKING:` (a type-only import too: the module
cannot be read without the one it names).
"""

import ast
from pathlib import Path

import paralm

SOURCE = Path(paralm.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def import_graph() -> dict[str, set[str]]:
    """paralm module -> the paralm modules it imports (a name imported from a package counts as its
    submodule when there is one, else as the package)."""
    modules = {_module_name(p): p for p in SOURCE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = {t for t in _imports(ast.parse(path.read_text())) if t in modules}
        graph[name] = {t for t in targets if t != name and t != "paralm"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_reader_finds_a_circle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_type_only_imports_count():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from paralm.train.trainer import Trainer\n"
    assert "paralm.train.trainer" in _imports(ast.parse(source))


def test_the_graph_covers_the_package():
    graph = import_graph()
    assert "paralm.parallel.parallelize" in graph["paralm.train.engine"]
    assert "paralm.config.schema" in graph["paralm.cli"] or any("paralm.config.schema" in g for g in graph.values())


def test_paralm_has_no_import_circle():
    assert find_cycle(import_graph()) is None


def test_the_parameter_server_runs_on_the_step_engine_not_the_trainer():
    graph = import_graph()
    assert "paralm.train.engine" in graph["paralm.param_server.worker"]
    assert not {
        m for m, targets in graph.items() if m.startswith("paralm.param_server") and "paralm.train.trainer" in targets
    }


def test_the_config_imports_nothing_from_parallel():
    assert not {m for m in import_graph()["paralm.config.schema"] if m.startswith("paralm.parallel")}


# The core trains a model; the wings (the planner, sweeps, evidence, lm-eval, the parameter server, the
# post-training verbs, finished-run I/O, the verbs and the job) are built on it. torchtitan's rule for its
# experiments: they import the core, never the reverse.
CORE = {
    *("config", "models", "data", "convert", "parallel", "sync", "launch", "train", "observe"),
    *("compat", "errors", "hardware"),
}


def unit_of(module: str) -> str:
    """The top-level unit a module belongs to: `paralm.train.engine` -> `train`, `paralm.cli` -> `cli`."""
    return module.split(".")[1]


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module != "paralm":
            units.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets)
    return {unit: targets - {unit} for unit, targets in units.items()}


def two_way_pairs(units: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in units.items() for b in targets if a < b and a in units.get(b, ()))


def test_the_unit_reader_finds_a_two_way_pair():
    graph = {"paralm.a.x": {"paralm.b.y"}, "paralm.b.y": set(), "paralm.b.z": {"paralm.a.w"}, "paralm.a.w": set()}
    assert two_way_pairs(unit_graph(graph)) == [("a", "b")]


def test_no_two_top_level_units_import_each_other():
    assert two_way_pairs(unit_graph(import_graph())) == []


def test_the_core_imports_no_wing():
    units = unit_graph(import_graph())
    assert set(units) >= CORE, "a core unit was renamed: update CORE"
    reaching_up = {unit: sorted(targets - CORE) for unit, targets in units.items() if unit in CORE and targets - CORE}
    assert reaching_up == {}


if __name__ == "__main__":  # the figures of the closing note: circles, two-way pairs, what the trainer imports
    graph = import_graph()
    print("cycle:", find_cycle(graph))
    print("two-way pairs of top-level units:", two_way_pairs(unit_graph(graph)))
    print("trainer imports from paralm.parallel:", sorted(m for m in graph["paralm.train.trainer"] if ".parallel" in m))
