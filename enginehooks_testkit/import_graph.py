"""The import graph of the `enginehooks` package, read from the source (nothing imported).

`python -m enginehooks_testkit.import_graph` prints every edge `module -> module` (all
explicit imports of enginehooks modules, at module level or inside functions; imports
under `if TYPE_CHECKING:` are left out, since they never run, unless asked for) and then
the cycles and the arrows against the layers (`LAYERS`), if any. The architecture test
asserts there are none (both with the TYPE_CHECKING imports too).
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


#: The package's layers, lowest first, by top-level module or sub-package: a module may
#: import its own layer and the layers below it, never one above. `wire/` (the messages
#: between trainer and workers) sits on its own floor, right above `core/`: both sides
#: and the transports (a group's endpoint) speak it, and it speaks of none of them.
#: `engine/` sits with `control/`: it holds both the engine contract and `LocalEngine`
#: (`local.py`, a handle built on `control/handles.py`).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("markers", "core"),
    ("wire",),
    ("hookspecs", "plugins", "defaults", "metrics", "transports", "trainer_side"),
    ("engine", "control"),
    ("vllm_ext", "sglang_ext", "ray_ext", "verl_ext"),
    ("", "cli", "demo"),  # "": the package's own `__init__`
)


def layer_of(module: str) -> int:
    """The index in `LAYERS` of `module` (a dotted name of the package)."""
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise KeyError(f"{module}: not in any layer of LAYERS (add its package there)")


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports that go from a lower layer up into a higher one."""
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if layer_of(d) > layer_of(m))


def _runtime_nodes(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.AST]:
    """Every node except the bodies of `if TYPE_CHECKING:` blocks (with them, if
    `type_checking`)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if (not type_checking and isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.dump(node.test)):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def edges(type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports (with those imported only for type
    checking, if `type_checking`)."""
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path)), type_checking):
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
    typed = edges(type_checking=True)
    found = cycles(graph)
    typed_found = [c for c in cycles(typed) if c not in found]
    up = upward(typed)
    print(f"# {len(graph)} modules, {sum(len(d) for d in graph.values())} edges "
          f"({sum(len(d) for d in typed.values())} with TYPE_CHECKING imports), "
          f"{len(found) + len(typed_found)} cycles, {len(up)} imports up a layer "
          f"(TYPE_CHECKING included in both)")
    for c in found:
        print("# cycle: " + " <-> ".join(c))
    for c in typed_found:
        print("# cycle through TYPE_CHECKING imports: " + " <-> ".join(c))
    for m, d in up:
        print(f"# up a layer: {m} -> {d}")
    return 1 if found or typed_found or up else 0


if __name__ == "__main__":
    sys.exit(main())
