"""The house rules a newcomer relies on, checked on the source tree (DESIGN.md §2, issue #22): the packages
layer (bus → core → rollout / train → app, nothing reaches up), no module imports itself back through a
circle, and no source module grows past 600 lines. The few that still do are listed with their size
today, as a ratchet: they may shrink, not grow, and each leaves the list when it is split."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
OVERSIZED: dict[str, int] = {}  # module: its lines as `ruff format` writes them, while over 600 (none left)
CIRCLES_LEFT: list[set[str]] = []
LAYERS = {  # package: the relax packages it may import
    "relax_bus": set(),
    "relax_rewards": set(),
    "relax_multimodal": set(),
    "relax_core": {"relax_bus"},
    "relax_rollout": {"relax_bus", "relax_core", "relax_rewards", "relax_multimodal"},
    "relax_train": {"relax_bus", "relax_core", "relax_multimodal"},
    "relax_app": {
        "relax_bus",
        "relax_core",
        "relax_rewards",
        "relax_multimodal",
        "relax_rollout",
        "relax_train",
    },
}


def _modules() -> dict[str, Path]:
    roots = [*ROOT.glob("packages/*/src/relax_*"), ROOT / "apps" / "relax" / "src" / "relax_app"]
    out = {}
    for root in roots:
        for f in root.rglob("*.py"):
            name = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
            out[name] = f
    return out


def _runtime_imports(f: Path) -> list[ast.AST]:
    """Import statements, except those under ``if TYPE_CHECKING:`` (no import happens at run time)."""
    tree = ast.parse(f.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(f):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in mods] + (
                    [base] if any(t not in mods for t in subs) else []
                )
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def _circles(graph: dict[str, set[str]], nodes: list[str]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter = counter + 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter = counter + 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
    return out


def test_no_import_circles():
    mods = _modules()
    circles = _circles(_graph(mods), sorted(mods))
    assert [c for c in circles if c not in CIRCLES_LEFT] == []


def test_packages_import_only_the_layers_below():
    mods = _modules()
    wrong = sorted(
        (name, dep)
        for name, deps in _graph(mods).items()
        for dep in deps
        if dep.split(".")[0] != name.split(".")[0] and dep.split(".")[0] not in LAYERS[name.split(".")[0]]
    )
    assert wrong == []


def test_no_module_grows_past_600_lines():
    sizes = {
        n.replace(".", "/") + ("/__init__.py" if f.name == "__init__.py" else ".py"): len(
            f.read_text().splitlines()
        )
        for n, f in _modules().items()
    }
    over = {m: n for m, n in sizes.items() if n > OVERSIZED.get(m, MAX_LINES)}
    assert over == {}, "split these (or, for a listed module, it grew: split before adding)"
    assert all(m in sizes for m in OVERSIZED), "a listed module moved: update OVERSIZED"


def test_each_run_loop_reads_in_one_short_file():
    core = ROOT / "packages" / "relax-core" / "src" / "relax_core"
    for loop in ("colocate.py", "fully_async.py"):
        assert len((core / loop).read_text().splitlines()) <= 150, loop
