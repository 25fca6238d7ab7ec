"""What each role may publish and subscribe to on the bus: the one source of
deploy/nats/permissions.conf.

Every subject is built from shared.subjects; a function subject is written with `*`
where its id goes (`subjects.worker_work("*")`). `python -m shared.roles --write`
rewrites deploy/nats/permissions.conf from this module; `--check` exits 1 when the
checked-in file differs (tests/security/test_roles.py asserts the same). users.conf
and users-nkeys.conf include that file and give each role of `ROLES` one user in its
`account`.

A role lists what its code does, nothing more: tests/security/test_roles.py scans
each service package for the subjects it publishes, requests and subscribes to and
fails on one its role does not grant, and logs in as each role on a real nats-server
to prove every grant works.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from shared import subjects as s

ANY_ID = "*"  # the id token of a per-instance subject

INBOX = "_INBOX.>"
SERVICE_DISCOVERY = "$SRV.>"


def probe(service: str, what: str) -> str:
    """A per-instance probe subject (services/micro.py: health_subject, ready_subject)."""
    return f"tensorbus.v1.svc.{service}.{what}"


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def obj_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


REGISTRY_KV = kv_stream(s.REGISTRY_META)
REGISTRY_OBJ = obj_stream(s.REGISTRY_OBJECTS)
RESPONSES_KV = kv_stream(s.RESPONSES_BUCKET)
BATCHES_KV = kv_stream(s.BATCHES_BUCKET)
FILES_OBJ = obj_stream(s.FILES_BUCKET)


def js_read(stream: str, bind_only: bool = False) -> tuple[str, ...]:
    """The JetStream API subjects nats-py sends to read `stream` (see HEADER)."""
    info = (f"$JS.API.STREAM.INFO.{stream}",)
    if bind_only:
        return info
    return info + (
        f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.FC.{stream}.>",
    )


def js_replay(stream: str) -> tuple[str, ...]:
    """Reading `stream` through a pull consumer too (`tensorbus telemetry replay`):
    fetch its messages, and delete the consumer after."""
    return js_read(stream) + (f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
                              f"$JS.API.CONSUMER.DELETE.{stream}.>")


JS_ACCOUNT = ("$JS.API.INFO", "$JS.API.STREAM.NAMES")
"""Account info, and the stream lookup `js.subscribe()` does without a stream name."""

NO_WRITES = (
    "$KV.>", "$O.>",
    "$JS.API.STREAM.CREATE.>", "$JS.API.STREAM.UPDATE.>",
    "$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
)
"""Denials that back up the allow lists: only deploy writes or reshapes the registry."""
STREAM_CHANGES = NO_WRITES[3:]  # update, delete, purge, message delete

FILES_AND_BATCHES = (
    js_read(BATCHES_KV) + js_read(FILES_OBJ)
    + (f"$JS.API.STREAM.CREATE.{BATCHES_KV}", f"$JS.API.STREAM.CREATE.{FILES_OBJ}",
       f"$KV.{s.BATCHES_BUCKET}.>", f"$O.{s.FILES_BUCKET}.>",
       f"$JS.API.STREAM.PURGE.{FILES_OBJ}"))
"""/v1/files and /v1/batches (services/batchstore.py): both buckets, created by the first
user; a file's chunks go with a purge of their subject when it is deleted."""
OTHERS_STREAM_CHANGES = tuple(x for x in STREAM_CHANGES if ".PURGE." not in x) + tuple(
    f"$JS.API.STREAM.PURGE.{st}" for st in (
        kv_stream(s.REGISTRY_META), obj_stream(s.REGISTRY_OBJECTS), s.TELEMETRY_STREAM))
"""STREAM_CHANGES for a role that purges the files bucket: purges denied elsewhere."""


@dataclass(frozen=True)
class Responses:
    """`allow_responses`: replies to requests this role received, without a grant."""

    max: int  # messages per request; -1 = unlimited (streamed answers)
    expires: str


@dataclass(frozen=True)
class Role:
    name: str
    account: str
    about: str
    publish: tuple[tuple[str, tuple[str, ...]], ...]  # (why, subjects) groups
    subscribe: tuple[tuple[str, tuple[str, ...]], ...]
    deny_publish: tuple[str, ...] = ()
    responses: Responses | None = None
    service: str = ""  # its nats.micro service name, when it runs one

    @property
    def var(self) -> str:
        return f"{self.name.upper()}_PERMS"

    def allowed(self, op: str) -> list[str]:
        groups = self.publish if op == "publish" else self.subscribe
        return [subj for _, group in groups for subj in group]

    def grants(self, op: str, subject: str) -> bool:
        """Whether the server lets this role `op` ("publish" or "subscribe") on
        `subject` (a subscription's own wildcards are taken literally, as tokens)."""
        if op == "publish" and any(covers(d, subject) for d in self.deny_publish):
            return False
        return any(covers(a, subject) for a in self.allowed(op))


def covers(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` one or more at the end. A wildcard
    in `subject` (a subscription's) is covered only by one at least as wide."""
    pt, st = pattern.split("."), subject.split(".")
    for i, p in enumerate(pt):
        if p == ">":
            return len(st) > i
        if i >= len(st) or st[i] == ">" or (p != "*" and p != st[i]):
            return False
    return len(pt) == len(st)


def _own_probes(service: str) -> tuple[str, ...]:
    return (probe(service, "health"), probe(service, "ready"))


PUBLIC = s.PUBLIC_INFERENCE + (s.MODELS, s.files(ANY_ID), s.batches(ANY_ID))
STREAMED = (s.EMBEDDINGS, s.COMPLETIONS, s.CHAT_COMPLETIONS, s.RESPONSES)
"""Public subjects answered by more than one message (chunks, then [DONE])."""

GATEWAY = Role(
    "gateway", "TENSORBUS",
    "serves inference.v1.*, submits work, gathers results on its inbox.",
    publish=(
        ("Submissions: any scheduler, or the one that reserved the request's room.",
         (s.SCHED_SUBMIT, s.sched_submit(ANY_ID))),
        ("Room for a large request before it is tokenized (request/reply).",
         (s.SCHED_RESERVE,)),
        ("A client went away: every worker and scheduler drops the request.", (s.CANCEL,)),
        ("Request records (a plain publish, or a JetStream publish once the stream exists).",
         (s.TELEMETRY_REQUESTS, f"$JS.API.STREAM.INFO.{s.TELEMETRY_STREAM}")),
        ("Its own probes, asked from inside the pod (Kubernetes exec probes).",
         _own_probes("tensorbus-gateway")),
        ("Registry, read-only: metadata, aliases and their watch (KV), the tokenizer "
         "files of registry models (Object Store).",
         JS_ACCOUNT + js_read(REGISTRY_KV) + js_read(REGISTRY_OBJ)),
        ("Stored /v1/responses: its own KV bucket, created by the first gateway.",
         js_read(RESPONSES_KV) + (f"$JS.API.STREAM.CREATE.{RESPONSES_KV}",
                                  f"$KV.{s.RESPONSES_BUCKET}.>")),
        ("/v1/files and /v1/batches: file bytes (Object Store) and records (KV).",
         FILES_AND_BATCHES),
    ),
    subscribe=(
        ("The public API (queue group gateway).", PUBLIC),
        ("Heartbeats and scale decisions (which models exist and are served), the "
         "schedulers' load reports, the local orchestrator's fleet status.",
         (s.TELEMETRY_WORKERS, s.TELEMETRY_SCALE, s.SCHED_LOAD, s.ORCHESTRATOR_STATUS)),
        ("Its probes, replies and discovery.",
         (probe("tensorbus-gateway", ">"), INBOX, SERVICE_DISCOVERY)),
    ),
    # It answers inference.v1.* (allow_responses below), it never requests it.
    # It may create one stream (its bucket's), so stream creation is not denied here.
    deny_publish=("inference.v1.>", f"$KV.{s.REGISTRY_META}.>", f"$O.{s.REGISTRY_OBJECTS}.>")
    + OTHERS_STREAM_CHANGES,
    # Answers to clients (and streamed chunks, then [DONE]) go to the request's
    # reply subject: unlimited messages per request while the request lives.
    responses=Responses(-1, "10m"),
    service="tensorbus-gateway",
)

SCHEDULER = Role(
    "scheduler", "TENSORBUS",
    "takes submissions, dispatches to workers, answers the gateway.",
    publish=(
        ("Dispatch, scale decisions, its load report to the other schedulers and gateways.",
         (s.worker_work(ANY_ID), s.TELEMETRY_SCALE, s.SCHED_LOAD)),
        ("Held / Accepted / WorkError go to the gateway's inbox named in the work "
         "(WorkRequest.reply), not to a reply subject.", (INBOX,)),
        ("Its own probes.", _own_probes("tensorbus-scheduler")),
        ("Registry, read-only: aliases prod/canary and their traffic weights; binds "
         "the object store without reading weights.",
         JS_ACCOUNT + js_read(REGISTRY_KV) + js_read(REGISTRY_OBJ, bind_only=True)),
    ),
    subscribe=(
        ("Submissions (queue group scheduler, and its own), reservations, finished work.",
         (s.SCHED_SUBMIT, s.sched_submit(ANY_ID), s.SCHED_RESERVE, s.sched_done(ANY_ID))),
        ("A cancel drops a request it holds for a cold start.", (s.CANCEL,)),
        ("Heartbeats, the other schedulers' loads, the local orchestrator's fleet status.",
         (s.TELEMETRY_WORKERS, s.SCHED_LOAD, s.ORCHESTRATOR_STATUS)),
        ("Its probes, replies and discovery.",
         (probe("tensorbus-scheduler", ">"), INBOX, SERVICE_DISCOVERY)),
    ),
    deny_publish=("inference.v1.>",) + NO_WRITES,
    # Reservations, micro discovery and probes answer once.
    responses=Responses(1, "1m"),
    service="tensorbus-scheduler",
)

WORKER = Role(
    "worker", "TENSORBUS",
    "runs work, replies straight to the gateway's inbox, reads the registry.",
    publish=(
        ("Results, chunks and errors for WorkRequest.reply (the gateway's inbox).", (INBOX,)),
        ("Finished work to its scheduler, heartbeats.",
         (s.sched_done(ANY_ID), s.TELEMETRY_WORKERS)),
        ("Its own probes.", _own_probes("tensorbus-worker")),
        ("Registry, read-only: metadata and aliases (KV), weights (Object Store), and "
         "the alias watch that triggers a hot swap.",
         JS_ACCOUNT + js_read(REGISTRY_KV) + js_read(REGISTRY_OBJ)),
    ),
    subscribe=(
        ("Its work and cancels.", (s.worker_work(ANY_ID), s.CANCEL)),
        ("Its probes, replies and discovery.",
         (probe("tensorbus-worker", ">"), INBOX, SERVICE_DISCOVERY)),
    ),
    # A worker never speaks for the public API, never writes a bucket or reshapes a
    # stream, and never submits or dispatches.
    deny_publish=("inference.v1.>",) + NO_WRITES + (
        "$JS.API.CONSUMER.DELETE.>", s.SCHED_SUBMIT, s.SCHED_RESERVE, "tensorbus.v1.worker.>"),
    responses=Responses(1, "1m"),
    service="tensorbus-worker",
)

TELEMETRY = Role(
    "telemetry", "TENSORBUS",
    "reads every telemetry subject, owns the TELEMETRY stream, publishes summaries. "
    "It never touches the API, dispatch or the registry.",
    publish=(
        ("Summaries.", (s.TELEMETRY_SUMMARY,)),
        ("Its stream TELEMETRY: made or updated at start (and by `tensorbus replicas`), "
         "read and replayed, durable consumers included.",
         JS_ACCOUNT + (f"$JS.API.STREAM.CREATE.{s.TELEMETRY_STREAM}",
                       f"$JS.API.STREAM.UPDATE.{s.TELEMETRY_STREAM}")
         + js_replay(s.TELEMETRY_STREAM)
         + (f"$JS.API.CONSUMER.DURABLE.CREATE.{s.TELEMETRY_STREAM}.>",
            f"$JS.ACK.{s.TELEMETRY_STREAM}.>")),
    ),
    subscribe=(
        ("Every record (requests, workers, scale; summaries are its own).",
         (s.TELEMETRY_ALL,)),
        ("Its probes, replies and discovery.",
         (probe("tensorbus-telemetry", ">"), INBOX, SERVICE_DISCOVERY)),
    ),
    deny_publish=("inference.v1.>", "tensorbus.v1.>", "$KV.>", "$O.>",
                  "$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>"),
    responses=Responses(1, "1m"),
    service="tensorbus-telemetry",
)

DEPLOY = Role(
    "deploy", "TENSORBUS",
    "the operator credential. The only role that writes the registry (push a "
    "version, move the prod/canary aliases); also discovers services (`nats micro "
    "ls`), probes them and replays the TELEMETRY stream (`tensorbus telemetry`). Run "
    "by people and by the registry-seeding job, never by a long-running service.",
    publish=(
        ("Registry writes: KV keys, object chunks and metadata.",
         (f"$KV.{s.REGISTRY_META}.>", f"$O.{s.REGISTRY_OBJECTS}.>")),
        ("Registry streams and consumers: create, update (`tensorbus replicas`), read.",
         JS_ACCOUNT + ("$JS.API.STREAM.LIST",
                       f"$JS.API.STREAM.*.{REGISTRY_KV}", f"$JS.API.STREAM.*.{REGISTRY_OBJ}",
                       f"$JS.API.STREAM.MSG.*.{REGISTRY_KV}",
                       f"$JS.API.STREAM.MSG.*.{REGISTRY_OBJ}")
         + tuple(x for st in (REGISTRY_KV, REGISTRY_OBJ)
                 for x in (f"$JS.API.DIRECT.GET.{st}", f"$JS.API.DIRECT.GET.{st}.>",
                           f"$JS.API.CONSUMER.*.{st}", f"$JS.API.CONSUMER.*.{st}.>",
                           f"$JS.FC.{st}.>"))),
        ("Telemetry replay (read-only on TELEMETRY): `tensorbus telemetry replay`.",
         js_replay(s.TELEMETRY_STREAM)),
        ("Service discovery (nats micro ls / info / stats) and instance probes.",
         (SERVICE_DISCOVERY, probe("*", "health"), probe("*", "ready"))),
    ),
    subscribe=(
        ("Replies, and the live telemetry subjects (`tensorbus telemetry`).",
         (INBOX, s.TELEMETRY_ALL)),
    ),
    deny_publish=("inference.v1.>", "telemetry.v1.>",
                  "tensorbus.v1.sched.>", "tensorbus.v1.worker.>", s.CANCEL),
)

BATCH = Role(
    "batch", "TENSORBUS",
    "the batch runner: sends each line of a batch to the public API, as a client "
    "does, and keeps files and progress in JetStream.",
    publish=(
        ("A batch's requests, answered whole.", (s.EMBEDDINGS, s.COMPLETIONS, s.CHAT_COMPLETIONS)),
        ("Its own probes.", _own_probes("tensorbus-batch")),
        ("Input, output and error files (Object Store), batch records, their watch and "
         "per-line progress (KV).", JS_ACCOUNT + FILES_AND_BATCHES),
    ),
    subscribe=(
        ("Its probes, replies and discovery.",
         (probe("tensorbus-batch", ">"), INBOX, SERVICE_DISCOVERY)),
    ),
    # Nothing of the registry, dispatch or telemetry: it only talks to the gateways.
    deny_publish=(f"$KV.{s.REGISTRY_META}.>", f"$O.{s.REGISTRY_OBJECTS}.>", "telemetry.v1.>",
                  "tensorbus.v1.sched.>", "tensorbus.v1.worker.>", s.CANCEL)
    + OTHERS_STREAM_CHANGES,
    responses=Responses(1, "1m"),
    service="tensorbus-batch",
)

CLIENT = Role(
    "client", "CLIENTS",
    "an application. Requests the public API and reads its inbox; nothing else. "
    "Clients live in their own account (users.conf), so even their _INBOX.> is a "
    "different namespace from the services' inboxes.",
    publish=(("The public API, as TENSORBUS exports it.", PUBLIC),),
    subscribe=(("Replies.", (INBOX,)),),
)

ROLES = (GATEWAY, SCHEDULER, WORKER, TELEMETRY, BATCH, DEPLOY, CLIENT)
BY_NAME = {r.name: r for r in ROLES}

REFUSED = {
    "scheduler": ((f"$KV.{s.REGISTRY_META}.>",
                   "it imports the bundled models into the registry when they are missing; "
                   "under the secured roles the seed Job (deploy) does, and the scheduler "
                   "serves on"),),
    "telemetry": ((f"$JS.API.STREAM.INFO.{REGISTRY_KV}",
                   "no registry rights by decision (docs/security.md): it logs "
                   "registry_unavailable, no automatic canary rollback"),),
    "worker": ((f"$KV.{s.REGISTRY_META}.>", "compiled programs are published by deploy "
                "(docs/decisions/0070); the worker compiles and serves on"),
               (f"$O.{s.REGISTRY_OBJECTS}.>", "the same, for the programs' bytes")),
}
"""Publishes the code tries and the role is refused, on purpose: each path logs the
refusal and carries on. tests/security/test_secured_stack.py allows these and no
other permissions violation."""

PACKAGE_ROLE = {"gateway": GATEWAY, "scheduler": SCHEDULER, "worker": WORKER,
                "telemetry": TELEMETRY, "batch": BATCH}
"""The services/ package whose code each service role runs. The local orchestrator
(services/orchestrator) has no role: it runs on one machine, on the development bus
without authentication; Kubernetes scales with KEDA instead."""


HEADER = """\
# tensorbus: what each role may publish and subscribe to on the bus.
#
# GENERATED from shared/roles.py by `python -m shared.roles --write`: edit that
# module, not this file (tests/security/test_roles.py fails when they differ).
#
# Included by users.conf (passwords) and users-nkeys.conf (nkeys) so both grant
# exactly the same rights. Everything not allowed here is denied; the explicit
# `deny` lists repeat the denials that matter most, so that widening an allow
# list by mistake (say to `$JS.API.>`) still cannot hand a worker the registry.
#
# JetStream is driven by request/reply on API subjects; the answer comes back
# on the caller's _INBOX, so every JetStream user subscribes to _INBOX.>.
# What nats-py sends to read a bucket (bucket B of a key-value store is the stream
# KV_B, of an object store OBJ_B):
#
#   $JS.API.INFO                                 account info (js.account_info)
#   $JS.API.STREAM.INFO.<stream>                 js.key_value() / js.object_store() bind
#   $JS.API.STREAM.NAMES                         js.subscribe() without a stream name
#                                                (object get looks its stream up this way)
#   $JS.API.DIRECT.GET.<stream>[.<subject>]      kv.get, object info (allow_direct streams)
#   $JS.API.STREAM.MSG.GET.<stream>              the same on streams without direct get
#   $JS.API.CONSUMER.CREATE.<stream>[.>]         kv.watch, object get: ordered consumers
#                                                (nats-py creates them unnamed, 4 tokens)
#   $JS.API.CONSUMER.INFO.<stream>.>             kv.watch checks pending after creating
#   $JS.FC.<stream>.>                            flow-control replies of ordered consumers
#
# Writes: $KV.<bucket>.<key> (put, delete, purge), $O.<bucket>.{C,M}.> (object
# chunks and metadata), $JS.API.STREAM.{CREATE,UPDATE,DELETE,PURGE}.<stream>.
# Only deploy writes the registry; the gateway writes its own stored-responses
# bucket, the gateway and the batch runner the files and batches buckets, and
# telemetry its own stream, nothing else.
"""


def _quoted(items, indent: str) -> list[str]:
    return [f'{indent}"{x}",' for x in items]


def _wrap(text: str, prefix: str, width: int = 88, then: str | None = None) -> list[str]:
    """`text` in lines of at most `width`; the first starts with `prefix`, the rest
    with `then` (default: the same)."""
    lines, line = [], prefix
    for word in text.split():
        if len(line) + 1 + len(word) > width and line != prefix:
            lines.append(line)
            prefix = prefix if then is None else then
            line = prefix
        line = f"{line} {word}" if line != prefix else f"{prefix}{word}"
    return lines + [line]


def _groups(groups, indent: str) -> list[str]:
    out = []
    for why, subjs in groups:
        out += _wrap(why, f"{indent}# ")
        out += _quoted(subjs, indent)
    return out


def render_role(role: Role) -> list[str]:
    out = [""] + _wrap(f"{role.name}: {role.about}", "# --- ", 88, "# ")
    out += [f"{role.var} = {{", "  publish: {", "    allow: ["]
    out += _groups(role.publish, "      ") + ["    ]"]
    if role.deny_publish:
        out += ["    deny: ["] + _quoted(role.deny_publish, "      ") + ["    ]"]
    out += ["  }", "  subscribe: {", "    allow: ["]
    out += _groups(role.subscribe, "      ") + ["    ]", "  }"]
    if role.responses:
        r = role.responses
        out.append(f'  allow_responses: {{ max: {r.max}, expires: "{r.expires}" }}')
    return out + ["}"]


def render_exports() -> list[str]:
    out = ["", "# --- the public API, as TENSORBUS exports it and CLIENTS imports it.",
           "# `stream` responses: a streamed answer is many chunks and a final [DONE];",
           "# the threshold covers the longest generation.", "PUBLIC_EXPORTS = ["]
    for subj in PUBLIC:
        kind = 'stream, response_threshold: "10m"' if subj in STREAMED else "singleton"
        out.append(f'  {{ service: "{subj}", response_type: {kind} }}')
    out += ["]", "PUBLIC_IMPORTS = ["]
    out += [f'  {{ service: {{ account: TENSORBUS, subject: "{subj}" }} }}' for subj in PUBLIC]
    return out + ["]"]


def render() -> str:
    lines = HEADER.rstrip("\n").splitlines()
    for role in ROLES:
        lines += render_role(role)
    return "\n".join(lines + render_exports()) + "\n"


STREAMS = (REGISTRY_KV, REGISTRY_OBJ, RESPONSES_KV, BATCHES_KV, FILES_OBJ, s.TELEMETRY_STREAM)


def _streams(subjs: list[str]) -> str:
    """The JetStream side of a publish list, short: what the role does to each stream
    (info: bind or look up only; read; manage: create or update; write: put)."""
    kinds: dict[str, set[str]] = {}
    for x in subjs:
        t = x.split(".")
        if x.startswith(("$KV.", "$O.")):
            kinds.setdefault(("KV_" if t[0] == "$KV" else "OBJ_") + t[1], set()).add("write")
            continue
        stream = next((n for n in t if n in STREAMS), None)
        if stream is None:
            continue
        kind = "read"
        if t[2] == "STREAM" and t[3] in ("CREATE", "UPDATE", "*"):
            kind = "manage"
        elif t[2:4] == ["STREAM", "INFO"]:
            kind = "info"
        kinds.setdefault(stream, set()).add(kind)
    order = ("info", "read", "manage", "write")
    return ", ".join(
        f"`{n}` " + "+".join(k for k in order if k in v and not (k == "info" and len(v) > 1))
        for n, v in sorted(kinds.items())) or "none"


def table() -> str:
    """The roles table of docs/operations.md."""
    def cell(subjs):
        return ", ".join(f"`{x}`" for x in subjs if not x.startswith(("$JS.", "$KV.", "$O.")))

    rows = ["| role (account) | publishes | subscribes | JetStream streams |",
            "|---|---|---|---|"]
    for r in ROLES:
        pub = cell(r.allowed("publish"))
        if r.responses:
            many = "any number" if r.responses.max < 0 else "one"
            pub += f"; replies ({many} per request)"
        rows.append(f"| {r.name} ({r.account}) | {pub} | {cell(r.allowed('subscribe'))} "
                    f"| {_streams(r.allowed('publish'))} |")
    return "\n".join(rows) + "\n"


PERMISSIONS_CONF = Path("deploy") / "nats" / "permissions.conf"


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    path = root / PERMISSIONS_CONF
    if argv == ["--write"]:
        path.write_text(render())
        print(f"wrote {PERMISSIONS_CONF}")
        return 0
    if argv == ["--check"]:
        if path.read_text() == render():
            return 0
        print(f"{PERMISSIONS_CONF} differs from shared/roles.py: run "
              "`python -m shared.roles --write`", file=sys.stderr)
        return 1
    if not argv:
        sys.stdout.write(render())
        return 0
    if argv == ["--table"]:
        sys.stdout.write(table())
        return 0
    print("usage: python -m shared.roles [--write | --check | --table]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
