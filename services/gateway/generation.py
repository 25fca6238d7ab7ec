"""Text generation endpoints (completions, chat). Filled in with the decoder path."""

from __future__ import annotations

from shared.errors import ServiceError


class Generation:
    def __init__(self, front) -> None:
        self.front = front

    async def serve_nats(self, msg, endpoint, mp, rid, deadline, out) -> None:
        raise ServiceError(404, f"no text-generation model is served on '{endpoint}' yet",
                           code="model_not_found")
