"""The import graph of kiln-flows' packages: layers, circles and upward imports.

Every ``import``/``from … import`` statement in ``kiln_core``, ``tasks``, ``flows`` and ``drills`` —
at module level or inside a function, since a deferred import still ties two modules at run time —
is an edge from its module to the module it names (``from pkg import sub`` names the submodule when
there is one). So is every string import, ``importlib.import_module(NAME)`` or ``__import__(NAME)``, whose
``NAME`` is a string literal or a name bound to one at module level (in the same file, or imported from
another module of the four packages): an import hidden in a string ties two modules just the same. A
string import whose name is chosen at run time (a table lookup, an argument) cannot be followed; each
is listed, with its line, so a reader can check it. Checked, and printed:

* the packages of ``kiln_core`` against ``KILN_CORE_LAYERS`` below (a package is ``kiln_core.<first
  name>``; a top-level module such as ``kiln_core/chat_template.py`` is a package of its own, and
  ``kiln_core`` itself is its ``__init__``): no package circle, no arrow from a lower layer to a higher
  one (each printed with the module-to-module imports that make it), every package placed in a layer, and
  ``engine`` the only orchestrator — no other package imports two of the pipeline's stages;
* every module circle (a strongly connected component of two or more modules), marked
  ``import-time`` when it is made of module-level imports only;
* the layering of the four top-level packages: ``kiln_core`` (the engine, never Prefect) < ``tasks``
  < ``flows`` < ``drills``. ``flows.commands.drill`` — the ``kiln-flows drill`` command — is the one
  module of ``flows`` that imports ``drills``;
* how many imports inside functions ``kiln_core`` has, and the longest modules.

Usage:
    python tools/import_graph.py            # exit 1 on a circle, an upward arrow or an unplaced package
    python tools/import_graph.py --json
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kiln_core", "tasks", "flows", "drills")
LAYER = {"kiln_core": 0, "tasks": 1, "flows": 2, "drills": 3}
ALLOWED_UPWARD = {("flows.commands.drill", "drills")}
FORBIDDEN_IN_ENGINE = ("prefect",)

# The layers of kiln_core, lowest first: (layer, its packages, why it sits there). A package may import
# packages of its own layer (the circle check orders them) and of the layers below, never above.
KILN_CORE_LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("root", ("kiln_core",),
     "the version and a lazy export table: imports nothing of kiln_core, so any module may read __version__"),
    ("floor", ("errors", "canonical", "serde_json", "strict_json", "storage_settings", "storage", "storage_root", "data",
               "wording"),
     "errors and exit codes, byte-exact JSON (Kiln compact, serde_json) and hashes, strict JSON, storage, "
     "wording helpers: no domain, used by every layer"),
    ("contracts", ("contracts",),
     "wire formats, the floor of the domain: one strict model per file; they parse and check, never run work"),
    ("identity", ("identity",),
     "digests of model, tokenizer and adapter files and a teacher's identity: tokenization pins its tokenizer"),
    ("text", ("chat_template", "assistant_mask", "trajectory_mask", "tokenization", "kiln_prompts"),
     "a chat becomes token ids and target masks as Kiln renders it; needs only messages and identity"),
    ("corpus", ("corpus", "corpus_set", "materialize", "synthetic", "tiny_models"),
     "data at rest: the admitted corpus's tables (and demo corpora and models) that admission writes"),
    ("admission", ("admission", "teachers"),
     "admitting a corpus against a student, and finding teachers: built on text, corpus tables and identity"),
    ("scoring", ("scoring", "oracle"),
     "teacher scores for examples (local, vLLM, the next-token oracle); reuses admission's record parsing"),
    ("on_policy", ("on_policy",),
     "rollouts: sample the student, then have the teacher score them through scoring"),
    ("evaluation", ("logit_head", "loss", "evaluation"),
     "the model's own logits, the loss math and held-out evaluation (admits held-out corpora, renders prompts); training's watch uses it"),
    ("training", ("training",),
     "the training loop, checkpoints, receipts and the distributed world, over rollouts and the held-out watch"),
    ("after training", ("post_eval", "models"),
     "the post-eval gate runs on a trained adapter; model preparation drives evaluation and scoring"),
    ("recipes", ("recipes",),
     "Kiln's recipes: each checks its request, does its teacher work and builds the spec the engine trains; "
     "the caller hands that spec to the engine, so a recipe never runs the pipeline itself"),
    ("engine", ("engine",),
     "the one orchestrator: request → spec → admit → score → train → gate → publish; nothing imports it"),
)
ORCHESTRATOR = "engine"
# The pipeline stages the orchestrator sequences; a package that imports two of them orchestrates.
STAGES = ("admission", "scoring", "training", "post_eval")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name → file for every module of the four packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


@functools.lru_cache(maxsize=None)
def parse(path: Path) -> ast.Module:
    """A source file's syntax tree, parsed once per run of the tool (the checks read each file several times)."""
    return ast.parse(path.read_text(encoding="utf-8"))


Statement = tuple[ast.Import | ast.ImportFrom, bool, bool]  # (statement, at module level, inside a function)
Call = tuple[ast.Call, bool]  # (a string import's call, inside a function)


@functools.lru_cache(maxsize=None)
def scan(path: Path) -> tuple[list[Statement], list[Call]]:
    """One walk over a file's syntax tree: its import statements (``import_statements``) and its string
    imports' calls (``_is_string_importer``)."""
    tree = parse(path)
    statements: list[Statement] = []
    calls: list[Call] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                statements.append((child, node is tree, in_function))
            elif isinstance(child, ast.Call) and child.args and _is_string_importer(child.func):
                calls.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return statements, calls


def import_statements(path: Path) -> list[Statement]:
    """``(statement, at module level, inside a function)`` for every import statement of a file.

    "At module level" is a statement of the module's body (it runs on import); "inside a function"
    is one that runs only when its function is called.
    """
    return scan(path)[0]


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from … import`` statement names, with a relative one anchored at ``package``."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return base


def imports(path: Path, name: str, known: dict[str, Path]) -> list[tuple[str, bool, bool]]:
    """``(imported module, at module level, inside a function)`` for every import of one file, the string
    imports that can be followed included (``string_imports``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, bool, bool]] = []
    for node, top, lazy in import_statements(path):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _absolute(node, package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        found.extend((target, top, lazy) for target in targets)
    found.extend((call.target, call.top, call.lazy) for call in string_imports(name, path, known)
                 if call.target is not None)
    return found


@dataclass(frozen=True)
class StringImport:
    """One ``importlib.import_module(…)``/``__import__(…)`` call: the module it names, or None when the
    name is chosen at run time (``argument`` is the call's first argument as written)."""

    module: str
    line: int
    argument: str
    target: str | None
    top: bool
    lazy: bool


STRING_IMPORTERS = ("importlib.import_module", "import_module", "__import__")


def _module_constants(tree: ast.Module) -> dict[str, str]:
    """Names bound to a string literal by a module-level assignment (``WORKER_MODULE = "pkg.mod"``)."""
    constants = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            constants.update({target.id: value.value for target in targets if isinstance(target, ast.Name)})
    return constants


def _is_string_importer(func: ast.expr) -> bool:
    """Whether a call's function is one of ``STRING_IMPORTERS`` (checked without unparsing every call)."""
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module" and isinstance(func.value, ast.Name) and func.value.id == "importlib"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _file_constants(path: Path) -> dict[str, str]:
    """``_module_constants`` of a file."""
    return _module_constants(parse(path))


def string_imports(name: str, path: Path, known: dict[str, Path]) -> list[StringImport]:
    """Every string import of one file, resolved where its argument is a string literal or a name bound to
    one at module level, here or in the module it was imported from."""
    calls = scan(path)[1]
    if not calls:
        return []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = parse(path)
    constants = _module_constants(tree)
    for node in tree.body:  # `from pkg.launcher import WORKER_MODULE`: the constant of that module
        if isinstance(node, ast.ImportFrom) and (source := _absolute(node, package)) in known:
            theirs = _file_constants(known[source])
            constants.update({alias.asname or alias.name: theirs[alias.name] for alias in node.names
                              if alias.name in theirs})
    found: list[StringImport] = []
    for call, in_function in calls:
        argument = call.args[0]
        if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
            target = argument.value
        elif isinstance(argument, ast.Name):
            target = constants.get(argument.id)
        else:
            target = None
        if target is not None and target.startswith("."):
            target = None  # relative to a package given at run time
        found.append(StringImport(name, call.lineno, ast.unparse(argument), target, not in_function, in_function))
    return found


def all_string_imports(root: Path = ROOT) -> list[StringImport]:
    """The string imports of every module of the four packages, in module order."""
    known = modules(root)
    return [call for name, path in known.items()
            for call in string_imports(name, path, known)]


Edge = tuple[str, str, bool]  # (importing module, imported module, inside a function)


def graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]], list[tuple[str, str]], list[Edge]]:
    """All edges, module-level edges, imports of third-party packages the engine must not use, and
    every edge between two modules with whether its import sits inside a function."""
    known = modules(root)
    every: dict[str, set[str]] = {name: set() for name in known}
    eager: dict[str, set[str]] = {name: set() for name in known}
    forbidden = []
    edges: set[Edge] = set()
    for name, path in known.items():
        for target, top, lazy in imports(path, name, known):
            if name.startswith("kiln_core") and target.split(".")[0] in FORBIDDEN_IN_ENGINE:
                forbidden.append((name, target))
            while target and target not in known:  # `import kiln_core.x.y` of an attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                every[name].add(target)
                edges.add((name, target, lazy))
                if top:
                    eager[name].add(target)
    return every, eager, forbidden, sorted(edges)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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
                    found.append(sorted(component))
    return sorted(found)


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer to a higher one (``kiln_core`` → ``tasks``, ``tasks`` → ``flows``, …)."""
    found = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if LAYER[source.split(".")[0]] < LAYER[target.split(".")[0]] and (source, target.split(".")[0]) not in ALLOWED_UPWARD:
                found.append((source, target))
    return found


def package_of(module: str) -> str | None:
    """The ``kiln_core`` package a module belongs to (``kiln_core.training.trainer`` → ``training``;
    ``kiln_core`` → ``kiln_core``), or ``None`` outside ``kiln_core``."""
    parts = module.split(".")
    if parts[0] != "kiln_core":
        return None
    return parts[1] if len(parts) > 1 else "kiln_core"


def package_layers(names: list[str], edges: list[Edge], layers=KILN_CORE_LAYERS) -> dict:
    """The package-level check of ``kiln_core``'s modules ``names`` and their ``edges`` against ``layers``
    (see ``KILN_CORE_LAYERS``)."""
    rank = {package: position for position, (_, packages, _) in enumerate(layers) for package in packages}
    layer_name = {package: name for name, packages, _ in layers for package in packages}
    between: dict[tuple[str, str], list[Edge]] = {}
    present = {package_of(name) for name in names} - {None}
    for source, target, lazy in edges:
        source_package, target_package = package_of(source), package_of(target)
        if None not in (source_package, target_package) and source_package != target_package:
            between.setdefault((source_package, target_package), []).append((source, target, lazy))
    arrows: dict[str, set[str]] = {package: set() for package in present}
    for source_package, target_package in between:
        arrows[source_package].add(target_package)

    def described(pair: tuple[str, str]) -> dict:
        return {"from": pair[0], "to": pair[1],
                "from_layer": layer_name.get(pair[0]), "to_layer": layer_name.get(pair[1]),
                "imports": [{"from": s, "to": t, "in_function": lazy} for s, t, lazy in between[pair]]}

    placed = [pair for pair in sorted(between) if pair[0] in rank and pair[1] in rank]
    stage_imports = {package: sorted(arrows[package] & set(STAGES)) for package in sorted(arrows)}
    return {
        "layers": [{"layer": name, "packages": list(packages), "why": why} for name, packages, why in layers],
        "package_cycles": circles(arrows),
        "upward_arrows": [described(pair) for pair in placed if rank[pair[0]] < rank[pair[1]]],
        "unplaced_packages": sorted(present - set(rank)),
        "missing_packages": sorted(set(rank) - present),
        "orchestrators": [{"package": package, "stages": stages} for package, stages in stage_imports.items()
                          if package != ORCHESTRATOR and len(stages) > 1],
    }


def in_function_imports(root: Path = ROOT) -> dict:
    """How many import statements of ``kiln_core`` sit inside a function, and in how many files."""
    statements = internal = 0
    files = set()
    for path in sorted((root / "kiln_core").rglob("*.py")):
        for node, _, lazy in import_statements(path):
            if lazy:
                statements += 1
                files.add(path)
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                internal += bool(getattr(node, "level", 0)) or any(name.startswith("kiln_core") for name in names)
    return {"statements": statements, "naming_kiln_core": internal, "files": len(files)}


def report(root: Path = ROOT, layers=KILN_CORE_LAYERS) -> dict:
    every, eager, forbidden, edges = graph(root)
    sizes = sorted(((len(path.read_text(encoding="utf-8").splitlines()), name) for name, path in modules(root).items()),
                   reverse=True)
    eager_circles = circles(eager)
    calls = all_string_imports(root)
    return {
        "modules": len(every),
        "edges": sum(len(targets) for targets in every.values()),
        "string_imports": {
            "followed": [{"from": call.module, "to": call.target, "line": call.line, "in_function": call.lazy}
                         for call in calls if call.target is not None],
            "not_followed": [{"from": call.module, "line": call.line, "argument": call.argument}
                             for call in calls if call.target is None],
        },
        "longest_modules": [{"module": name, "lines": lines} for lines, name in sizes[:5]],
        "in_function_imports": in_function_imports(root),
        "packages": package_layers(list(every), edges, layers),
        "circles": [{"modules": component, "import_time": component in eager_circles} for component in circles(every)],
        "upward_imports": [{"from": source, "to": target} for source, target in upward(every)],
        "engine_imports_prefect": [{"from": source, "to": target} for source, target in forbidden],
    }


def problems(result: dict) -> int:
    """How many of the report's findings break a rule (0: the graph is clean)."""
    packages = result["packages"]
    return sum(len(result[key]) for key in ("circles", "upward_imports", "engine_imports_prefect")) + sum(
        len(packages[key]) for key in ("package_cycles", "upward_arrows", "unplaced_packages", "missing_packages",
                                       "orchestrators"))


def print_report(result: dict) -> None:
    packages = result["packages"]
    lazy = result["in_function_imports"]
    print(f"{result['modules']} modules, {result['edges']} import edges (kiln_core, tasks, flows, drills)")
    print("longest modules: " + ", ".join(f"{m['module']} {m['lines']}" for m in result["longest_modules"]))
    print(f"in-function imports in kiln_core: {lazy['statements']} in {lazy['files']} files "
          f"({lazy['naming_kiln_core']} of kiln_core modules), all counted below")
    strings = result["string_imports"]
    print(f"string imports ({', '.join(STRING_IMPORTERS)}): {len(strings['followed'])} followed, counted below; "
          f"{len(strings['not_followed'])} name a module chosen at run time and cannot be followed")
    for call in strings["followed"]:
        print(f"  {call['from']}:{call['line']} -> {call['to']}")
    for call in strings["not_followed"]:
        print(f"  {call['from']}:{call['line']} -> import_module({call['argument']}) (not followed)")
    print("kiln_core layers, lowest first:")
    for position, layer in enumerate(packages["layers"]):
        print(f"  {position:2d} {layer['layer']}: {', '.join(layer['packages'])} — {layer['why']}")
    print(f"package cycles: {len(packages['package_cycles'])}")
    for cycle in packages["package_cycles"]:
        print(f"  cycle of {len(cycle)} packages: {', '.join(cycle)}")
    print(f"upward arrows: {len(packages['upward_arrows'])}")
    for arrow in packages["upward_arrows"]:
        print(f"  {arrow['from']} ({arrow['from_layer']}) -> {arrow['to']} ({arrow['to_layer']})")
        for edge in arrow["imports"]:
            print(f"    {edge['from']} -> {edge['to']}{' (in a function)' if edge['in_function'] else ''}")
    print(f"unplaced packages: {len(packages['unplaced_packages'])}"
          + (" (add them to KILN_CORE_LAYERS): " + ", ".join(packages["unplaced_packages"])
             if packages["unplaced_packages"] else ""))
    if packages["missing_packages"]:
        print("packages in KILN_CORE_LAYERS that do not exist: " + ", ".join(packages["missing_packages"]))
    print(f"orchestrators other than {ORCHESTRATOR}: {len(packages['orchestrators'])}")
    for package in packages["orchestrators"]:
        print(f"  {package['package']} imports the stages {', '.join(package['stages'])}")
    print(f"circles: {len(result['circles'])}")
    for circle in result["circles"]:
        print(f"  {'import-time ' if circle['import_time'] else ''}circle: {' <-> '.join(circle['modules'])}")
    print(f"upward imports: {len(result['upward_imports'])}")
    for edge in result["upward_imports"]:
        print(f"  {edge['from']} -> {edge['to']}")
    print(f"kiln_core importing prefect: {len(result['engine_imports_prefect'])}")
    for edge in result["engine_imports_prefect"]:
        print(f"  {edge['from']} -> {edge['to']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read (default: this one)")
    args = parser.parse_args(argv)
    result = report(args.root)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0 if problems(result) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
