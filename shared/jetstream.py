"""How many copies JetStream keeps of what tensorbus creates, and raising it in place.

The registry's buckets (KV `tensorbus_registry`, objects `tensorbus_models`) and the
TELEMETRY stream are created with `TENSORBUS_JS_REPLICAS` replicas; 0 (the default)
means 3 on a cluster of 3 or more servers, else 1. The cluster's size is what the
connected server tells every client: the client URLs of all members (`connect_urls`
in its INFO), and a server started with `no_advertise` (the NATS Helm chart's cluster
block) announces none: set TENSORBUS_JS_REPLICAS there. At start-up each service
checks the streams it binds (`check_replicas`) and warns when one has fewer replicas
than that. An existing deployment is raised with `tensorbus replicas [N]`
(`raise_replicas`), which updates each stream's config; JetStream then copies the
data to the new peers while the stream keeps serving.
"""

from __future__ import annotations

from nats.aio.client import Client

from shared import subjects
from shared.config import Config
from shared.logging import get_logger

log = get_logger("jetstream")

CLUSTER_REPLICAS = 3  # JetStream's usual quorum: survives one server lost

# What tensorbus creates: the registry's two buckets (their streams) and the record.
STREAMS = (f"KV_{subjects.REGISTRY_META}", f"OBJ_{subjects.REGISTRY_OBJECTS}",
           subjects.TELEMETRY_STREAM)


def cluster_size(nc: Client) -> int:
    """Servers in the cluster the connection is on, as its server last announced them
    (1 for a lone server, or one started with `--no_advertise`). A connection from
    shared.bus follows the announcements; another knows its handshake's only."""
    urls = getattr(nc, "cluster_urls", None)
    if not urls:
        info = getattr(nc, "_server_info", None) or {}  # nats-py keeps the first INFO here
        urls = info.get("connect_urls") or ()
    return max(1, len(set(urls)))


def replicas(nc: Client, setting: int | None = None) -> int:
    """Replicas for an asset created now: `setting` (default TENSORBUS_JS_REPLICAS)
    when positive, else 3 on a cluster of 3 or more servers, else 1."""
    setting = Config.from_env().js_replicas if setting is None else setting
    if setting > 0:
        return setting
    return CLUSTER_REPLICAS if cluster_size(nc) >= CLUSTER_REPLICAS else 1


async def raise_replicas(nc: Client, want: int) -> dict[str, str]:
    """Set every tensorbus stream that exists to `want` replicas; {stream: outcome}
    with outcome `unchanged`, `R<old> -> R<new>`, `missing` or the server's error."""
    from nats.js.errors import NotFoundError

    js = nc.jetstream()
    out: dict[str, str] = {}
    for name in STREAMS:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            out[name] = "missing"
            continue
        except Exception as exc:  # noqa: BLE001 - reported per stream (permissions)
            out[name] = f"error: {exc or type(exc).__name__}"
            continue
        have = info.config.num_replicas or 1
        if have == want:
            out[name] = "unchanged"
            continue
        try:
            await js.update_stream(info.config.evolve(num_replicas=want))
            out[name] = f"R{have} -> R{want}"
        except Exception as exc:  # noqa: BLE001 - reported per stream
            out[name] = f"error: {exc or type(exc).__name__}"
    return out


async def check_replicas(nc: Client, names: tuple[str, ...] = STREAMS,
                         setting: int | None = None) -> dict[str, int]:
    """Warn (`js_replicas_below_configured`) for each existing stream of `names` kept
    on fewer servers than `replicas(nc, setting)`: one created before the setting, or
    on a lone server, loses its data with that server. Returns {stream: replicas}
    of those; a missing stream, or one this role may not read, is skipped."""
    want = replicas(nc, setting)
    js = nc.jetstream()
    low: dict[str, int] = {}
    for name in names:
        try:
            info = await js.stream_info(name)
        except Exception:  # noqa: BLE001 - not created yet, or not this role's to read
            continue
        have = info.config.num_replicas or 1
        if have < want:
            low[name] = have
            log.warning("js_replicas_below_configured", stream=name, replicas=have,
                        configured=want, fix=f"tensorbus replicas {want}")
    return low
