"""The package's structure, as the project keeps it: no import cycle among python/zeroflat's
modules (imports inside functions included: a lazy import is still a dependency), and no source
file over 700 lines in src/ or python/zeroflat without its reason in the header (its first 12
lines say "700 lines")."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "zeroflat"


def _imports(path, modules):
    """The package modules `path` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            elif node.module and node.module.split(".")[0] == "zeroflat":
                parts = node.module.split(".")
                names = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            else:
                names = []
            out.update(names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "zeroflat":
                    out.add(parts[1] if len(parts) > 1 else "__init__")
    return {m for m in out if m in modules and m != path.stem}


def test_no_import_cycle_in_the_package():
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    edges = {name: _imports(p, modules) for name, p in modules.items()}
    cycles = []

    def visit(node, path):
        for m in sorted(edges[node]):
            if m in path:
                cycles.append(path[path.index(m):] + [m])
            elif len(path) < len(modules):
                visit(m, path + [m])

    for name in sorted(modules):
        visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_long_files_say_why():
    files = list((ROOT / "src").rglob("*.cc")) + list((ROOT / "src").rglob("*.h")) + \
        list(PACKAGE.glob("*.py"))
    long = []
    for f in files:
        text = f.read_text().split("\n")
        if len(text) > 700 and "700 lines" not in "\n".join(text[:12]):
            long.append(f"{f.relative_to(ROOT)} ({len(text)} lines)")
    assert not long, "over 700 lines without a reason in the header: " + ", ".join(long)
