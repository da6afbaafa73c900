"""The house: a core that imports no Lightning, a config and a sharding that load no engine (the config no placement
either), a placement that loads none of the step's pipeline, an engine and a placement whose outsiders use only what
their packages export, a library that imports neither its application (app/) nor its examples, and two front doors
that importing the package registers, whichever comes first. Each import check runs in a fresh Python process, so what
this one imported does not count; the checks of what a module imports read its source."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
PACKAGE = REPO / "lightning_zoff"
CORE = ("lightning_zoff.offload", "lightning_zoff.placement", "lightning_zoff.training", "lightning_zoff.sharding",
        "lightning_zoff.checkpoint", "lightning_zoff.checkpoint.consolidate", "lightning_zoff.config",
        "lightning_zoff.precision_math", "lightning_zoff.optim", "lightning_zoff.ops")


def python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


@pytest.mark.slow
def test_the_core_loads_neither_lightning_pytorch_nor_lightning_fabric():
    loaded = python(f"import sys\nfor m in {CORE!r}: __import__(m)\n"
                    "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))")
    assert loaded == "[]"


@pytest.mark.slow
def test_the_config_loads_no_engine():
    # ZoffConfig is what a door, the CLI and README's table read: loading it must not load the engine, placement, the
    # optimizers or the kernels
    loaded = python("import sys\nimport lightning_zoff.config\n"
                    "print(sorted(m for m in sys.modules if m.startswith(('lightning_zoff.offload',"
                    " 'lightning_zoff.placement', 'lightning_zoff.optim', 'lightning_zoff.ops'))))")
    assert loaded == "[]"


def exported_by(package: str) -> set[str]:
    tree = ast.parse((PACKAGE / package / "__init__.py").read_text())
    (names,) = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["__all__"]]
    return set(names)


def imports_of(path: Path, package: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of each import of `lightning_zoff.<package>` or a module in it in `path` (name None for
    `import module`) that runs, not those under `if TYPE_CHECKING:` (placement's mover names the pipeline's types);
    relative imports resolved against the file's package."""
    here = ["lightning_zoff", *path.relative_to(PACKAGE).parent.parts]
    found = []
    tree = ast.parse(path.read_text())
    skipped = type_checking_only(tree)
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [(node.lineno, module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
    top = f"lightning_zoff.{package}"
    return [(line, module, name) for line, module, name in found if module == top or module.startswith(top + ".")]


# the engine's outsiders are every other package; placement's, every package but the engine's pipeline, which builds on
# placement's parts (the mover, the host buffers, the plan's constants)
@pytest.mark.parametrize(("package", "insiders"), [("offload", ("offload",)), ("placement", ("placement", "offload"))])
def test_code_outside_a_package_imports_only_what_it_exports(package, insiders):
    exported = exported_by(package)
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if {PACKAGE / insider for insider in insiders} & set(path.parents):
            continue
        for line, module, name in imports_of(path, package):
            if module != f"lightning_zoff.{package}" or name not in exported:
                strays.append(f"{path.relative_to(REPO)}:{line}: {module} {name or ''}".rstrip())
    assert not strays, f"import these from lightning_zoff.{package} (export them there first):\n" + "\n".join(strays)


@pytest.mark.slow
def test_importing_the_package_registers_both_doors_when_lightning_comes_after_it():
    out = python("import sys\nimport lightning_zoff\nassert 'lightning' not in sys.modules\n"
                 "from lightning.fabric import Fabric\nfrom lightning.pytorch import Trainer\n"
                 "fabric = Fabric(accelerator='cpu', devices=2, strategy='zoff')\n"
                 "trainer = Trainer(accelerator='cpu', devices=2, strategy='zoff_no_offload', logger=False)\n"
                 "print(type(fabric.strategy).__name__, type(trainer.strategy).__name__)")
    assert out.splitlines()[-1] == "ZoffFabricStrategy ZoffStrategy"


@pytest.mark.slow
def test_importing_the_package_registers_both_doors_when_lightning_came_before_it():
    out = python("from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
                 "from lightning.pytorch.strategies import StrategyRegistry\nimport lightning_zoff\n"
                 "print(sorted(n for n in (*STRATEGY_REGISTRY, *StrategyRegistry) if n.startswith('zoff')))")
    assert out == "['zoff', 'zoff', 'zoff_no_offload', 'zoff_no_offload']"


def module_path(module: str) -> Path | None:
    """The file of `module` of the package (a package's __init__.py), None if it is not one."""
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The nodes under `if TYPE_CHECKING:`: imports for annotations alone, which Python never runs."""
    return {inner for node in ast.walk(tree) if isinstance(node, ast.If)
            and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for statement in node.body for inner in ast.walk(statement)}


def package_imports(path: Path, runtime: bool = False) -> set[str]:
    """The modules of lightning_zoff that `path` imports (`from package import module` counts the module); `runtime`:
    only those it loads when it runs (not those under `if TYPE_CHECKING:`)."""
    package = ["lightning_zoff", *path.relative_to(PACKAGE).parent.parts]
    found = set()
    tree = ast.parse(path.read_text())
    skipped = type_checking_only(tree) if runtime else set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names if module_path(f"{module}.{alias.name}")}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {module for module in found if module.split(".")[0] == "lightning_zoff" and module_path(module)}


def loaded_with(module: str, runtime: bool = False) -> set[str]:
    """Every module of lightning_zoff that importing `module` loads, its packages' __init__ included (`runtime`:
    leaving out what is imported for type checking alone)."""
    loaded: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for found in {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - loaded:
            loaded.add(found)
            path = module_path(found)
            assert path is not None, found
            todo += package_imports(path, runtime)
    return loaded


def test_the_library_imports_neither_its_application_nor_its_examples():
    # app/ (the main job's and the CLI's machinery) and examples/ use the library, never the other way round; the
    # CLI's command is the application's
    outside = ("lightning_zoff.app", "lightning_zoff.examples")
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if {PACKAGE / "app", PACKAGE / "examples"} & set(path.parents) or path == PACKAGE / "cli.py":
            continue
        strays += [f"{path.relative_to(REPO)}: {module}" for module in sorted(package_imports(path))
                   if module.startswith(outside)]
    assert not strays, "\n".join(strays)


def test_sharding_loads_no_engine():
    # how the model is cut into units: the engine plans and steps them, sharding knows nothing of it
    engine = ("lightning_zoff.offload", "lightning_zoff.optim", "lightning_zoff.ops")
    assert sorted(m for m in loaded_with("lightning_zoff.sharding") if m.startswith(engine)) == []


def test_placement_loads_none_of_the_step_pipeline():
    # the plan, the policy and the mover sit under the engine, which plans its units there and owns a mover: they name
    # the pipeline's types (the unit's state a move copies, the engine a rank's memory drives) for type checking only
    pipeline = ("lightning_zoff.offload", "lightning_zoff.optim", "lightning_zoff.ops")
    assert sorted(m for m in loaded_with("lightning_zoff.placement", runtime=True) if m.startswith(pipeline)) == []
