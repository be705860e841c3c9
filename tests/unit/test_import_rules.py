"""The package map of docs/architecture.md, enforced: walk every module's imports (ast, function-level
imports included) and fail on a forbidden edge; and import the router in a fresh interpreter to show
it never loads torch (router pods are CPU-only)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("colocated_service", "prefill_service", "decode_service")
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
ALLOWED = {"engine": ("common.checks",)}  # the shared need/is_int helpers: pure Python, no imports


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
