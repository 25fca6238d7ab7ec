"""House rules a reader relies on, checked on the source: parts are composed, not
inherited, and the decoder's protocol holds what the worker calls and no more."""

from __future__ import annotations

import ast
from pathlib import Path

import engine.interface as interface

ROOT = Path(__file__).resolve().parents[1]
WORKER_FACING_MOST = 15


def _classes() -> dict[str, tuple[Path, ast.ClassDef]]:
    found = {}
    for folder in ("engine", "services", "shared"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, (path, node))
    return found


def _base_name(base: ast.expr) -> str:
    return base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")


def _is_exception(name: str, classes: dict) -> bool:
    if name not in classes:
        return name.endswith(("Error", "Exception"))
    _, node = classes[name]
    return any(_is_exception(_base_name(b), classes) for b in node.bases)


def _allowed(name: str, classes: dict) -> bool:
    """A class from outside the project, a protocol, or an exception type."""
    if name not in classes:
        return True
    _, node = classes[name]
    return "Protocol" in {_base_name(b) for b in node.bases} or _is_exception(name, classes)


def test_no_class_in_engine_or_services_inherits_another_project_class():
    classes = _classes()
    offenders = []
    for name, (path, node) in classes.items():
        if not path.is_relative_to(ROOT / "engine") and not path.is_relative_to(ROOT / "services"):
            continue
        for base in node.bases:
            b = _base_name(base)
            if not _allowed(b, classes):
                offenders.append(f"{path.relative_to(ROOT)}: {name}({b})")
    assert offenders == []


def test_the_decoder_protocol_holds_what_the_worker_calls():
    members = [m for m in vars(interface.Decoder) if not m.startswith("_")]
    members += list(getattr(interface.Decoder, "__annotations__", {}))
    members = sorted(set(members))
    assert len(members) <= WORKER_FACING_MOST, members
    # Every member is called by the worker, or names what a heartbeat reports.
    worker = "\n".join(p.read_text() for p in (ROOT / "services" / "worker").rglob("*.py"))
    unused = [m for m in members if f".{m}" not in worker]
    assert unused == []
