"""The house rules a newcomer relies on, checked on the source tree (DESIGN.md §2, issues #22 and #38): the
packages layer (bus → core → rollout / train → app, nothing reaches up, not even by a dotted-path string),
no module imports itself back through a circle (imports under ``if TYPE_CHECKING:`` included: a circle a
type checker sees is a coupling all the same), no source module grows past 600 lines, no object reads
another object's private attributes (a helper receives the state it needs, never its owner to reach into),
and a sample's fields are named through ``relax_core.sample``, not spelt as strings."""

from __future__ import annotations

import ast
import re
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
    "relax_train": {"relax_bus", "relax_core"},
    "relax_tinker": {
        "relax_core",
        "relax_rollout",
    },  # (the Tinker API: our engines behind another front door)
    "relax_testing": {  # dev only: the tests' helpers, above every shipped package (the app's CLI included)
        "relax_bus",
        "relax_core",
        "relax_rewards",
        "relax_multimodal",
        "relax_rollout",
        "relax_train",
        "relax_app",
    },
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


def _imports(f: Path) -> list[ast.AST]:
    """Every import statement, those under ``if TYPE_CHECKING:`` included."""
    return [n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(f):
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


# -- private reads ----------------------------------------------------------------------------------------
THIRD_PARTY_PRIVATE = {  # (module, the read as written): why there is no public way
    ("relax_core.dcs_transport", "opts._timeout"): "torch: ProcessGroupNCCL.Options has no public timeout",
    ("relax_core.net", "dist.ProcessGroupGloo._Options"): (
        "torch: the one way to give a standalone gloo group its device (the address it binds)"
    ),
    ("relax_core.net", "opts._timeout"): "torch: as above, its fields",
    ("relax_core.net", "opts._devices"): "torch: as above",
    ("relax_core.net", "opts._threads"): "torch: as above",
    ("relax_core.metrics", "Task._report_subprocess_enabled"): "ClearML reads it only from clearml.conf",
    ("relax_train.backends.megatron.tensors", "t._base"): "torch: the one way to tell a view from its base",
    ("relax_train.backends.megatron.multimodal", "omni.Qwen3OmniMoeVisionEncoder._from_config"): (
        "transformers: the Omni towers have no AutoModel mapping; _from_config honours the dtype/attention"
    ),
    ("relax_train.backends.megatron.multimodal", "omni.Qwen3OmniMoeAudioEncoder._from_config"): (
        "transformers: as above"
    ),
}
"""Reads of a third-party object's private attribute that have no public equivalent, each with its reason."""
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public despite the underscore


def _private_reads(f: Path) -> list[str]:
    """``obj._x`` where ``obj`` is not ``self`` / ``cls`` / ``super()`` / an imported module, outside a
    class reading a private name of its own kind (a factory setting up the instance it just built)."""
    tree = ast.parse(f.read_text())
    modules = {
        (a.asname or a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    own: dict[int, set[str]] = {}  # id(node) -> the private names of the class it sits in
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        names = {
            a.attr
            for a in ast.walk(cls)
            if isinstance(a, ast.Attribute)
            and isinstance(a.value, ast.Name)
            and a.value.id in ("self", "cls")
        } | {d.name for d in cls.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for n in ast.walk(cls):
            own[id(n)] = own.get(id(n), set()) | names
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
            continue
        v = n.value
        if isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in modules):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        if n.attr in NAMEDTUPLE_API or n.attr in own.get(id(n), set()):
            continue
        out.append(ast.unparse(n))
    return out


def test_no_object_reads_another_objects_private_attributes():
    found = {
        (name, read)
        for name, f in _modules().items()
        if not name.startswith("relax_testing")
        for read in _private_reads(f)
    }
    assert sorted(found - set(THIRD_PARTY_PRIVATE)) == [], (
        "pass the state in (or make it public API) instead of reaching into another object"
    )
    assert set(THIRD_PARTY_PRIVATE) <= found, "a listed third-party read is gone: drop it from the list"


# -- string imports ---------------------------------------------------------------------------------------
DOTTED = re.compile(r"^(relax_[a-z]+)(\.[A-Za-z_][A-Za-z_0-9]*)*(:[A-Za-z_][A-Za-z_0-9.]*)?$")


def test_no_dotted_path_string_reaches_across_layers():
    """A ``"pkg.module:attr"`` string imported later is an import all the same: it obeys the layers."""
    wrong = []
    for name, f in _modules().items():
        pkg = name.split(".")[0]
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and (m := DOTTED.match(n.value)):
                target = m.group(1)
                if target in LAYERS and target != pkg and target not in LAYERS[pkg]:
                    wrong.append((name, n.value))
    assert wrong == []


# -- the sample schema ------------------------------------------------------------------------------------
SHARED_NAMES = {
    "tokens",
    "reward",
    "mm",
    "finish_reason",
    "routed_experts",
    "advantages",
    "env_error",
    "agent",
}
"""Schema fields whose names also name other things (HTTP bodies, OpenAI replies, engine outputs, a role, a
stop reason, the default agent name): readers use the constants, but a string of these names is not necessarily a sample field."""


def test_sample_fields_are_named_through_the_schema():
    import relax_core.sample as schema

    consts = {v for k, v in vars(schema).items() if k.isupper() and isinstance(v, str)}
    assert consts == schema.FIELDS, "each field of TrainSample has its constant, and nothing else"
    from relax_bus.core import RESERVED_FIELDS

    assert {schema.GROUP_ID, schema.POLICY_VERSION} <= set(RESERVED_FIELDS), (
        "the bus groups and bounds by these"
    )
    distinctive = schema.FIELDS - SHARED_NAMES
    spelt = []
    for name, f in _modules().items():
        if name == "relax_core.sample" or name.split(".")[0] in ("relax_testing", "relax_bus"):
            continue  # (the bus is schema-agnostic: it knows only the fields it reserves, above)
        tree = ast.parse(f.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        spelt += [
            (name, n.lineno, n.value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in distinctive and id(n) not in docs
        ]
    assert spelt == [], "name sample fields with relax_core.sample's constants"


def test_no_module_re_exports_another_modules_names():
    """One home per name: a module does not import names it does not use so that they are "importable here
    too" (a package's ``__init__`` is its public face and may)."""
    found = []
    for name, f in _modules().items():
        if f.name == "__init__.py":
            continue
        text = f.read_text()
        lines = text.splitlines()
        for n in ast.parse(text).body:  # (top-level imports: an import inside a function is a probe)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("relax_"):
                block = "\n".join(lines[n.lineno - 1 : n.end_lineno])
                if "noqa: F401" in block or "re-export" in block:
                    found.append((name, n.module))
    assert found == []


# -- private names and long functions (#52) ---------------------------------------------------------------
def _private_imports(name: str, f: Path) -> list[tuple[str, str, str]]:
    return [
        (name, n.module, a.name)
        for n in _imports(f)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("relax_")
        for a in n.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]


def test_no_module_imports_another_modules_private_names():
    """A name another module needs is public: an imported ``_name`` is shared state nobody owns."""
    found = sorted(i for name, f in _modules().items() for i in _private_imports(name, f))
    assert found == [], "make the name public (or keep it in its module)"


MAX_FUNCTION_LINES = 80


def test_no_function_grows_past_80_lines():
    """A function a reader must hold whole in mind fits a screen: past that, its steps are functions."""
    long = [
        (name, n.name, n.end_lineno - n.lineno + 1)
        for name, f in _modules().items()
        for n in ast.walk(ast.parse(f.read_text()))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno is not None
        and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == [], "split these into the steps they are"


# -- relax-rollout's layers (#52) -------------------------------------------------------------------------
ROLLOUT_LAYERS = {  # a module of relax_rollout: the layer it is in; bottom to top
    "engines": 0,  # the engine library: torch, SGLang, external servers, the pool
    "engine_factory": 0,
    "sglang_delta_loader": 0,  # (the engines' loader inside SGLang: at the top, so SGLang imports it alone)
    "turns": 0,  # token-exact turns, media prompts, the HTTP layer: what serving and the role share
    "media_prompts": 0,
    "http_api": 0,
    "server": 1,  # the engine server (SGLang's API and OpenAI's) and the elastic API
    "elastic": 1,
    "elastic_api": 1,
    "elastic_service": 1,
    "engine_service": 1,
}
"""relax-rollout is an engine library, an inference server with its elastic API, and the rollout role, in
that order: a layer imports its own and those below, so each can be used without the ones above it. Every
other module (the worker, generation, streaming, prompts, rewards, samples, multi-turn) is the role (2)."""


def _rollout_layer(module: str) -> int:
    parts = module.split(".")
    return ROLLOUT_LAYERS.get(parts[1], 2) if len(parts) > 1 else 0  # (the package itself: its version)


def test_relax_rollout_s_engines_serving_and_role_are_layers():
    mods = _modules()
    up = []
    for name, f in mods.items():
        if not name.startswith("relax_rollout."):
            continue
        for n in _imports(f):
            targets = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            if isinstance(n, ast.ImportFrom) and n.module == "relax_rollout":  # from relax_rollout import x
                targets = [f"relax_rollout.{a.name}" for a in n.names if f"relax_rollout.{a.name}" in mods]
            for t in targets:
                if t.startswith("relax_rollout.") and _rollout_layer(t) > _rollout_layer(name):
                    up.append((name, t))
    assert up == [], "a layer of relax-rollout imports one above it: move the shared part down"


def _foreign_state(cls: ast.ClassDef) -> set[str]:
    """Private attributes ``cls`` declares (``_x: T`` in its body) but never sets: another class's state,
    which a mixin or base reads through ``self``."""
    declared = {
        d.target.id
        for d in cls.body
        if isinstance(d, ast.AnnAssign) and d.value is None and isinstance(d.target, ast.Name)
        if d.target.id.startswith("_") and not d.target.id.startswith("__")
    }
    assigned = {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        if isinstance(n.ctx, ast.Store)
    }
    dataclass = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)  # (fields, set by __init__)
    protocol = any(ast.unparse(b).endswith("Protocol") for b in cls.bases)
    return set() if dataclass or protocol else declared - assigned


def test_no_class_reads_state_another_class_sets():
    """A part that needs another part's state receives it (composition); a mixin that declares ``_x: T``
    and reads it through ``self`` depends on a sibling it cannot see."""
    found = {
        (name, cls.name)
        for name, f in _modules().items()
        if not name.startswith("relax_testing")
        for cls in ast.walk(ast.parse(f.read_text()))
        if isinstance(cls, ast.ClassDef) and _foreign_state(cls)
    }
    assert sorted(found) == [], "give the part the state it reads"


MAX_METHODS = 20


def _methods_by_class() -> dict[str, int]:
    """Methods of each class of ours, counting those of its bases that are ours (mixins and base classes):
    the surface a reader of the class has to know. Protocols are contracts, not counted."""
    defs: dict[str, ast.ClassDef] = {}
    for name, f in _modules().items():
        if not name.startswith("relax_testing"):
            defs.update(
                {c.name: c for c in ast.walk(ast.parse(f.read_text())) if isinstance(c, ast.ClassDef)}
            )

    def own(c: ast.ClassDef) -> set[str]:
        return {d.name for d in c.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def every(c: ast.ClassDef, seen: frozenset[str]) -> set[str]:
        out = own(c)
        for b in c.bases:
            base = ast.unparse(b).split(".")[-1]
            if base in defs and base not in seen:
                out |= every(defs[base], seen | {base})
        return out

    return {
        n: len(every(c, frozenset({n})))
        for n, c in defs.items()
        if not any(ast.unparse(b).endswith("Protocol") for b in c.bases)
    }


def test_no_class_has_more_than_20_methods_counting_its_bases():
    counts = _methods_by_class()
    over = {n: k for n, k in counts.items() if k > MAX_METHODS}
    assert over == {}, "split these into parts that own their state: what a reader holds in mind at once"


# -- role names come from the registry (#52) --------------------------------------------------------------
MODEL_KINDS = {"policy", "reference", "teacher"}
""":attr:`relax_core.role.RoleSpec.model`'s kinds the drivers resolve (a role's own model is any other name)."""


def _role_names() -> set[str]:
    from importlib import metadata

    from relax_core.roles import ROLE_GROUP

    return {ep.name for ep in metadata.entry_points(group=ROLE_GROUP)}


def _hard_coded_roles(tree: ast.AST, names: set[str], role_only: set[str]) -> list[tuple[int, str]]:
    """Comparisons with a name that only a role has, and literal collections of two role names or more."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            for side in [n.left, *n.comparators]:
                consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [
                    (n.lineno, c.value)
                    for c in consts
                    if isinstance(c, ast.Constant) and c.value in role_only
                ]
        items = (
            n.elts
            if isinstance(n, (ast.Tuple, ast.List, ast.Set))
            else n.keys
            if isinstance(n, ast.Dict)
            else []
        )
        spelt = {c.value for c in items if isinstance(c, ast.Constant) and c.value in names}
        if len(spelt) >= 2:
            found.append((n.lineno, ", ".join(sorted(spelt))))
    return found


def test_no_role_name_is_hard_coded_outside_the_registry():
    """The drivers, trace, metrics and health know the roles from the registry and each role's spec (its
    part, its model kind), never by name: relax-core and the app compare no value with a name only a role
    has (``model == "critic"``) and list no role names (a row order, a list of stateful roles). A role's own
    package names itself."""
    from relax_core.role import Part

    names = _role_names()
    assert {"rollout", "actor", "critic"} <= names, "the installed roles are registered"
    role_only = names - set(Part.__args__) - MODEL_KINDS
    found = [
        (name, *hit)
        for name, f in _modules().items()
        if name.split(".")[0] in ("relax_core", "relax_app")
        for hit in _hard_coded_roles(ast.parse(f.read_text()), names, role_only)
    ]
    assert found == [], "take the role from the registry or its RoleSpec, not by its name"


def test_the_simulator_drives_the_runs_own_policies_not_copies():
    """#57: `relax plan`'s simulator drives the run's own policies: the objects the real run calls (a copy
    would not be ``is`` them), and nothing in the plan package defines a function of a policy's name or
    computes the staleness bound.

    The simulator's policies are the objects the real run calls (a copy would not be ``is`` them), and
    nothing in the plan package defines a function of a policy's name or computes the staleness bound."""
    import ast

    import relax_app.plan.sim as sim
    import relax_bus
    import relax_bus.staleness
    import relax_rollout.streaming
    import relax_train.roles.actor_step
    from relax_core import weight_delta

    assert sim.StalenessBound is relax_bus.staleness.StalenessBound
    assert sim.DataBus is relax_bus.DataBus
    assert sim.inflight_limit is relax_rollout.streaming.inflight_limit
    assert sim.room_for_step is relax_rollout.streaming.room_for_step
    assert sim.update_waits_for_responses is relax_rollout.streaming.update_waits_for_responses
    assert sim.take_request is relax_train.roles.actor_step.take_request
    assert sim.DeltaSender is weight_delta.DeltaSender
    policy_names = {
        "inflight_limit",
        "room_for_step",
        "update_waits_for_responses",
        "take_request",
        "admit_version",
    }
    policy_names |= {
        "oldest_allowed",
        "is_stale",
        "full_due",
        "admit",
        "in_order",
        "group",
        "complete_groups",
    }
    for path in Path(sim.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & policy_names, (path.name, defined & policy_names)
        assert "max_staleness -" not in path.read_text() and "- max_staleness" not in path.read_text(), (
            path.name
        )
