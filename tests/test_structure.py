"""The package's structure, read from its source and from the layer table of docs/ARCHITECTURE.md: every module sits
in one layer of that table and imports only modules of its own layer and of the layers listed before it; no import
cycle among the modules; no underscore name imported across modules; no notebook-widget library in the engine; no
module over 800 lines and no function over 10 parameters unless its reason is listed (WIDE_SIGNATURES).

Imports are read with ``ast``: module-level ones and those inside functions (an import inside a function is still a
dependency; it only runs later). Only imports under ``if TYPE_CHECKING:`` (annotations, no runtime dependency) are
left out. Nothing is allowed by exception: there is no allowlist.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "autopar_lab"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"

WIDGET_LIBRARIES = ("ipywidgets", "IPython", "plotly", "anywidget")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


# --- the layer table -------------------------------------------------------------------------------------------------


def layer_table(text: str) -> list[tuple[str, list[str]]]:
    """(layer name, its entries) for each row of the first table under "## The layers", in order. An entry is a
    backticked path relative to ``autopar_lab/``: ``graph/`` (a package), ``plan.py`` (a module), or a data file."""
    section = text.split("## The layers", 1)[1]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|"):
            if rows:
                break  # the table ended
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue  # the header and its rule
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def _pattern(entry: str) -> str | None:
    """The module name (or package prefix) a table entry names; None for a file that is not Python."""
    if entry.endswith("/"):
        return "autopar_lab." + entry.rstrip("/").replace("/", ".")
    if entry.endswith(".py"):
        name = entry[:-3].replace("/", ".")
        return "autopar_lab" if name == "__init__" else f"autopar_lab.{name}"
    return None


def layers_of(rows: list[tuple[str, list[str]]], modules) -> tuple[dict[str, int], list[str]]:
    """({module: index of its layer}, problems): each module in the layer of the most specific entry naming it
    (``solve/exhaustive.py`` before ``solve/``); a problem for a module no entry names and an entry naming nothing."""
    patterns: list[tuple[str, int]] = []
    problems = []
    for k, (name, entries) in enumerate(rows):
        for entry in entries:
            pat = _pattern(entry)
            if pat is None:
                if not list(ROOT.glob(entry)) and not list(REPO.glob(entry)):
                    problems.append(f"layer {name!r} lists {entry!r}, which does not exist")
                continue
            if not any(m == pat or m.startswith(pat + ".") for m in modules):
                problems.append(f"layer {name!r} lists {entry!r}, which is no module of autopar_lab")
            patterns.append((pat, k))
    out = {}
    for m in modules:
        hits = [(len(pat), k) for pat, k in patterns if m == pat or m.startswith(pat + ".")]
        if not hits:
            problems.append(f"{m} is in no layer of docs/ARCHITECTURE.md's table")
        else:
            out[m] = max(hits)[1]
    return out, problems


ROWS = layer_table(ARCHITECTURE.read_text())
LAYER, PROBLEMS = layers_of(ROWS, MODULES)


# --- imports ---------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text())


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _known(name: str, modules: dict[str, Path] = MODULES) -> str | None:
    """The package module ``name`` refers to (itself, or the nearest enclosing module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, modules: dict[str, Path] = MODULES) -> list[tuple[str, str | None, ast.AST]]:
    """(imported module, imported name or None, node) for every import of ``module``, at any depth."""
    path = modules[module]
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node)
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node) if sub in modules else (base, a.name, node))
    return out


def _type_checking_only(module: str, modules: dict[str, Path] = MODULES) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (annotations only: no runtime dependency)."""
    lines = set()
    for node in ast.walk(_tree(modules[module])):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _edges(modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module in modules:
        skip = _type_checking_only(module, modules)
        for target, _name, node in _imports(module, modules):
            hit = _known(target, modules) if target.startswith("autopar_lab") else None
            if hit and hit != module and node.lineno not in skip:
                edges[module].add(hit)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _upward(edges: dict[str, set[str]], layer: dict[str, int]) -> list[str]:
    """Every import of a module from a layer listed after its own."""
    names = [name for name, _ in ROWS]
    return [f"{m} ({names[layer[m]]}) imports {t} ({names[layer[t]]})"
            for m in sorted(edges) for t in sorted(edges[m]) if m in layer and t in layer and layer[t] > layer[m]]


# --- the tests -------------------------------------------------------------------------------------------------------


def test_the_layer_table_is_read_as_written():
    names = [name for name, _ in ROWS]
    assert names[:3] == ["utilities", "graph", "cluster"] and names[-1] == "command line"
    assert names.index("plan values") < names.index("pricing") < names.index("plans") < names.index("session")
    # the most specific entry wins: solve/exhaustive.py is listed with the plans, the rest of solve/ below them
    assert names[LAYER["autopar_lab.solve.exhaustive"]] == "plans"
    assert names[LAYER["autopar_lab.solve.inter"]] == "solve"
    rows = layer_table("## The layers\n\ntext\n\n| layer | modules | job |\n|---|---|---|\n| a | `graph/`, `x.json` | "
                       "j |\n| b | `graph/capture.py`, `nothing.py` | j |\n\n| other | `plan.py` | j |\n")
    assert rows == [("a", ["graph/", "x.json"]), ("b", ["graph/capture.py", "nothing.py"])]
    layer, problems = layers_of(rows, ["autopar_lab.graph", "autopar_lab.graph.capture", "autopar_lab.plan"])
    assert layer == {"autopar_lab.graph": 0, "autopar_lab.graph.capture": 1}
    assert problems == ["layer 'a' lists 'x.json', which does not exist",
                        "layer 'b' lists 'nothing.py', which is no module of autopar_lab",
                        "autopar_lab.plan is in no layer of docs/ARCHITECTURE.md's table"]


def test_every_module_is_in_one_layer_of_the_architecture():
    assert PROBLEMS == []


def test_the_reader_sees_the_imports_it_must():
    edges = _edges()
    assert "autopar_lab.pricing" in edges["autopar_lab.planner"]           # module level
    assert "autopar_lab.pins" in edges["autopar_lab.widgets.session"]       # inside a method
    assert "autopar_lab.solve.ilp.problem" in edges["autopar_lab.solve.ilp.highs_direct"]  # relative, in a package
    assert "autopar_lab.pricing.table" not in edges["autopar_lab.plan"]      # TYPE_CHECKING only
    # A cycle is found when there is one, and an import from a later layer.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    low, high = "autopar_lab.graph.capture", "autopar_lab.plan"
    assert _upward({low: {high}, high: {low}}, LAYER) == [f"{low} (graph) imports {high} (plans)"]


def test_each_module_imports_only_its_own_layer_and_the_ones_before_it():
    assert _upward(_edges(), LAYER) == []


def test_no_import_cycle_among_the_package_modules():
    assert _cycles(_edges()) == []


def _private_uses(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(module, name) for every underscore name a module takes from another package module: ``from x import _y``
    or ``x._y`` on a module imported by name."""
    found = set()
    for module in modules:
        aliases: set[str] = set()
        for target, name, node in _imports(module, modules):
            if not target.startswith("autopar_lab"):
                continue
            if name is not None and name.startswith("_") and not name.startswith("__") and \
                    _known(target, modules) != module:
                found.add((module, name))
            if name is None:
                aliases.update(a.asname or a.name.rpartition(".")[2] for a in node.names)
            else:
                aliases.update(a.asname or a.name for a in node.names if f"{target}.{a.name}" in modules)
        for node in ast.walk(_tree(modules[module])):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.add((module, node.attr))
    return found


def test_no_underscore_name_used_across_modules():
    assert _private_uses(MODULES) == set()


def test_a_private_name_across_modules_is_caught(tmp_path):
    files = {"__init__": "", "a": "def _helper():\n    pass\n", "b": "from .a import _helper\n",
             "c": "from . import a\n\n\ndef f():\n    return a._helper()\n", "d": "def _own():\n    return _own\n"}
    modules = {}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
        modules["autopar_lab" if name == "__init__" else f"autopar_lab.{name}"] = tmp_path / f"{name}.py"
    assert _private_uses(modules) == {("autopar_lab.b", "_helper"), ("autopar_lab.c", "_helper")}


@pytest.mark.parametrize("module", [m for m in MODULES if not m.startswith("autopar_lab.widgets")])
def test_the_engine_imports_no_widget_library(module):
    bad = [t for t, _n, _node in _imports(module) if t.split(".")[0] in WIDGET_LIBRARIES]
    assert bad == [], f"{module} imports {bad}: the engine must run without Jupyter"


# --------------------------------------------------------------------------------------------------------------
# Size: small modules with one job each, short parameter lists (option objects instead of long keyword lists)

MAX_MODULE_LINES = 800
MAX_PARAMETERS = 10  # positional-only + positional + keyword-only, ``self`` included; *args and **kwargs aside

# Every function with more than MAX_PARAMETERS parameters, and why it keeps them. "public": a documented entry
# point whose parameters after (model, cluster) are all keyword-only (checked below); "pending": a signature another
# change owns. An entry that no longer needs its place, or names no function, fails the test: the list cannot go
# stale.
WIDE_SIGNATURES = {
    "autopar_lab.planner.auto_plan": (
        "public", "DESIGN.md's planner: model, cluster and 12 keyword-only settings, each a documented keyword "
        "(table, microbatches, schedule, mem_limit_bytes, precision, on_progress), a modelling switch (stage_comm, "
        "virtual_stages) or a search setting (solver, space, workers, max_stages); grouping the last four in an "
        "options object would still leave 11 and break the calls that pass them"),
    "autopar_lab.layouts.megatron.megatron_plan": (
        "public", "DESIGN.md's baseline (planner.megatron_plan is it under the old keyword names): the layout is "
        "Megatron-LM's own flags (dp, tp, pp, cp, ep, microbatches or micro_batch_size, schedule, virtual_stages, "
        "remat, zero, sequence_parallel), each what a user writes, with auto_plan's table, mem_limit_bytes, "
        "precision and solver, and the sharding / lean switches; only solver is a search setting"),
    "autopar_lab.layouts.fsdp.fsdp_plan": (
        "public", "issue 31: torchtitan's own settings (dp_shard, dp_replicate, tp, pp, cp, reshard_after_forward, "
        "local_batch_size, activation checkpointing, schedule) by keyword, with auto_plan's table, mem_limit_bytes, "
        "precision and solver"),
    "autopar_lab.layouts.maxtext.maxtext_plan": (
        "public", "issue 31: MaxText's own ici_*/dcn_* parallelism keys and per_device_batch_size, remat_policy, by "
        "keyword as its config names them, with auto_plan's table, mem_limit_bytes, precision and solver"),
    "autopar_lab.pricing.price.price_stages": (
        "public", "pricing's documented core (al.pricing.price_stages): table and stages, then keyword-only what each "
        "is priced from (intras, layer_costs, solutions), the schedule (schedule, virtual_stages, microbatches) and "
        "the storage decisions a plan records (layer_pins, zero), each a field price_plan passes through"),
    "autopar_lab.plan.price_plan": (
        "public", "al.price_plan: the decisions (table, stages) and keyword-only ones as price_stages takes them, with "
        "what the plan records as given (method, stage_comm, solve_s, notes, pins, stage_pins); the notebooks call it "
        "with a few of them by name"),
}


def _functions(tree: ast.AST, prefix: str):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}.{node.name}", node
            yield from _functions(node, f"{prefix}.{node.name}")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}.{node.name}")
        else:
            yield from _functions(node, prefix)


def _parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)


def _wide(modules: dict[str, Path]) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {name: node for module, path in modules.items() for name, node in _functions(_tree(path), module)
            if _parameter_count(node) > MAX_PARAMETERS}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_the_line_limit(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines (at most {MAX_MODULE_LINES}): split it by job"


def test_no_function_takes_more_than_ten_parameters():
    wide = _wide(MODULES)
    unexplained = {name: _parameter_count(node) for name, node in wide.items() if name not in WIDE_SIGNATURES}
    assert unexplained == {}, "group these parameters into a keyword-only option object (a frozen dataclass)"
    assert sorted(set(WIDE_SIGNATURES) - set(wide)) == [], "these no longer need their place in WIDE_SIGNATURES"
    for name, (kind, reason) in WIDE_SIGNATURES.items():
        assert kind in ("public", "pending") and reason
        if kind == "public":  # a documented entry point: everything after (model, cluster) by keyword
            a = wide[name].args
            assert len(a.posonlyargs) + len(a.args) <= 2 and not a.vararg, name


def test_a_wide_function_is_caught(tmp_path):
    text = ("def f(a, b, c, d, e, f, g, h, i, j, k):\n    pass\n\n\n"
            "class C:\n    def m(self, a, b, c, d, e, f, g, h, i, *, j):\n        def inner(*args, **kw):\n"
            "            pass\n\n\n"
            "def fine(a, b, c, d, e, f, g, h, i, j, *rest, **more):\n    pass\n")
    (tmp_path / "a.py").write_text(text)
    assert sorted(_wide({"autopar_lab.a": tmp_path / "a.py"})) == ["autopar_lab.a.C.m", "autopar_lab.a.f"]


# --------------------------------------------------------------------------------------------------------------
# Backend quirks: what one machine's compiler and runtime do, fitted there, lives in backends/ alone

#: Names of the CPU's fitted quirks (backends/cpu.py): its hooks' internals, figures and terms.
QUIRK_NAMES = re.compile(r"chain_read|CHAIN_READERS|chain_pair|chain_rank|\bchain_s\b|serial_host|virtual_share|"
                         r"driver_share|shares_cores|ONE_PROGRAM_SHARE")

#: Where they may be named: the backend module and its hooks; the calibration that measures them; the device's
#: description in cluster/, whose fields carry the fitted figures (Efficiency.driver_share, Device.shares_cores).
QUIRK_HOMES = ("autopar_lab.backends", "autopar_lab.calibrate", "autopar_lab.cluster")


def _quirk_mentions(modules: dict[str, Path]) -> list[str]:
    return [f"{m}:{k}: {line.strip()}" for m, path in modules.items()
            if not any(m == h or m.startswith(h + ".") for h in QUIRK_HOMES)
            for k, line in enumerate(path.read_text().splitlines(), 1) if QUIRK_NAMES.search(line)]


def test_only_the_backend_module_names_the_cpu_quirks():
    """The general cost model (sharding, solve, pricing), the plans, the CLI and the views call backends' hooks and
    never name a CPU quirk, in code or in prose."""
    assert _quirk_mentions(MODULES) == []
    homes = {m for m in MODULES if any(m == h or m.startswith(h + ".") for h in QUIRK_HOMES)}
    assert {"autopar_lab.backends", "autopar_lab.backends.cpu"} <= homes


def test_a_quirk_name_outside_its_home_is_caught(tmp_path):
    files = {"pricing_x": "x = cluster.device.efficiency.driver_share\n", "solve_y": "def f(serial_host=False): ...\n",
             "backends": "CHAIN_READERS = 1\n", "clean": "virtual_stages = 2  # the chain of links\n"}
    modules = {}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
        modules[f"autopar_lab.{name}"] = tmp_path / f"{name}.py"
    assert [m.split(":")[0] for m in _quirk_mentions(modules)] == ["autopar_lab.pricing_x", "autopar_lab.solve_y"]


def _virtual_devices(tree: ast.AST) -> list[str]:
    """Where code says "virtual" of devices: an attribute or keyword named ``virtual`` (the old ``Device.virtual``),
    or a name of virtual devices or hosts (``virtual_share``, ``virtual_host`` ...)."""
    out = []
    for node in ast.walk(tree):
        names = [node.attr] if isinstance(node, ast.Attribute) and node.attr == "virtual" else \
            [node.arg] if isinstance(node, ast.keyword) and node.arg == "virtual" else \
            [n for n in ([node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute)
                         else [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [])
             if re.search(r"virtual_(share|dev|host|cpu|core)", n)]
        out += [f"{n} (line {node.lineno})" for n in names]
    return out


def test_virtual_means_only_interleaved_virtual_stages():
    """No code of the package says "virtual" of devices: the CPU's devices that share a machine's cores are
    ``shares_cores``; "virtual" is left to interleaved virtual stages."""
    bad = {m: found for m, path in MODULES.items() if (found := _virtual_devices(_tree(path)))}
    assert bad == {}
    caught = _virtual_devices(ast.parse("d.virtual\nDevice(virtual=True)\nc.virtual_share(2)\nvirtual_stages = 2\n"))
    assert caught == ["virtual (line 1)", "virtual (line 2)", "virtual_share (line 3)"]
