"""The benchmarks' house: the scripts of scripts/ are entry points that import their library, zoffbench, from the
environment (no `sys.path` edits), and zoffbench's modules import one another one way (no circle) and no script."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
PACKAGE = REPO / "zoffbench"


def edits_of_sys_path(path: Path) -> list[int]:
    """The lines of `path` that change the module search path: sys.path's methods, an assignment to it, site's."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and ast.unparse(node) in ("sys.path", "site.addsitedir"):
            lines.append(node.lineno)
    return lines


def test_no_script_edits_sys_path():
    edits = [f"{path.relative_to(REPO)}:{line}" for path in sorted(SCRIPTS.rglob("*.py"))
             for line in edits_of_sys_path(path)]
    assert not edits, "import from zoffbench (installed with the checkout) instead:\n" + "\n".join(edits)


def test_the_check_sees_an_edit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nfrom pathlib import Path\n\nsys.path.insert(0, str(Path(__file__).parent))\n")
    assert edits_of_sys_path(script) == [4]


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function, by its absolute name."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: zoffbench imports by absolute name"
            names.add(node.module or "")
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def package_imports() -> dict[str, set[str]]:
    """zoffbench's modules, each with the zoffbench modules it imports."""
    modules = {".".join(("zoffbench", *path.relative_to(PACKAGE).with_suffix("").parts)): path
               for path in PACKAGE.rglob("*.py") if path.stem != "__init__"}
    return {name: imported_modules(path) & set(modules) for name, path in modules.items()}


def test_zoffbench_has_no_import_circle():
    graph = package_imports()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "an import circle: " + " -> ".join([*path[path.index(module):], module])
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
    assert graph["zoffbench.runs"] >= {"zoffbench.fabric_run", "zoffbench.host_floor"}  # the graph is read
    assert graph["zoffbench.checks.overlap"] >= {"zoffbench.harness", "zoffbench.recorders"}


def test_zoffbench_imports_no_script():
    scripts = {path.stem for path in SCRIPTS.rglob("*.py")}
    strays = {f"{path.name}: {name}" for path in PACKAGE.rglob("*.py") for name in imported_modules(path)
              if name.split(".")[0] in scripts}
    assert not strays, sorted(strays)
