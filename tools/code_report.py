"""The shape of heron's source, measured: line counts, the longest functions and
the import graph (circles and imports that run against the layering).

    python tools/code_report.py            # report on src/heron
    python tools/code_report.py --check    # exit 1 on a circle, a wrong-way
                                           # import or an over-long function

Only the standard library is used, so it runs before `make setup`. Every
``import`` counts, including those inside functions; imports under
``if TYPE_CHECKING:`` count for the layering (a type from a higher layer is
still a dependency on it) but not for circles (they never run).
``tests/unit/test_code_structure.py`` runs the check with the test suite.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "src" / "heron"

MAX_FUNCTION_LINES = 80
# A function may be longer only if its docstring says why, with this phrase.
LONG_FUNCTION_MARK = "one piece"

# Layers, lowest first. A module may import from its own layer and any layer
# below; an import of a higher layer is a wrong-way arrow. The first matching
# prefix decides a module's layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("heron.config", "heron.envs", "heron.utils", "heron.outputs", "heron.step_outputs",
              "heron.sampling_params", "heron.request", "heron.gc_freeze", "heron.profiling",
              "heron.tempdirs", "heron.http_bounds", "heron.interrupts", "heron.launcher_watch",
              "heron.token_bans")),
    ("kernels", ("heron.kernels",)),
    ("loader", ("heron.loader",)),
    ("structured_output", ("heron.structured_output",)),
    ("core", ("heron.core",)),
    ("routing", ("heron.routing",)),
    ("compute", ("heron.attention", "heron.models", "heron.sample")),
    ("worker", ("heron.worker", "heron.spec_decode")),
    ("engine", ("heron.engine", "heron.metrics")),
    # the servers: the API server and the router, which renders a request's prompt as the API server does (the
    # same chat request shapes, tool rewriting and Responses input, imported where it hashes such a request)
    ("servers", ("heron.router", "heron.entrypoints", "heron.benchmarks")),
]
# Modules every layer may import because they only re-export lazily.
LAYER_EXEMPT = {"heron"}


@dataclass
class ModuleInfo:
    name: str
    path: Path
    lines: int
    runtime_imports: set[str] = field(default_factory=set)
    type_only_imports: set[str] = field(default_factory=set)


@dataclass
class FunctionInfo:
    qualname: str
    path: Path
    lineno: int
    lines: int
    justified: bool


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    relative = path.relative_to(package_dir.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve_import(target: str, names: list[str], known: set[str]) -> set[str]:
    """The heron modules an import statement loads (a from-import of a
    submodule loads the submodule)."""
    found = {f"{target}.{name}" for name in names if f"{target}.{name}" in known}
    if target in known and (not names or len(found) < len(names)):
        found.add(target)  # a name defined by the module itself, not a submodule
    return found


def _is_type_checking_block(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def collect_imports(module: str, is_package: bool, tree: ast.Module,
                    known: set[str]) -> tuple[set[str], set[str]]:
    runtime: set[str] = set()
    type_only: set[str] = set()

    def visit(node: ast.AST, in_type_block: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking_block(child):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, in_type_block)
                continue
            visit_stmt(child, in_type_block)

    def visit_stmt(child: ast.AST, in_type_block: bool) -> None:
        bucket = type_only if in_type_block else runtime
        if isinstance(child, ast.Import):
            for alias in child.names:
                if alias.name.startswith("heron"):
                    bucket.update(resolve_import(alias.name, [], known))
        elif isinstance(child, ast.ImportFrom):
            target = child.module or ""
            if child.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (child.level - 1)]
                target = ".".join(base + ([target] if target else []))
            if target.startswith("heron"):
                bucket.update(resolve_import(target, [a.name for a in child.names], known))
        visit(child, in_type_block)

    visit(tree, False)
    runtime.discard(module)
    type_only.discard(module)
    return runtime, type_only - runtime


def scan(package_dir: Path = PACKAGE_DIR) -> tuple[dict[str, ModuleInfo], list[FunctionInfo]]:
    paths = sorted(package_dir.rglob("*.py"))
    known = {module_name(p, package_dir) for p in paths}
    modules: dict[str, ModuleInfo] = {}
    functions: list[FunctionInfo] = []
    for path in paths:
        source = path.read_text()
        tree = ast.parse(source)
        name = module_name(path, package_dir)
        runtime, type_only = collect_imports(name, path.name == "__init__.py", tree, known)
        modules[name] = ModuleInfo(name, path, source.count("\n"), runtime, type_only)
        functions.extend(_functions(tree, path))
    return modules, functions


def _functions(tree: ast.Module, path: Path) -> list[FunctionInfo]:
    found: list[FunctionInfo] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{child.name}"
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                docstring = ast.get_docstring(child) or ""
                found.append(FunctionInfo(qualname, path, child.lineno,
                                          (child.end_lineno or child.lineno) - start + 1,
                                          LONG_FUNCTION_MARK in docstring))
                visit(child, qualname + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:  # functions defined under an if, a try, a with
                visit(child, prefix)

    visit(tree, "")
    return found


def layer_of(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def wrong_way_imports(modules: dict[str, ModuleInfo]) -> list[tuple[str, str]]:
    wrong: list[tuple[str, str]] = []
    for module in modules.values():
        own = layer_of(module.name)
        for target in sorted(module.runtime_imports | module.type_only_imports):
            if target in LAYER_EXEMPT:
                continue
            their = layer_of(target)
            if own is not None and their is not None and their > own:
                wrong.append((module.name, target))
    return wrong


def import_cycles(modules: dict[str, ModuleInfo]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def strongconnect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(modules[node].runtime_imports):
            if target not in index:
                strongconnect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for name in sorted(modules):
        if name not in index:
            strongconnect(name)
    return components


def long_functions(functions: list[FunctionInfo], limit: int = MAX_FUNCTION_LINES) -> list[FunctionInfo]:
    return sorted((f for f in functions if f.lines > limit), key=lambda f: -f.lines)


def report(top: int) -> int:
    modules, functions = scan()
    total = sum(m.lines for m in modules.values())
    print(f"src/heron: {len(modules)} modules, {total} lines")
    print("largest files:")
    for m in sorted(modules.values(), key=lambda m: -m.lines)[:top]:
        print(f"  {m.lines:5d}  {m.path.relative_to(ROOT)}")
    print("longest functions:")
    for f in sorted(functions, key=lambda f: -f.lines)[:top]:
        mark = " (justified)" if f.justified else ""
        print(f"  {f.lines:5d}  {f.path.relative_to(ROOT)}:{f.lineno} {f.qualname}{mark}")
    cycles = import_cycles(modules)
    print(f"import circles: {len(cycles)}")
    for cycle in cycles:
        print("  " + " <-> ".join(cycle))
    wrong = wrong_way_imports(modules)
    print(f"wrong-way imports: {len(wrong)}")
    for source, target in wrong:
        print(f"  {source} -> {target}")
    return len(cycles) + len(wrong)


def check(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """Every rule the code must keep; an empty list means it keeps them."""
    modules, functions = scan(package_dir)
    problems = [f"import circle: {' <-> '.join(c)}" for c in import_cycles(modules)]
    problems += [f"wrong-way import: {s} -> {t}" for s, t in wrong_way_imports(modules)]
    problems += [f"{f.path.name}:{f.lineno} {f.qualname} is {f.lines} lines "
                 f"(over {MAX_FUNCTION_LINES}; its docstring does not say why it is "
                 f"'{LONG_FUNCTION_MARK}')"
                 for f in long_functions(functions) if not f.justified]
    unlayered = [m for m in modules if layer_of(m) is None and m not in LAYER_EXEMPT]
    problems += [f"module {m} is in no layer (add it to LAYERS)" for m in unlayered]
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a rule is broken")
    parser.add_argument("--top", type=int, default=15, help="how many files and functions to list")
    args = parser.parse_args()
    if args.check:
        problems = check()
        for problem in problems:
            print(problem)
        sys.exit(1 if problems else 0)
    report(args.top)


if __name__ == "__main__":
    main()
