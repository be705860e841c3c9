"""The package map of docs/architecture.md, enforced.

- Forbidden edges between top-level packages: walk every module's imports (ast, function-level imports
  included) and fail on one; and import the router in a fresh interpreter to show it never loads torch
  (router pods are CPU-only).
- No import circles between pdserve modules: strongly connected components of the graph of every
  import (module level, inside functions, under TYPE_CHECKING), as issue 47 counted them.
- No import inside a function, except of an optional or heavy-by-design dependency (OPTIONAL_DEPS)
  or of a pdserve module that wraps one (ADAPTERS).
- The layers, inside engine/ above all: `lint-imports` (import-linter) over the contracts in
  pyproject.toml's [tool.importlinter].
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("colocated_service", "prefill_service", "decode_service", "encoder_service")
PACKAGES = ("common", "engine", "transfer", "service", *SERVICES, "router", "loadtest", "pdserve")
HTTP = ("fastapi", "starlette", "uvicorn", "httpx", "zmq", "msgpack")
# package -> top-level modules it must never import
FORBIDDEN = {
    "common": ("engine", "service", "transfer", "router", "loadtest", "pdserve", *SERVICES, "torch", "triton"),
    "engine": ("transfer", "service", "common", "router", "loadtest", "pdserve", *SERVICES, *HTTP),
    "transfer": ("engine", "service", "router", "loadtest", "pdserve", *SERVICES),
    "router": ("engine", "service", "transfer", "loadtest", "pdserve", *SERVICES, "torch", "triton"),
    "service": ("router", "loadtest", "pdserve", *SERVICES),
    **{s: ("router", "loadtest", "pdserve", *(o for o in SERVICES if o != s)) for s in SERVICES},
}
# package -> modules it may import although their top-level package is forbidden above
# common.checks: the shared need/is_int helpers; common.configs: config fields that declare their own flags
# (dataclasses + argparse), so each EngineConfig flag is declared once for every command; common.kv_hashing:
# the KV events' block hash, which the router computes too (hashlib + struct). All pure Python.
ALLOWED = {"engine": ("common.checks", "common.configs", "common.kv_hashing")}

# Dependencies a function may import (a dotted prefix of the imported module), and why it is not
# imported at the top of its module.
OPTIONAL_DEPS = {
    "triton": "the optional `gpu` extra: a CPU install has none; kernels load when a CUDA tensor meets them",
    "matplotlib": "the optional `bench` extra: pdserve bench draws its plots only where it is installed",
    "tqdm": "the optional `bench` extra: pdserve bench's progress bar, where it is installed",
    "ucxx": "UCX's libraries (~0.6 s, a CUDA probe): only a PD worker whose transfer backend is ucx loads them",
    "gguf": "only the one-time conversion of the embedded model reads GGUF (and needs torch for it)",
    "xgrammar": "a declared dependency, but over 1 s to import with the transformers it brings: loaded on "
                "the first grammar, by the warm thread (engine/sampling/grammar.py)",
    "transformers": "1-3 s to import: loaded where a tokenizer is first needed (a frontend's start, the "
                    "first stop string or grammar), never on a worker's start path",
    "opentelemetry.sdk": "tracing is off unless configured; off, no process loads the SDK (test_tracing.py)",
    "opentelemetry.exporter": "as opentelemetry.sdk: the OTLP exporter loads only when tracing is on",
}
# pdserve modules that wrap one of OPTIONAL_DEPS at their top: a function may import them as it would the
# dependency itself (and each must still import it, at module level: test_adapters_wrap_their_dependency).
ADAPTERS = {
    "engine.attention.triton_backend": "triton",
    "engine.attention.mla_triton": "triton",
    "engine.models.moe_triton": "triton",
    "engine.extras.lora.triton_sgmv": "triton",
    "engine.recurrent.triton_steps": "triton",
    "engine.recurrent.triton_chunked": "triton",
    "transfer.ucx_backend": "ucxx",
    "engine.models.gguf_convert": "gguf",
}


def imported_modules(path: Path) -> set[str]:
    """Dotted names of every module imported anywhere in the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def forbidden_edges(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imported_modules(path):
            if name.split(".")[0] in FORBIDDEN[package] and name not in ALLOWED.get(package, ()):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_import(package: str) -> None:
    assert (ROOT / package).is_dir()
    assert forbidden_edges(package) == []


def test_the_checker_sees_a_forbidden_edge(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from transfer.manager import TransferManager\n    import torch.nn\n")
    assert imported_modules(f) == {"transfer.manager", "torch.nn"}


def test_router_process_never_loads_torch() -> None:
    code = ("import sys, router.main, router.app, router.proxy, router.metrics, common.metrics;"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'transfer', 'service'));"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# --- circles and imports inside functions ------------------------------------------------------


def project_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the given packages (a package by its __init__)."""
    mods = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            name = ".".join(f.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The project module an imported name lands in (the longest dotted prefix that is one)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, path: Path) -> Iterator[tuple[ast.stmt, list[str], bool]]:
    """(node, absolute names it imports, whether it sits inside a function) for every import statement.
    `from a import b` names both a and a.b (b may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    in_function = {id(sub) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        yield node, names, id(node) in in_function


def import_graph(mods: dict[str, Path]) -> dict[str, dict[str, str]]:
    """module -> {imported project module: where ("file:line")}, every import counted."""
    graph: dict[str, dict[str, str]] = {m: {} for m in mods}
    for m, path in mods.items():
        for node, names, _ in imports_of(m, path):
            for name in names:
                target = _owner(name, mods)
                if target and target != m:
                    graph[m].setdefault(target, f"{_rel(path)}:{node.lineno}")
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def describe_circles(graph: dict[str, dict[str, str]], found: list[list[str]]) -> str:
    lines = []
    for comp in found:
        lines.append(" <-> ".join(comp))
        members = set(comp)
        lines += [f"    {m} -> {t}  ({where})" for m in comp for t, where in sorted(graph[m].items()) if t in members]
    return "\n".join(lines)


def _allowed_inside(target: str, mods: dict[str, Path]) -> bool:
    if target in mods:
        return target in ADAPTERS
    return any(target == dep or target.startswith(dep + ".") for dep in OPTIONAL_DEPS)


def imports_inside_functions(mods: dict[str, Path]) -> list[str]:
    """"file:line imports X" for every import inside a function that neither OPTIONAL_DEPS nor ADAPTERS allow."""
    bad = []
    for m, path in mods.items():
        for node, names, inside in imports_of(m, path):
            if not inside:
                continue
            targets = {_owner(n, mods) or n for n in (names[1:] if isinstance(node, ast.ImportFrom) else names)}
            if isinstance(node, ast.ImportFrom) and not any(t in mods for t in targets):
                targets = {_owner(names[0], mods) or names[0]}  # `from pkg import name`: the module pkg
            for t in sorted(targets):
                if not _allowed_inside(t, mods):
                    bad.append(f"{_rel(path)}:{node.lineno} imports {t}")
    return sorted(bad)


def test_no_import_circles_between_modules() -> None:
    graph = import_graph(project_modules())
    found = circles(graph)
    assert not found, f"{len(found)} import circles (each with its edges):\n" + describe_circles(graph, found)


def test_no_import_inside_a_function_but_optional_dependencies() -> None:
    bad = imports_inside_functions(project_modules())
    assert not bad, (f"{len(bad)} imports inside functions; move them to the module's top, or allow the dependency in "
                     "OPTIONAL_DEPS (or its wrapper in ADAPTERS) with the reason:\n" + "\n".join(bad))


def test_adapters_wrap_their_dependency() -> None:
    mods = project_modules()
    for module, dep in ADAPTERS.items():
        assert module in mods, f"ADAPTERS names {module}, which is gone"
        tree = ast.parse(mods[module].read_text())
        top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
        assert any(t == dep or t.startswith(dep + ".") for t in top), f"{module} no longer imports {dep} at its top"
        assert dep in OPTIONAL_DEPS


def test_the_checkers_see_a_circle_and_an_inner_import(tmp_path: Path) -> None:
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from engine.b import B\nA = 1\n")
    (pkg / "b.py").write_text("B = 2\n\ndef f():\n    from engine import a\n    import triton\n    import torch\n"
                              "    from engine.c import C\n")
    (pkg / "c.py").write_text("import numpy\nC = 3\n")
    mods = project_modules(tmp_path, ("engine",))
    graph = import_graph(mods)
    assert circles(graph) == [["engine.a", "engine.b"]]
    assert "engine.a -> engine.b" in describe_circles(graph, circles(graph))
    inner = sorted(line.split(" imports ")[1] for line in imports_inside_functions(mods))
    assert inner == ["engine.a", "engine.c", "torch"]  # triton is an optional dependency


# --- layers (import-linter) -----------------------------------------------------------------------


def test_import_linter_contracts() -> None:
    """pyproject.toml's [tool.importlinter] contracts: the package layers and engine's inner layers."""
    beside = Path(sys.executable).with_name("lint-imports")
    lint = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert lint, "import-linter is missing: pip install -e '.[test]'"
    r = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    broken = r.stdout.partition("Broken contracts")[2] or r.stdout
    assert r.returncode == 0, broken + r.stderr
