"""Stored responses (`/v1/responses` with `store`, the default): a JetStream KV bucket.

Bucket `tensorbus_responses` (shared.subjects.RESPONSES_BUCKET), created by the
first gateway that stores or reads one, with a time to live of 24 hours
(`TTL_S`): a response, and the conversation it continues, can be fetched
(`GET /v1/responses/{id}`) or continued (`previous_response_id`) for a day after it
was made, from any gateway. Values are msgspec JSON (shared.api_responses.Stored),
one key per response id, one revision kept; nothing here unpickles.
"""

from __future__ import annotations

import asyncio
import re

import msgspec

from shared import subjects
from shared.api_responses import Stored
from shared.errors import ServiceError
from shared.jetstream import replicas
from shared.logging import get_logger

log = get_logger("gateway.responses")

TTL_S = 24 * 3600.0
_KEY = re.compile(r"^resp_[A-Za-z0-9_-]{1,200}$")
_decode = msgspec.json.Decoder(Stored).decode
_encode = msgspec.json.Encoder().encode


class ResponseStore:
    def __init__(self, nc) -> None:
        self.nc = nc
        self._kv = None
        self._lock = asyncio.Lock()

    async def _bucket(self):
        """The bucket, bound (or created: safe to race) once."""
        if self._kv is not None:
            return self._kv
        from nats.js.errors import BucketNotFoundError

        async with self._lock:
            if self._kv is None:
                js = self.nc.jetstream()
                try:
                    self._kv = await js.key_value(subjects.RESPONSES_BUCKET)
                except BucketNotFoundError:
                    self._kv = await js.create_key_value(
                        bucket=subjects.RESPONSES_BUCKET, history=1, ttl=TTL_S,
                        description="tensorbus stored responses (/v1/responses)",
                        replicas=replicas(self.nc))
        return self._kv

    async def put(self, stored: Stored) -> bool:
        """Keep `stored`; False (logged) when the bus refuses it (a value past its
        max_payload, or JetStream unavailable): the response is answered anyway."""
        try:
            await (await self._bucket()).put(stored.response.id, _encode(stored))
            return True
        except Exception as exc:  # noqa: BLE001 - the answer must not fail for it
            log.warning("response_not_stored", response_id=stored.response.id,
                        error=str(exc) or type(exc).__name__)
            return False

    async def get(self, rid: str) -> Stored | None:
        """The stored response `rid`, or None: unknown, deleted or expired."""
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        if not _KEY.match(rid):
            return None
        try:
            entry = await (await self._bucket()).get(rid)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        except Exception as exc:  # noqa: BLE001 - JetStream down, or not allowed to this user
            log.warning("response_store_unavailable", error=str(exc) or type(exc).__name__)
            raise ServiceError(503, "the response store (JetStream KV bucket "
                               f"'{subjects.RESPONSES_BUCKET}') is unavailable",
                               code="store_unavailable") from None
        return _decode(entry.value) if entry.value else None

    async def delete(self, rid: str) -> bool:
        """Forget `rid`; False when it is not stored."""
        if await self.get(rid) is None:
            return False
        await (await self._bucket()).purge(rid)
        return True


def not_found(rid: str) -> ServiceError:
    return ServiceError(404, f"no stored response has id '{rid}' (unknown, deleted, not "
                        f"stored, or past its {int(TTL_S // 3600)} hours)", code="not_found")
