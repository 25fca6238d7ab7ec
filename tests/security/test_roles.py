"""deploy/nats/permissions.conf is shared/roles.py, and shared/roles.py is the code.

- The checked-in config is the generator's output, and the users files give every
  role of shared/roles.py a user, in its account.
- Logged in as each role on a real nats-server (deploy/nats/auth.conf), every
  declared grant works, and every other role's grant is refused unless this role
  declares it too: the server grants exactly what roles.py says.
- Each service package's publishes, requests and subscriptions (read from its
  source) are granted to its role: a new subject in the code without a grant fails.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re

import pytest

from services.micro import health_subject, ready_subject
from services.registry.store import Registry
from shared import roles, subjects
from shared.roles import PACKAGE_ROLE, ROLES, covers, render
from tests.security.conftest import NATS_DIR, REPO
from tests.security.conftest import ROLES as TEST_ROLES
from tests.security.test_registry_roles import tiny_model


def test_the_checked_in_permissions_are_the_generated_ones():
    assert (NATS_DIR / "permissions.conf").read_text() == render(), \
        "deploy/nats/permissions.conf differs: run `python -m shared.roles --write`"


@pytest.mark.parametrize("users", ["users.conf", "users-nkeys.conf"])
def test_every_role_has_one_user_in_its_account(users):
    text = (NATS_DIR / users).read_text()
    accounts = dict(re.findall(r"^  (\w+) \{\n(.*?)^  \}", text, flags=re.M | re.S))
    for role in ROLES:
        assert accounts[role.account].count(f"permissions: ${role.var} }}") == 1, role.name
    assert len(re.findall(r"permissions: \$\w+_PERMS", text)) == len(ROLES)
    assert set(TEST_ROLES) == {r.name for r in ROLES}


def test_probe_subjects_are_the_services():
    for role in ROLES:
        if role.service:
            assert roles.probe(role.service, "health") == health_subject(role.service)
            assert roles.probe(role.service, "ready") == ready_subject(role.service)


def test_matching_is_natss():
    assert covers("a.*.c", "a.b.c") and covers("a.>", "a.b.c") and covers("a.b", "a.b")
    assert not covers("a.*", "a.b.c") and not covers("a.>", "a") and not covers("a.b", "a.b.c")


# --- on a real server ----------------------------------------------------------


def concrete(pattern: str) -> str:
    """A subject the pattern covers, as the code would use it."""
    return ".".join({"*": "id7", ">": "id7.x"}.get(t, t) for t in pattern.split("."))


def every_publish() -> set[str]:
    return {concrete(p) for r in ROLES for p in r.allowed("publish")} | {
        concrete(d) for r in ROLES for d in r.deny_publish}


def every_subscribe() -> set[str]:
    return {p for r in ROLES for p in r.allowed("subscribe")}


def violated(role, op: str) -> set[str]:
    """The subjects the server refused `role` for `op` ("publish", "subscription")."""
    out = set()
    for err in role.violations.permission_errors():
        m = re.search(rf'permissions violation for {op} to "([^"]+)"', err, flags=re.I)
        if m:
            out.add(m.group(1).lower())
    return out


async def settle(role, expected: int) -> None:
    """Every -ERR for earlier operations arrives before the PONG of a flush; error_cb
    runs as a task of its own, so wait for it to have recorded them."""
    await role.nc.flush(timeout=10)
    end = asyncio.get_running_loop().time() + 10
    while len(role.violations.permission_errors()) < expected:
        assert asyncio.get_running_loop().time() < end, role.violations.seen
        await asyncio.sleep(0.01)  # a bounded wait for callbacks already queued


@pytest.mark.parametrize("name", [r.name for r in ROLES])
async def test_the_server_grants_each_role_what_it_declares_and_nothing_else(bus, name):
    role = roles.BY_NAME[name]
    r = await bus.connect(name)
    pubs = sorted(every_publish())
    for subject in pubs:
        await r.nc.publish(subject, b"x")  # not JSON: no JetStream API call acts on it
    refused_pub = [x for x in pubs if not role.grants("publish", x)]
    await settle(r, len(refused_pub))
    assert violated(r, "publish") == {x.lower() for x in refused_pub}

    r = await bus.connect(name)
    subs = sorted(every_subscribe() | {concrete(p) for p in every_subscribe()})
    for subject in subs:
        await r.nc.subscribe(subject)
    refused_sub = [x for x in subs if not role.grants("subscribe", x)]
    await settle(r, len(refused_sub))
    assert violated(r, "subscription") == {x.lower() for x in refused_sub}


async def test_a_gateway_reads_the_tokenizer_of_a_pushed_model(bus, tmp_path):
    deploy = await bus.connect("deploy")
    gateway = await bus.connect("gateway")
    src = tiny_model(tmp_path)
    (src / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    admin = await Registry.open(deploy.nc, actor="ci@test")
    v1 = await admin.push(src, "renamed-tiny", progress=False)
    reader = await Registry.open(gateway.nc)
    dest = await reader.fetch_tokenizer("renamed-tiny", v1.version, tmp_path / "tok")
    assert (dest / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert not (dest / "model.safetensors").exists()
    await gateway.assert_clean()


# --- the code against its role ---------------------------------------------------

PUBLISHES = {"publish", "request"}
SUBSCRIBES = {"subscribe"}
JS_API = {"stream_info": "$JS.API.STREAM.INFO.{}", "key_value": "$JS.API.STREAM.INFO.KV_{}",
          "object_store": "$JS.API.STREAM.INFO.OBJ_{}",
          "create_key_value": "$JS.API.STREAM.CREATE.KV_{}"}


def subject_of(node: ast.AST) -> str | None:
    """The subject a `subjects.X` or `subjects.f(...)` expression names."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "subjects":
        value = getattr(subjects, node.attr)
        return value if isinstance(value, str) else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        if isinstance(f.value, ast.Name) and f.value.id == "subjects":
            return getattr(subjects, f.attr)("id7")
    return None


def subjects_of(node: ast.AST, scope: ast.AST) -> list[str]:
    """What an argument names: a subjects expression, or a local name assigned one
    (`subject = subjects.X`, `for subject in (subjects.A, subjects.B)`) in `scope`."""
    direct = subject_of(node)
    if direct is not None:
        return [direct]
    if not isinstance(node, ast.Name):
        return []  # a reply subject taken from a message
    out = []
    for n in ast.walk(scope):
        values = []
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.id
                                             for t in n.targets):
            values = [n.value]
        elif isinstance(n, ast.For) and isinstance(n.target, ast.Name) \
                and n.target.id == node.id and isinstance(n.iter, (ast.Tuple, ast.List)):
            values = n.iter.elts
        out += [x for v in values if (x := subject_of(v)) is not None]
    return out


def uses(package: str) -> list[tuple[str, str, str]]:
    """(op, subject, where) for each bus use in services/<package>/ that names a
    subject from shared.subjects."""
    found = []
    for path in sorted((REPO / "services" / package).glob("*.py")):
        tree = ast.parse(path.read_text())
        scopes = [n for n in ast.walk(tree)
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for scope in scopes:
            for call in ast.walk(scope):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                    continue
                attr, where = call.func.attr, f"{path.name}:{call.lineno}"
                args = list(call.args) + [k.value for k in call.keywords
                                          if k.arg in ("subject", "bucket")]
                if not args:
                    continue
                if attr in PUBLISHES or attr in SUBSCRIBES:
                    op = "publish" if attr in PUBLISHES else "subscribe"
                    found += [(op, x, where) for x in subjects_of(args[0], scope)]
                elif attr in JS_API:
                    found += [("publish", JS_API[attr].format(x), where)
                              for x in subjects_of(args[0], scope)]
        # Any other mention of a bus subject (an endpoint table, say) must be granted
        # one way or the other.
        for node in ast.walk(tree):
            x = subject_of(node)
            if x and x.split(".")[0] in ("inference", "telemetry", "tensorbus"):
                found.append(("either", x, f"{path.name}:{node.lineno}"))
    return found


@pytest.mark.parametrize("package", sorted(PACKAGE_ROLE))
def test_every_subject_a_service_uses_is_granted_to_its_role(package):
    role = PACKAGE_ROLE[package]
    found = uses(package)
    ops = {op for op, _, _ in found}
    # The batch runner subscribes to nothing of its own (a KV watch, its probes) and
    # requests the inference subjects through a table by url: named, not called.
    assert {"publish", "subscribe"} <= ops or (package == "batch" and "either" in ops), \
        "the scan found no bus use"
    missing = [(op, x, where) for op, x, where in found
               if not (role.grants(op, x) if op != "either"
                       else role.grants("publish", x) or role.grants("subscribe", x))]
    assert not missing, f"{role.name} is not granted: {missing} (shared/roles.py)"


def test_the_scan_sees_what_the_drift_was_about():
    """The uses that were once denied are among those the scan reads."""
    gateway = {(op, x) for op, x, _ in uses("gateway")}
    assert ("publish", subjects.SCHED_RESERVE) in gateway
    assert ("publish", subjects.sched_submit("id7")) in gateway
    assert ("subscribe", subjects.SCHED_LOAD) in gateway
    assert ("publish", f"$JS.API.STREAM.INFO.{subjects.TELEMETRY_STREAM}") in gateway
    assert ("either", subjects.RERANK) in gateway
    scheduler = {(op, x) for op, x, _ in uses("scheduler")}
    assert {("subscribe", subjects.SCHED_RESERVE), ("subscribe", subjects.SCHED_LOAD),
            ("subscribe", subjects.sched_submit("id7"))} <= scheduler


def test_the_generator_checks_and_refuses_unknown_arguments():
    assert roles.main(["--check"]) == 0
    assert roles.main(["--bogus"]) == 2


def test_the_roles_table_in_operations_is_the_generated_one():
    text = (REPO / "docs" / "operations.md").read_text()
    assert roles.table() in text, "docs/operations.md: paste `python -m shared.roles --table`"
