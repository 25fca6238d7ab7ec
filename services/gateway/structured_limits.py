"""Limits on what a request asks a grammar to enforce, checked before any work is
admitted: `response_format`'s JSON schema, vLLM's `guided_*` / `structured_outputs`
fields, and each tool's `parameters`.

  - size: each field's JSON (or text) at most TENSORBUS_MAX_SCHEMA_BYTES;
  - depth: each field's nesting (objects and lists) at most TENSORBUS_MAX_SCHEMA_DEPTH;
  - compile time: turning them into grammars (llguidance, services/gateway/structured.py)
    runs on a small pool of its own threads, never on the event loop, and a request
    whose grammars take longer than TENSORBUS_MAX_SCHEMA_COMPILE_S is answered 400.
    The compile itself cannot be interrupted: it ends when llguidance's own budgets
    end it. Such a request's structure is remembered, so sending it again is
    refused at once instead of taking a thread again.

Each limit's 400 names the field and the limit. Depth is counted without
recursion, so a pathological nesting costs its length, never the stack.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

import msgspec

from shared.errors import bad_request

T = TypeVar("T")
SLOW_KEPT = 256  # structures that took too long, refused at once when they come again


class SchemaLimits(NamedTuple):
    max_bytes: int = 262_144
    max_depth: int = 64
    compile_s: float = 2.0


def fields(req) -> Iterator[tuple[str, Any]]:
    """(field name, value) of every structure a completion or chat request gives."""
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema is not None:
        yield "response_format.json_schema.schema", fmt.json_schema.schema
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if (value := getattr(req, name, None)) is not None:
            yield name, value
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        for name in ("json", "regex", "choice", "grammar"):
            if (value := getattr(so, name)) is not None:
                yield f"structured_outputs.{name}", value
    for i, tool in enumerate(getattr(req, "tools", None) or ()):
        if tool.function.parameters is not None:
            yield f"tools[{i}].function.parameters", tool.function.parameters


def check(req, limits: SchemaLimits) -> bool:
    """Raise a 400 naming the field and the limit it passes; True when the request
    has any structure (its grammars are then compiled through `compile`)."""
    found = False
    for field, value in fields(req):
        found = True
        depth = nesting(value, limits.max_depth)
        if depth > limits.max_depth:
            raise bad_request(f"'{field}' nests deeper than {limits.max_depth} levels "
                              f"(TENSORBUS_MAX_SCHEMA_DEPTH)", code="schema_too_deep")
        size = len(value.encode()) if isinstance(value, str) else len(msgspec.json.encode(value))
        if size > limits.max_bytes:
            raise bad_request(f"'{field}' is {size} bytes; the limit is {limits.max_bytes} "
                              f"bytes (TENSORBUS_MAX_SCHEMA_BYTES)", code="schema_too_large")
    return found


def nesting(value: Any, stop: int) -> int:
    """How deep objects and lists nest in `value` (a scalar: 0), counted up to
    `stop` + 1 at most."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop:
            return deepest
        todo.extend((child, depth + 1) for child in children
                    if isinstance(child, (dict, list)))
    return deepest


class Compiler:
    """Runs a request's grammar building off the event loop, within its time."""

    def __init__(self, limits: SchemaLimits, threads: int = 2) -> None:
        self.limits = limits
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._slow: OrderedDict[bytes, None] = OrderedDict()

    async def compile(self, req, build: Callable[[], T]) -> T:
        """`build()` (which compiles the request's grammars, or raises their 400) on
        the pool, or a 400 when it takes longer than the limit."""
        key = hashlib.sha256(msgspec.json.encode(list(fields(req)))).digest()
        names = ", ".join(f"'{f}'" for f, _ in fields(req))
        if key in self._slow:
            raise self._too_slow(names)
        future = asyncio.get_running_loop().run_in_executor(self._pool, build)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.limits.compile_s)
        except TimeoutError:
            self._slow[key] = None
            while len(self._slow) > SLOW_KEPT:
                self._slow.popitem(last=False)
            raise self._too_slow(names) from None

    def _too_slow(self, names: str):
        return bad_request(f"{names} took longer than {self.limits.compile_s:g} s to compile "
                           f"into a grammar (TENSORBUS_MAX_SCHEMA_COMPILE_S)",
                           code="schema_too_complex")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
