"""The house's layering: no two modules of the package import each other, at load time or inside a function (a
name both need has one home below both; issue #29 found three such pairs). An import of a parent package, which
Python has loaded before any module in it, is no edge."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "longstraw_cli"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its source."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                found.update(submodules)
                if len(submodules) < len(node.names):
                    found.add(base)
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def test_no_two_modules_import_each_other():
    graph = import_graph()
    assert len(graph) > 50 and "longstraw_cli.models.glm52.decode" in graph["longstraw_cli.models.glm52.model"]
    pairs = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph[b]})
    assert pairs == [], f"modules that import each other: {pairs}"
