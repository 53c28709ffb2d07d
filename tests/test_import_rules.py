"""The layering of the house, held by an AST walk over every import (also those inside functions).

Rules (see docs/plugin-guide.md):

- ``plugins``: ``relax_plugins`` imports from ``relax`` only the plugin-facing modules
  (``relax.contracts``, ``relax.algo``, ``relax.media``, ``relax.weight_group``), never the
  runtime or the spec: what a plugin needs comes in its context.
- ``light``: what ``relax validate`` and ``relax plan`` run (``relax.spec``, ``relax.plan``,
  ``relax.config``, ``relax.registry``, ``relax.contracts``) imports no heavy library and nothing
  of the runtime, the bus or telemetry.
- ``core``: ``relax`` never imports ``relax_plugins`` (plugins are found through entry points).
- ``algo``: ``relax.algo`` (pure math on tensors) imports no ray, no runtime and no bus.
- ``plugin-facing``: the modules plugins may import (``relax.contracts``, ``relax.media``,
  ``relax.weight_group``) import no ray and nothing of the runtime, so a plugin never pulls them in.

``import_violations`` is the checker; the tests run it on this checkout (no violation) and on a
throwaway tree that breaks each rule once (each reported, with file, line and rule).
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLUGIN_FACING = ("relax.contracts", "relax.algo", "relax.media", "relax.weight_group")
LIGHT = ("relax.spec", "relax.plan", "relax.config", "relax.registry", "relax.contracts")
HEAVY = ("torch", "ray", "vllm", "megatron", "transformers", "tensordict", "transferqueue")
RUNTIME_SIDE = ("relax.runtime", "relax.bus", "relax.telemetry")


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
    if _under(module, ("relax.contracts", "relax.media", "relax.weight_group")) \
            and (top == "ray" or _under(imported, RUNTIME_SIDE)):
        broken.append("plugin-facing: relax.contracts, relax.media and relax.weight_group import no ray "
                      "and nothing of " + ", ".join(RUNTIME_SIDE))
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
        "relax_plugins/reward.py": "def build():\n    from relax.runtime.components import build_plugin\n",
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
    }


def test_a_violation_names_the_file_line_and_rule(tmp_path):
    (tmp_path / "relax").mkdir()
    (tmp_path / "relax_plugins").mkdir()
    (tmp_path / "relax_plugins" / "judge.py").write_text("\n\nimport relax.spec.models\n")
    [violation] = import_violations(tmp_path)
    assert str(violation).startswith("relax_plugins/judge.py:3: imports relax.spec.models (plugins: ")
