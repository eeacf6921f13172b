"""The package's shape: imports run downward through the layers ARCHITECTURE.md lists, with no
circle between its parts, and no module reaches for another module's private (underscore) names.

The check reads the source (every import, module-level or inside a function, relative or absolute),
so it needs no torch and runs in a blink; its own tests build small fabricated packages that break
each rule, so it is known to fail when the package does.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "moestream"


@dataclass(frozen=True)
class Import:
    importer: str          # dotted module name of the importing file
    module: str            # dotted module imported (resolved when relative)
    names: tuple[str, ...]  # names taken `from module import ...` (empty for `import module`)
    line: int


def module_name(root: Path, path: Path) -> str:
    """`root/engine/build.py` → "moestream.engine.build"; a package's __init__ is the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


@functools.lru_cache(maxsize=None)
def read_imports(root: Path) -> tuple[list[Import], dict[str, ast.Module]]:
    """Every import statement of the package under `root`, and each module's syntax tree (read once a
    process: both checks of the package read them; nobody changes them)."""
    out, trees = [], {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(root, path)
        tree = ast.parse(path.read_text(), filename=str(path))
        trees[name] = tree
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out += [Import(name, a.name, (), node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(name, path.name == "__init__.py", node.module, node.level)
                out.append(Import(name, module, tuple(a.name for a in node.names), node.lineno))
    return out, trees


def part_of(package: str, module: str) -> str:
    """The top-level part a module belongs to: "moestream.engine.build" → "engine"; the package
    itself (its __init__) is named by the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else package


def layers_from_doc(text: str) -> list[list[str]]:
    """The layers of ARCHITECTURE.md's Layering section, lowest first: the first fenced block after
    the heading, one layer a line, parts separated by commas, a parenthesised remark ignored."""
    section = text.split("## Layering", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    layers = []
    for line in block.splitlines():
        line = re.sub(r"\(.*?\)", "", line).replace("→", "").replace("`", "").strip()
        if line:
            layers.append([p.strip() for p in line.split(",") if p.strip()])
    return layers


def part_edges(root: Path, imports: list[Import]) -> dict[tuple[str, str], Import]:
    """(importer's part, imported part) → one import that makes the edge, for imports between parts."""
    package, edges = root.name, {}
    for imp in imports:
        targets = [imp.module] + [f"{imp.module}.{n}" for n in imp.names]
        for target in targets:
            if target != package and not target.startswith(package + "."):
                continue
            part = part_of(package, target)
            if not ((root / part).is_dir() or (root / f"{part}.py").is_file()) and part != package:
                continue
            src = part_of(package, imp.importer)
            if src != part and part != package:   # `from moestream import x` names x's part, checked as target
                edges.setdefault((src, part), imp)
    return edges


def find_circles(edges) -> list[list[str]]:
    """Every elementary circle's nodes, found by a depth-first search from each node (small graphs)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    circles, seen = [], set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    circles.append(path + [start])
            elif nxt not in path and nxt > start:   # each circle once, from its smallest node
                walk(start, nxt, path + [nxt])

    for node in sorted(graph):
        walk(node, node, [node])
    return circles


def layering_violations(root: Path, layers: list[list[str]]) -> list[str]:
    """Import circles between parts, imports that do not run downward, and parts the layering omits."""
    imports, _ = read_imports(root)
    edges = part_edges(root, imports)
    rank = {part: i for i, layer in enumerate(layers) for part in layer}
    problems = [f"import circle: {' → '.join(c)}" for c in find_circles(edges)]
    parts = {p.stem if p.is_file() else p.name for p in root.iterdir()
             if (p.is_dir() and (p / "__init__.py").is_file()) or (p.is_file() and p.suffix == ".py")}
    parts = {root.name if p == "__init__" else p for p in parts}
    problems += [f"{p} is in no layer of the layering" for p in sorted(parts - rank.keys())]
    for (src, dst), imp in sorted(edges.items()):
        if src in rank and dst in rank and rank[dst] >= rank[src]:
            where = "its own layer" if rank[dst] == rank[src] else "a higher layer"
            problems.append(f"{imp.importer} (line {imp.line}) imports {imp.module}: {src} → {dst}, {where}")
    return problems


def private_violations(root: Path) -> list[str]:
    """Uses of another module's underscore names: `from m import _x`, or `m._x` / `alias._x` where
    the name is bound to a module of the package (dunder names are public)."""
    package = root.name
    imports, trees = read_imports(root)
    ours = lambda m: m == package or m.startswith(package + ".")   # noqa: E731
    private = lambda n: n.startswith("_") and not (n.startswith("__") and n.endswith("__"))   # noqa: E731
    problems = []
    for imp in imports:
        if ours(imp.module) and imp.module != imp.importer:
            for name in imp.names:
                if private(name):
                    problems.append(f"{imp.importer} (line {imp.line}) imports {imp.module}.{name}")
    for importer, tree in trees.items():
        bound: dict[str, str] = {}   # local name → the package's module or object it names
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if ours(a.name):
                        bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                imp = next(i for i in imports if i.importer == importer and i.line == node.lineno)
                if ours(imp.module):
                    for a in node.names:
                        bound[a.asname or a.name] = f"{imp.module}.{a.name}"
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            chain, base = [], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                owner = ".".join([bound[base.id]] + chain[::-1])
                if owner != importer:
                    problems.append(f"{importer} (line {node.lineno}) uses {owner}.{node.attr}")
    return problems


# ---- the package ------------------------------------------------------------------------------

def test_imports_run_down_the_documented_layers():
    layers = layers_from_doc((REPO / "ARCHITECTURE.md").read_text())
    assert len(layers) >= 5
    assert layering_violations(PACKAGE, layers) == []


def test_no_module_uses_another_modules_private_names():
    assert private_violations(PACKAGE) == []


# ---- the checker catches what it is for -------------------------------------------------------

def _tree(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    return pkg


LAYERS = [["low"], ["mid_a", "mid_b"], ["high"], ["pkg"]]


def test_checker_accepts_a_clean_tree(tmp_path):
    pkg = _tree(tmp_path, {"low/a.py": "X = 1\n_y = 2\nprint(_y)\n",
                           "mid_a/b.py": "from pkg.low.a import X\nfrom . import c\n",
                           "mid_a/c.py": "def f():\n    from pkg.low import a\n    return a.X\n",
                           "high/d.py": "import pkg.mid_a.b as b\nfrom pkg.mid_b import thing\n",
                           "mid_b/thing.py": "import os\nos._exit\n"})
    assert layering_violations(pkg, LAYERS) == []
    assert private_violations(pkg) == []


def test_checker_finds_a_circle_and_an_upward_import(tmp_path):
    pkg = _tree(tmp_path, {"low/a.py": "def f():\n    from pkg.high.d import g\n",   # lazy, still an import
                           "high/d.py": "from pkg.low.a import f\ndef g(): pass\n"})
    problems = layering_violations(pkg, LAYERS)
    assert any(p.startswith("import circle: high → low → high") for p in problems), problems
    assert any("pkg.low.a (line 2) imports pkg.high.d: low → high, a higher layer" in p for p in problems), problems


def test_checker_finds_siblings_and_unlisted_parts(tmp_path):
    pkg = _tree(tmp_path, {"mid_a/b.py": "from ..mid_b import c\n",   # relative, resolved
                           "mid_b/c.py": "X = 1\n", "extra.py": "Y = 2\n"})
    problems = layering_violations(pkg, LAYERS)
    assert any("mid_a → mid_b, its own layer" in p for p in problems), problems
    assert "extra is in no layer of the layering" in problems


def test_checker_finds_private_names(tmp_path):
    pkg = _tree(tmp_path, {"low/a.py": "_secret = 1\ndef _helper(): pass\n",
                           "low/b.py": "from pkg.low.a import _secret\n",
                           "low/c.py": "from pkg.low import a\na._helper()\n",
                           "low/d.py": "import pkg.low.a\npkg.low.a._secret\n",
                           "low/e.py": "from .a import _helper\n"})
    problems = private_violations(pkg)
    assert "pkg.low.b (line 1) imports pkg.low.a._secret" in problems
    assert "pkg.low.c (line 2) uses pkg.low.a._helper" in problems
    assert "pkg.low.d (line 2) uses pkg.low.a._secret" in problems
    assert "pkg.low.e (line 1) imports pkg.low.a._helper" in problems
    assert len(problems) == 4, problems


def test_layers_read_from_the_architecture_page():
    text = "# x\n\n## Layering\n\n```\nerrors, sizes\n        → model            (remark, with a comma)\n→ `cli`\n```\n"
    assert layers_from_doc(text) == [["errors", "sizes"], ["model"], ["cli"]]


if __name__ == "__main__":   # print what the package breaks today
    for problem in layering_violations(PACKAGE, layers_from_doc((REPO / "ARCHITECTURE.md").read_text())):
        print(problem)
    for problem in private_violations(PACKAGE):
        print(problem)
