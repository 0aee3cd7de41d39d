"""The import graph of the `enginehooks` package, read from the source (nothing imported).

`python -m enginehooks_testkit.import_graph` prints every edge `module -> module` (all
explicit imports of enginehooks modules, at module level or inside functions; imports
under `if TYPE_CHECKING:` are left out, since they never run) and then the cycles, if
any. The architecture test asserts there are none.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

#: The package the graph is of: the checkout's `enginehooks/`, beside this kit.
ROOT = Path(__file__).resolve().parents[1] / "enginehooks"
PACKAGE = ROOT.name


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package at `root` (by default
    the library; the kit's own folder gives the kit's modules)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(not p.isidentifier() for p in parts):  # data folders (the sgl_kernel stand-in)
            continue
        out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def edges() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import name`: name is a submodule or an attribute of pkg.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names]
            for t in targets:
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    graph = edges()
    for mod in sorted(graph):
        for dep in sorted(graph[mod]):
            print(f"{mod} -> {dep}")
    found = cycles(graph)
    print(f"# {len(graph)} modules, {sum(len(d) for d in graph.values())} edges, "
          f"{len(found)} cycles")
    for c in found:
        print("# cycle: " + " <-> ".join(c))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
