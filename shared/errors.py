"""The error contract: codes, types and the one exception services raise.

Every failure a client can see is a `ServiceError`. It becomes the reply headers
`Nats-Service-Error-Code` / `Nats-Service-Error` and the OpenAI-shaped body
`{"error": {"message", "type", "code"}}` (HTTP: the status code and the same body).
Messages are written for the caller: no paths, no stack traces, no internals.
"""

from __future__ import annotations

import msgspec

HEADER_CODE = "Nats-Service-Error-Code"
HEADER_MESSAGE = "Nats-Service-Error"
HEADER_RETRY_AFTER = "Retry-After"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "payload_too_large",
    431: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
    504: "deadline_exceeded",
}


class ServiceError(Exception):
    """A failure with an HTTP-like status code, safe to show to the caller."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or _TYPES.get(status, "error")
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "error")

    def to_body(self) -> "ErrorBody":
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type, code=self.code))

    def headers(self) -> dict[str, str]:
        h = {HEADER_CODE: str(self.status), HEADER_MESSAGE: self.message}
        if self.retry_after is not None:
            h[HEADER_RETRY_AFTER] = f"{self.retry_after:g}"
        return h

    def __repr__(self) -> str:
        return f"ServiceError({self.status}, {self.message!r})"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


def bad_request(message: str, code: str = "invalid_request_error") -> ServiceError:
    return ServiceError(400, message, code=code)


def not_found(message: str) -> ServiceError:
    return ServiceError(404, message, code="model_not_found")


def too_large(message: str) -> ServiceError:
    return ServiceError(413, message, code="payload_too_large")


def overloaded(message: str, retry_after: float = 1.0) -> ServiceError:
    return ServiceError(429, message, code="overloaded", retry_after=retry_after)


def unavailable(message: str, retry_after: float | None = 1.0) -> ServiceError:
    return ServiceError(503, message, code="no_worker", retry_after=retry_after)


def deadline_exceeded(message: str = "the request's deadline passed before it finished") -> ServiceError:
    return ServiceError(504, message, code="deadline_exceeded")


def out_of_time(why: str, stall_s: float = 0.0) -> ServiceError:
    """The 504 of a generation out of time: `why` is "deadline" (no first token by
    then), "stall" (no token for `stall_s`) or "max_time" (its end_by passed)."""
    if why == "stall":
        return deadline_exceeded(
            f"the generation stalled: no token for {stall_s:g} s (the stall timeout)")
    if why == "max_time":
        return deadline_exceeded("the request reached its maximum time (Tensorbus-Timeout, "
                                 "else TENSORBUS_MAX_GENERATION_S) before it finished")
    return deadline_exceeded()


def internal(message: str = "internal error; the request was not completed") -> ServiceError:
    return ServiceError(500, message, code="internal_error")
