"""How ringcomm's modules import one another (read from their source): no cycle, and none of
ringcomm's own modules imported inside a function, where such an import would hide one; and
`import ringcomm` loads no CUDA library."""

import ast
import subprocess
import sys
from pathlib import Path

import ringcomm

PACKAGE = Path(ringcomm.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(name: str):
    """(imported module, line, inside a function?) for each ringcomm module `name` imports,
    but its own packages, which Python has imported before it."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    tree = ast.parse(path.read_text(), str(path))
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target in MODULES and target != name and target not in ancestors:
                yield target, node.lineno, id(node) in in_function


def find_cycle(graph: dict):
    """A list of modules each importing the next and the last the first, or None."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return stack[stack.index(imported) :]
            if imported not in state:
                cycle = visit(imported)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_modules_import_one_another_without_a_cycle():
    graph = {name: {target for target, _, _ in imports(name)} for name in MODULES}
    assert {"ringcomm.backend", "ringcomm.hooks.state", "ringcomm.bench.common"} <= set(graph)
    assert "ringcomm.communicator" in graph["ringcomm.backend"]  # the graph sees relative imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle + cycle[:1])


def test_ringcomm_modules_are_imported_at_the_top():
    # Inside a function, an import is for an optional or heavy dependency (torch's parts,
    # matplotlib, mpi4py, the CUDA extension), never for one of these modules.
    hidden = [
        f"{MODULES[name].relative_to(PACKAGE.parent)}:{line} imports {target}"
        for name in MODULES
        for target, line, inside in imports(name)
        if inside
    ]
    assert not hidden, hidden


def test_import_ringcomm_loads_no_cuda_library():
    code = (
        "import ringcomm, ringcomm.compress, ringcomm.hooks, torch\n"
        "ringcomm.compress.topk(torch.randn(1000), 10)\n"
        "maps = open('/proc/self/maps').read()\n"
        "print([line.split()[-1] for line in maps.splitlines() if 'cuda' in line.lower()])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
