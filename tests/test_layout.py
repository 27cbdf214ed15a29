"""The package's layout: small modules and classes, no import cycles, no private imports.

Read from the source with `ast` (nothing is imported): every module under
``src/hope_keras``, its top-level imports (those that run when the module is
imported; imports inside functions are lazy and are not edges), its classes.
"""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "hope_keras"
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 400

#: Module-level imports of another module's private name that are allowed, as
#: (importing module, imported module, name). Empty: none is needed today.
PRIVATE_IMPORT_ALLOWANCES = set()


def _modules():
    """{dotted name: path} of every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name):
    return MODULES[name].name == "__init__.py"


def _resolve(module, node):
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_imports(tree):
    """Import statements that run at import time: the module body, `if`/`try` blocks
    included, ``if TYPE_CHECKING:`` blocks excluded; never function or class bodies."""
    out = []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody):
                    visit(block)
                for handler in node.handlers:
                    visit(handler.body)
    visit(tree.body)
    return out


def _edges(module):
    """[(imported hope_keras module, names imported from it or None, lineno)]."""
    tree = ast.parse(MODULES[module].read_text())
    edges = []
    for node in _top_level_imports(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    edges.append((alias.name, None, node.lineno))
            continue
        target = _resolve(module, node)
        if target not in MODULES:
            continue
        names = []
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in MODULES:  # `from package import submodule`
                edges.append((sub, None, node.lineno))
            else:
                names.append(alias.name)
        if names:
            edges.append((target, names, node.lineno))
    return edges


GRAPH = {m: _edges(m) for m in MODULES}


def _dependencies(module):
    """The hope_keras modules that importing ``module`` imports at module level
    (``from package import name`` depends on the package's ``__init__``)."""
    return {target for target, _, _ in GRAPH[module] if target != module}


def test_no_module_over_800_lines():
    long = {m: n for m, p in MODULES.items()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_class_over_400_lines():
    long = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    long[f"{module}.{node.name}"] = n
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"


def _cycles(graph):
    """The strongly connected components of ``graph`` ({node: set of nodes}) with
    more than one node, each sorted (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    # A package's __init__ importing its submodules is an edge like any other: a
    # submodule importing names back from its package's __init__ closes a cycle.
    cycles = _cycles({m: _dependencies(m) for m in MODULES})
    assert not cycles, f"module-level import cycles: {cycles}"


def test_no_private_import_across_modules():
    found = []
    for module in MODULES:
        for target, names, line in GRAPH[module]:
            for name in names or ():
                if name.startswith("_") and not name.startswith("__") and target != module:
                    key = (module, target, name)
                    if key not in PRIVATE_IMPORT_ALLOWANCES:
                        found.append(f"{module}:{line} imports {target}.{name}")
    assert not found, "private names imported from another module:\n" + "\n".join(found)


def _module_aliases(module):
    """{local name: hope_keras module} of the modules ``module`` binds by import
    (``from hope_keras.stats import synthetic``, ``import hope_keras.x as y``)."""
    aliases = {}
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
    return aliases


def test_no_private_name_read_through_another_module():
    """``synthetic._run(...)`` is a private import by another name."""
    found = []
    for module in MODULES:
        aliases = _module_aliases(module)
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != module
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{module}:{node.lineno} reads "
                             f"{aliases[node.value.id]}.{node.attr}")
    assert not found, "private names read through another module:\n" + "\n".join(found)


def test_the_graph_sees_imports():
    # The checks above are only as good as the graph read from the source.
    assert {"hope_keras.scoring.cache", "hope_keras.activations.kernels"} <= _dependencies("hope_keras.scoring.cache_builders")
    assert "hope_keras.deft.plan" in _dependencies("hope_keras.deft")  # package facade
    assert "hope_keras.derivative_matching.report" in _dependencies(
        "hope_keras.derivative_matching.compress")  # relative import
    assert ("hope_keras.derivative_matching.activations", ["get_analytic_activation"]) in [
        (t, [n for n in names if n == "get_analytic_activation"])
        for t, names, _ in GRAPH["hope_keras.derivative_matching.compress"] if names]


#: The pipeline's stages in the order data flows through them: a module imports from
#: its own stage or an earlier one, never a later one (docs/architecture.md). A stage
#: is a sub-package or module; a module belongs to the longest one naming it. The
#: utilities come first; the Keras adapter and the layer registry come before the
#: activations, which read a layer's activation through its rule, and the walker
#: after them; the two other methods, the command line and plots come last.
STAGES = ["_host_buffers", "_jit", "progress", "graph.adapter", "graph.tracing",
          "graph.fingerprint", "graph.layers", "graph.operation_rules", "activations", "graph",
          "scoring", "edit", "stats", "deploy", "search", "deft", "derivative_matching", "data",
          "plots", "cli"]

#: Function-level imports of the package's own modules that stay, as (importing
#: module, imported module): each breaks what would otherwise be a module-level cycle.
LAZY_IMPORT_ALLOWANCES = {
    # only subclassed models are traced, and tracing builds on the adapter
    ("hope_keras.graph.adapter", "hope_keras.graph.tracing"),
    # `MergeTable(...)` picks one of its implementations, which subclass it
    ("hope_keras.search.candidates", "hope_keras.search.merge_tables.certified"),
    ("hope_keras.search.candidates", "hope_keras.search.merge_tables.dense"),
    ("hope_keras.search.candidates", "hope_keras.search.merge_tables.rows"),
    ("hope_keras.search.candidates", "hope_keras.search.merge_tables.top_k"),
}


def _stage(module):
    """The index in STAGES of the longest stage naming ``module``."""
    name = module.split(".", 1)[1] if "." in module else ""
    found = [s for s in STAGES if name == s or name.startswith(s + ".")]
    return STAGES.index(max(found, key=len)) if found else len(STAGES)


def _all_imports(module):
    """[(imported hope_keras module, lineno, at module level)] of every import
    statement in ``module``, function bodies included (``TYPE_CHECKING`` blocks
    excluded)."""
    tree = ast.parse(MODULES[module].read_text())
    top = {id(n) for n in _top_level_imports(tree)}
    checking = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            checking |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in checking:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name in MODULES]
        else:
            base = _resolve(module, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
            targets = [t for t in targets if t in MODULES]
        found += [(t, node.lineno, id(node) in top) for t in dict.fromkeys(targets)]
    return found


def test_every_module_belongs_to_a_stage():
    unknown = [m for m in MODULES if m != "hope_keras" and _stage(m) == len(STAGES)]
    assert not unknown, f"modules outside the stages of STAGES: {unknown}"


def test_no_stage_imports_a_later_stage():
    upward = [f"{m}:{line} imports {t}"
              for m in MODULES if m != "hope_keras"
              for t, line, _ in _all_imports(m)
              if t != "hope_keras" and _stage(t) > _stage(m)
              and (m, t) not in LAZY_IMPORT_ALLOWANCES]
    assert not upward, "imports of a later stage:\n" + "\n".join(upward)


def test_no_function_level_import_of_the_package_but_the_allowed_ones():
    # The command line imports the library inside its commands: `hope-keras --help`
    # answers without importing TensorFlow.
    lazy = [f"{m}:{line} imports {t}"
            for m in MODULES if m not in ("hope_keras", "hope_keras.cli")
            for t, line, top in _all_imports(m)
            if not top and (m, t) not in LAZY_IMPORT_ALLOWANCES]
    assert not lazy, "function-level imports:\n" + "\n".join(lazy)


def test_the_stage_checks_see_function_level_imports():
    imports = _all_imports("hope_keras.graph.adapter")
    assert ("hope_keras.graph.tracing", False) in [(t, top) for t, _, top in imports]


def test_the_public_entry_points_stay_small():
    """`compress` takes the model, one budget of each kind, the cost, the actions, the
    data and `verbose`; `Encoder` the model and seven settings: anything else belongs
    on the cost (`HopeCost`) or the search (`SearchOptions`)."""
    import inspect

    import hope_keras

    compress = inspect.signature(hope_keras.compress).parameters
    encoder = inspect.signature(hope_keras.Encoder.__init__).parameters
    assert list(compress) == ["model", "density", "params", "flops", "steps", "cost",
                              "actions", "data", "verbose", "latency"]
    assert len(encoder) - 1 <= 8, list(encoder)  # less `self`
    assert hope_keras.SearchOptions(round_to=8).round_to == 8
