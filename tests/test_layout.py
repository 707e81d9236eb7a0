"""The source tree is described where a reader looks, and the tests mirror it: `docs/layout.md` is what
`docs/layout.py` generates from the modules' docstrings, its floor order is the import graph's, and every
package of `src/paralm` has its folder under `tests/`."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tests.test_import_graph import CORE, import_graph, unit_graph

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "paralm"


def _generator():
    spec = importlib.util.spec_from_file_location("layout_page", ROOT / "docs" / "layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layout_page_is_generated_from_the_tree():
    generator = _generator()
    page = (ROOT / "docs" / "layout.md").read_text()
    assert page == generator.layout_page(), (
        f"docs/layout.md is out of date with src/paralm: run `{generator.REGENERATE}`"
    )


def test_layout_lists_every_module_with_its_docstring():
    page = (ROOT / "docs" / "layout.md").read_text()
    for package in (p.parent for p in SOURCE.rglob("__init__.py") if p.parent != SOURCE):
        unit = package.relative_to(SOURCE).parts[0]
        for module in package.glob("*.py"):
            if module.parent != SOURCE / unit or module.name != "__init__.py":
                name = module.relative_to(SOURCE).as_posix()
                assert f"| `{name}` |" in page.split(f"### `{unit}/`", 1)[1], f"docs/layout.md lacks {name}"


def test_each_unit_imports_only_the_floors_below_it():
    order = _generator().units()
    units = unit_graph(import_graph())
    upward = {u: sorted(t for t in units.get(u, ()) if t in order and order.index(t) > order.index(u)) for u in order}
    assert not {u: t for u, t in upward.items() if t}, (
        f"docs/layout.py's floor order is not the import graph's: {upward}"
    )


def test_the_core_stated_is_the_import_rules_core():
    layout = " ".join((ROOT / "docs" / "layout.md").read_text().split())
    stated = re.search(r"core = ([^.]*)\(plus ([^)]*)\)", layout)
    assert stated, "docs/layout.md states the core as 'core = ... (plus ...)'"
    named = {w.strip() for w in re.split(r",|\band\b", stated.group(1) + "," + stated.group(2)) if w.strip()}
    assert named == CORE, f"docs/layout.md's core {sorted(named)} is not tests/test_import_graph.py's {sorted(CORE)}"
    assert set(_generator().CORE) == CORE, "docs/layout.py's CORE floors are not tests/test_import_graph.py's CORE"


def test_every_package_has_a_test_folder():
    packages = [p.parent.relative_to(SOURCE) for p in SOURCE.rglob("__init__.py") if p.parent != SOURCE]
    missing = sorted(str(p) for p in packages if not (ROOT / "tests" / p / "__init__.py").exists())
    assert not missing, f"tests/ does not mirror src/paralm: no tests/<package>/ (with __init__.py) for {missing}"
    strays = sorted(
        str(d.relative_to(ROOT / "tests"))
        for d in (ROOT / "tests").rglob("*")
        if d.is_dir()
        and (d / "__init__.py").exists()
        and d.name != "__pycache__"
        and not (SOURCE / d.relative_to(ROOT / "tests")).is_dir()
    )
    assert not strays, f"test folders for no package of src/paralm: {strays}"
