"""The structure the code keeps: extensions use the core only through `ckpt_plugins` and
`ckpt_plugins.ext`; the core imports and names no framework; its modules import each other
without a cycle, and every import in them resolves; it makes its threads in one place; no
function of the core grows past about 60 lines."""
import ast
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "ckpt_plugins")
EXTENSIONS = ("hf_ext", "deepspeed_ext", "megatron_ext")
FRAMEWORKS = ("transformers", "accelerate", "peft", "deepspeed", "megatron", "torchtitan")


def sources(folder):
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield path, open(path).read()


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def imports(path: str, tree, top_level_only: bool = False):
    """The absolute module names `tree` imports (at module level only, when asked)."""
    package = module_name(path) if path.endswith("__init__.py") else module_name(path).rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def declared_api_violations(path: str, tree) -> list:
    """Imports of the core other than `ckpt_plugins` (its top level) and `ckpt_plugins.ext`."""
    bad = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        bad += [n for n in names if n.startswith("ckpt_plugins.") and n != "ckpt_plugins.ext"]
    return bad


@pytest.mark.parametrize("extension", EXTENSIONS)
def test_extensions_use_only_the_declared_api(extension):
    bad = [(os.path.relpath(path, ROOT), name) for path, src in sources(os.path.join(ROOT, extension))
           for name in declared_api_violations(path, ast.parse(src))]
    assert not bad, bad


def _code_tokens(src: str):
    """Names and string literals outside docstrings and comments."""
    tree = ast.parse(src)
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.NAME, tokenize.STRING) and tok.start[0] not in docs:
            yield tok.start[0], tok.string


def test_the_core_imports_and_names_no_framework():
    pattern = re.compile("|".join(FRAMEWORKS), re.IGNORECASE)
    found = []
    for path, src in sources(CORE):
        found += [(os.path.relpath(path, ROOT), n) for n in imports(path, ast.parse(src))
                  if n.split(".")[0] in FRAMEWORKS + EXTENSIONS]
        found += [(os.path.relpath(path, ROOT), line, text) for line, text in _code_tokens(src) if pattern.search(text)]
    assert not found, found


def test_the_core_has_no_import_cycle():
    graph = {}
    for path, src in sources(CORE):
        graph[module_name(path)] = {n for n in imports(path, ast.parse(src))
                                    if n.startswith("ckpt_plugins")}
    modules = set(graph)
    edges = {m: {n if n in modules else n.rpartition(".")[0] for n in deps} & modules - {m} for m, deps in graph.items()}
    # a package imports its own modules in its __init__; the reverse edge is the cycle to find
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in edges[m]:
            if state.get(n) == "open" and not m.startswith(n + "."):
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            visit(m)
    assert not cycles, cycles


def test_no_function_of_the_core_is_longer_than_60_lines():
    long = [(os.path.relpath(path, ROOT), node.name, node.end_lineno - node.lineno + 1)
            for path, src in sources(CORE) for node in ast.walk(ast.parse(src))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long


def test_the_core_makes_its_threads_only_through_own_threads():
    """Its threads are marked so that a finaliser collected there never waits for a save (`own_threads`)."""
    made = [(os.path.relpath(path, ROOT), node.lineno) for path, src in sources(CORE)
            if not path.endswith("own_threads.py") for node in ast.walk(ast.parse(src))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("Thread", "ThreadPoolExecutor", "Timer")]
    assert not made, made


def test_every_import_of_the_core_resolves_including_those_inside_functions():
    """A lazy import runs only on its own path (a CLI command, a rare error): check them all here."""
    import importlib
    import importlib.util
    missing = []
    for path, src in sources(CORE):
        name = module_name(path)
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.level:
                module = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                target = importlib.import_module(module)
                missing += [(os.path.relpath(path, ROOT), node.lineno, f"{module}.{a.name}") for a in node.names
                            if not hasattr(target, a.name) and importlib.util.find_spec(f"{module}.{a.name}") is None]
    assert not missing, missing
