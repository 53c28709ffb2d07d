"""The layering of the house, held by an AST walk over every import (also those inside functions).

Rules (see docs/plugin-guide.md):

- ``plugins``: ``relax_plugins`` imports from ``relax`` only the plugin-facing modules
  (``relax.contracts``, ``relax.algo``, ``relax.media``, ``relax.weight_group``,
  ``relax.chat_templates``, ``relax.environment``), never the
  runtime or the spec: what a plugin needs comes in its context.
- ``light``: what ``relax validate`` and ``relax plan`` run (``relax.spec``, ``relax.plan``,
  ``relax.config``, ``relax.registry``, ``relax.contracts``) imports no heavy library and nothing
  of the runtime, the bus or telemetry.
- ``core``: ``relax`` never imports ``relax_plugins`` (plugins are found through entry points).
- ``algo``: ``relax.algo`` (pure math on tensors) imports no ray, no runtime and no bus.
- ``plugin-facing``: the modules plugins may import (``relax.contracts``, ``relax.media``,
  ``relax.weight_group``) import no ray and nothing of the runtime, so a plugin never pulls them in.
- ``rooms``: ``relax.runtime`` is grouped by the process that runs the code. ``driver`` and
  ``worker`` import ``state`` and the shared modules (``relax.runtime.*`` outside the rooms);
  ``state`` imports only the shared modules; a shared module imports no room. Between driver and
  worker there is one arrow: the driver names ``relax.runtime.worker.workers`` (``RoleWorker``, the
  class Ray starts each worker as).

``import_violations`` is the checker; the tests run it on this checkout (no violation) and on a
throwaway tree that breaks each rule once (each reported, with file, line and rule).

Two more checks hold docs/architecture.md to the code: ``table_mismatches`` (each package imports
exactly the ``relax`` modules its row of the package table names, and no library the row leaves
out; every module is in one row) and ``import_cycles`` (no circle of module-level imports in
``relax`` and ``relax_plugins``; an import runs the packages above what it names, so those count).
"""

from __future__ import annotations

import ast
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLUGIN_FACING = ("relax.contracts", "relax.algo", "relax.media", "relax.weight_group", "relax.chat_templates",
                 "relax.environment")
LIGHT = ("relax.spec", "relax.plan", "relax.config", "relax.registry", "relax.contracts")
HEAVY = ("torch", "ray", "vllm", "megatron", "transformers", "tensordict", "transferqueue")
RUNTIME_SIDE = ("relax.runtime", "relax.bus", "relax.telemetry")
ROOMS = ("driver", "state", "worker")
#: The rooms (and "shared") each room may import from.
ROOM_MAY_IMPORT = {"driver": {"driver", "state", "shared"}, "worker": {"worker", "state", "shared"},
                   "state": {"state", "shared"}, "shared": {"shared"}}
#: The driver starts worker processes, so it names the class Ray runs there; nothing else crosses.
DRIVER_STARTS = "relax.runtime.worker.workers"


@dataclass(frozen=True)
class Violation:
    """One import that breaks a rule: where it is, what it imports and which rule it breaks."""

    file: str
    line: int
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: imports {self.imported} ({self.rule})"


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Every module an AST imports, as absolute dotted names (relative imports resolved)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # ``from relax import runtime`` imports relax.runtime: name each imported submodule too.
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def _room(name: str) -> str | None:
    """The runtime room a module belongs to (``driver``, ``state``, ``worker``, or ``shared`` for the
    modules of ``relax.runtime`` outside them); None outside the runtime."""
    if not _under(name, ("relax.runtime",)):
        return None
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in ROOMS else "shared"


def _rules(module: str, imported: str) -> list[str]:
    broken = []
    top = imported.split(".")[0]
    if module.startswith("relax_plugins") and top == "relax" and imported != "relax" \
            and not _under(imported, PLUGIN_FACING):
        broken.append("plugins: relax_plugins may import only " + ", ".join(PLUGIN_FACING) + " from relax")
    if _under(module, LIGHT) and (top in HEAVY or _under(imported, RUNTIME_SIDE)):
        broken.append("light: " + ", ".join(LIGHT) + " import no " + ", ".join(HEAVY + RUNTIME_SIDE))
    if _under(module, ("relax",)) and top == "relax_plugins":
        broken.append("core: relax never imports relax_plugins")
    if _under(module, ("relax.algo",)) and (top == "ray" or _under(imported, ("relax.runtime", "relax.bus"))):
        broken.append("algo: relax.algo imports no ray, relax.runtime or relax.bus")
    if _under(module, ("relax.contracts", "relax.media", "relax.weight_group", "relax.chat_templates",
                       "relax.environment")) \
            and (top == "ray" or _under(imported, RUNTIME_SIDE)):
        broken.append("plugin-facing: relax.contracts, relax.media and relax.weight_group import no ray "
                      "and nothing of " + ", ".join(RUNTIME_SIDE))
    room, target = _room(module), _room(imported)
    if room is not None and target is not None and target not in ROOM_MAY_IMPORT[room] \
            and imported != "relax.runtime" and not (room == "driver" and _under(imported, (DRIVER_STARTS,))):
        broken.append(f"rooms: relax.runtime's {room} imports only from " + ", ".join(sorted(ROOM_MAY_IMPORT[room]))
                      + (f" (and {DRIVER_STARTS})" if room == "driver" else ""))
    return broken


def import_violations(root: Path) -> list[Violation]:
    """Every import under ``root/relax`` and ``root/relax_plugins`` that breaks a rule."""
    found: dict[tuple[str, int, str], Violation] = {}
    for package in ("relax", "relax_plugins"):
        for path in sorted((root / package).rglob("*.py")):
            module = _module_name(root, path)
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, imported in _imports(tree, module, path.name == "__init__.py"):
                for rule in _rules(module, imported):
                    key = (str(path.relative_to(root)), line, rule)
                    # One report per statement and rule: the module, not each name taken from it.
                    if key not in found or len(imported) < len(found[key].imported):
                        found[key] = Violation(key[0], line, imported, rule)
    return sorted(found.values(), key=lambda v: (v.file, v.line, v.rule))


def test_this_checkout_keeps_the_import_rules():
    violations = import_violations(ROOT)
    assert not violations, "import rules broken:\n" + "\n".join(map(str, violations))


def test_the_checker_reports_each_broken_rule(tmp_path):
    """A throwaway tree that breaks every rule once, in a function body or via a relative import
    where that is how it would slip through; each is reported with its file and line."""
    files = {
        "relax/__init__.py": "",
        "relax/contracts.py": "import pydantic\n",
        "relax/runtime/__init__.py": "",
        "relax/spec/__init__.py": "",
        "relax/spec/rules.py": "def f():\n    import torch\n",
        "relax/plan/__init__.py": "from ..runtime import controller\n",
        "relax/registry.py": "from relax_plugins.rewards import exact\n",
        "relax/algo/__init__.py": "",
        "relax/algo/losses.py": "import math\nimport ray\n",
        "relax/weight_group.py": "from relax.telemetry import tracing\n",
        "relax_plugins/__init__.py": "",
        "relax_plugins/rollout.py": "from relax.contracts import Generation\nfrom relax import spec\n",
        "relax_plugins/reward.py": "def build():\n    from relax.runtime.worker.components import build_plugin\n",
        # The runtime's rooms: allowed arrows first, then one of each kind of forbidden one.
        "relax/runtime/driver/deploy.py": "from relax.runtime.state.run_state import RunState\n"
                                          "from relax.runtime.metrics import step_row\n"
                                          "def launch():\n    from relax.runtime.worker.workers import RoleWorker\n"
                                          "from relax.runtime.worker.ranks import RankedTrainer\n",
        "relax/runtime/worker/role_env.py": "from relax.runtime.state import run_state\n"
                                            "from ...runtime.checkpoint import save\n"
                                            "def f():\n    from ..driver.controller import Controller\n",
        "relax/runtime/state/run_state.py": "from relax.runtime.state.ledger import Ledger\n"
                                            "from relax.runtime.worker import rows\n",
        "relax/runtime/metrics.py": "from relax.runtime.samples import console_line\n"
                                    "from relax.runtime.state.records import StepReport\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    found = {(v.file, v.line, v.rule.split(":")[0]) for v in import_violations(tmp_path)}
    assert found == {
        ("relax/spec/rules.py", 2, "light"),
        ("relax/plan/__init__.py", 1, "light"),  # the relative import resolves to relax.runtime
        ("relax/registry.py", 1, "core"),
        ("relax/algo/losses.py", 2, "algo"),
        ("relax/weight_group.py", 1, "plugin-facing"),
        ("relax_plugins/rollout.py", 2, "plugins"),
        ("relax_plugins/reward.py", 2, "plugins"),
        ("relax/runtime/driver/deploy.py", 5, "rooms"),  # the driver reaches past the worker's entry class
        ("relax/runtime/worker/role_env.py", 4, "rooms"),  # a worker imports the driver (relative import)
        ("relax/runtime/state/run_state.py", 2, "rooms"),  # the run state imports a worker module
        ("relax/runtime/metrics.py", 2, "rooms"),  # a shared module imports a room
    }


def test_a_violation_names_the_file_line_and_rule(tmp_path):
    (tmp_path / "relax").mkdir()
    (tmp_path / "relax_plugins").mkdir()
    (tmp_path / "relax_plugins" / "judge.py").write_text("\n\nimport relax.spec.models\n")
    [violation] = import_violations(tmp_path)
    assert str(violation).startswith("relax_plugins/judge.py:3: imports relax.spec.models (plugins: ")


# --- docs/architecture.md's package table, and circles ------------------------------------------------

ARCHITECTURE = Path("docs") / "architecture.md"


def _python_files(root: Path, path: str) -> list[Path]:
    target = root / path
    return sorted(target.rglob("*.py")) if target.is_dir() else [target]


def package_table(text: str) -> list[tuple[list[str], set[str], bool]]:
    """The rows of architecture.md's package table: the paths of the first column, the backticked
    names of the imports column (``spec``: ``relax.spec``; ``torch``: a library), and whether that
    column allows any library ("any library": the plugins bring their own)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| package | holds | imports"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        rows.append((_backticked(cells[0]), set(_backticked(cells[-1])), "any library" in cells[-1]))
    return rows


def _backticked(cell: str) -> list[str]:
    return cell.split("`")[1::2]


def _relax_modules(root: Path) -> set[str]:
    """The names under ``relax``: its subpackages and modules (``spec``, ``roles``, ...)."""
    return {p.stem if p.suffix == ".py" else p.name for p in (root / "relax").iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}


def _imported_names(root: Path, files: list[Path], relax_names: set[str]) -> tuple[set[str], set[str]]:
    """What the files import (also inside functions): the ``relax`` modules by short name, and the
    third-party libraries by top-level name (the standard library left out)."""
    inner, libraries = set(), set()
    for path in files:
        module = _module_name(root, path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for _, imported in _imports(tree, module, path.name == "__init__.py"):
            parts = imported.split(".")
            if parts[0] == "relax" and len(parts) > 1 and parts[1] in relax_names:
                inner.add(parts[1])
            elif parts[0] not in ("relax", "relax_plugins", "__future__") and parts[0] not in sys.stdlib_module_names:
                libraries.add(parts[0])
    return inner, libraries


def table_mismatches(root: Path) -> list[str]:
    """Where architecture.md's package table and the code disagree: a package importing a module
    or library its row does not name, a ``relax`` module its row names that it does not import,
    or a module of ``relax``/``relax_plugins`` in no row (or in two)."""
    relax_names = _relax_modules(root)
    problems, covered = [], {}
    for paths, declared, any_library in package_table((root / ARCHITECTURE).read_text()):
        files = [f for p in paths for f in _python_files(root, p)]
        for f in files:
            if f in covered:
                problems.append(f"{f.relative_to(root)} is in two rows ({covered[f]} and {paths[0]})")
            covered[f] = paths[0]
        own = {p.split("/")[1].removesuffix(".py") for p in paths if p.startswith("relax/") and "/" in p}
        inner, libraries = _imported_names(root, files, relax_names)
        inner -= own
        declared_inner = {name for name in declared if name in relax_names}
        for name in sorted(inner - declared_inner):
            problems.append(f"{', '.join(paths)} imports relax.{name}, which its row does not name")
        for name in sorted(declared_inner - inner):
            problems.append(f"{', '.join(paths)} names relax.{name} in its row but does not import it")
        for name in sorted(libraries - declared if not any_library else ()):
            problems.append(f"{', '.join(paths)} imports {name}, which its row does not name")
    for package in ("relax", "relax_plugins"):
        for f in sorted((root / package).rglob("*.py")):
            if f not in covered:
                problems.append(f"{f.relative_to(root)} is in no row of the package table")
    return problems


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run while the module is imported: not those in function bodies, nor those
    under ``if TYPE_CHECKING:``."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        else:
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return found


def import_cycles(root: Path) -> list[list[str]]:
    """The circles of module-level imports in ``relax`` and ``relax_plugins`` (each a strongly
    connected set of modules, sorted). Importing ``a.b.c`` runs ``a`` and ``a.b`` first, so each
    import is also an arrow to the packages above what it names (except the importer's own)."""
    modules = {_module_name(root, p): p for package in ("relax", "relax_plugins")
               for p in sorted((root / package).rglob("*.py"))}
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        single = ast.Module(body=_module_level_imports(tree), type_ignores=[])
        for _, imported in _imports(single, module, path.name == "__init__.py"):
            parts = imported.split(".")
            for k in range(1, len(parts) + 1):
                target = ".".join(parts[:k])
                if target in modules and target != module and not module.startswith(target + "."):
                    edges[module].add(target)
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_architecture_md_names_what_each_package_imports():
    problems = table_mismatches(ROOT)
    assert not problems, "docs/architecture.md's package table and the code disagree:\n" + "\n".join(problems)


def test_the_house_has_no_circle_of_module_level_imports():
    assert import_cycles(ROOT) == []


def test_the_table_check_reports_what_the_row_leaves_out_or_makes_up(tmp_path):
    files = {
        "docs/architecture.md": "| package | holds | imports |\n| --- | --- | --- |\n"
                                "| `relax/spec` | the spec | `errors`, `registry`, `pydantic` |\n"
                                "| `relax/__init__.py`, `relax/errors.py` | errors | (none) |\n",
        "relax/__init__.py": "",
        "relax/errors.py": "import json\n",
        "relax/registry.py": "",
        "relax/spec/__init__.py": "from relax.errors import SpecError\nimport pydantic\n",
        "relax/spec/rules.py": "def f():\n    import yaml\n    from relax.spec import models\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert set(table_mismatches(tmp_path)) == {"relax/spec names relax.registry in its row but does not import it",
                          "relax/spec imports yaml, which its row does not name",  # in a function too
                          "relax/registry.py is in no row of the package table"}


def test_the_circle_check_finds_module_level_circles_through_packages(tmp_path):
    """registry -> spec.translate runs spec/__init__, which imports validate, which imports the
    registry: a circle though no module names the one that names it. A circle of imports inside
    functions (tiny_lm <-> tiny_lm_build) or under TYPE_CHECKING is none."""
    files = {
        "relax/__init__.py": "",
        "relax/registry.py": "from relax.spec.translate import issues\n",
        "relax/spec/__init__.py": "from relax.spec.validate import validate_spec\n",
        "relax/spec/translate.py": "import re\n",
        "relax/spec/validate.py": "from relax.registry import get_registry\n",
        "relax/plan.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from relax.api import plan\n",
        "relax/api.py": "from relax import plan\n",
        "relax_plugins/__init__.py": "",
        "relax_plugins/tiny_lm.py": "def build():\n    from relax_plugins.tiny_lm_build import run\n",
        "relax_plugins/tiny_lm_build.py": "from relax_plugins.tiny_lm import CONFIG\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_cycles(tmp_path) == [["relax.registry", "relax.spec", "relax.spec.validate"]]
