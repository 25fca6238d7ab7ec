"""A batch's input file, checked line by line before any of it runs.

Each non-blank line is a JSON object `{custom_id, method: "POST", url, body}` whose
`url` is the batch's own `endpoint` (one of BATCH_ENDPOINTS), as OpenAI requires: a
line on another endpoint fails the batch with OpenAI's `invalid_url` (param `url`);
custom_ids are unique; the file holds at most TENSORBUS_BATCH_MAX_LINES requests.
Every problem is named with its 1-based line (OpenAI's `errors.data[]`), at most
`MAX_ERRORS` of them.
"""

from __future__ import annotations

import msgspec

from shared.api_batches import BATCH_ENDPOINTS, BatchError, InputLine

MAX_ERRORS = 100
_decode = msgspec.json.Decoder(InputLine).decode


def parse(data: bytes, max_lines: int, endpoint: str) -> tuple[list[InputLine],
                                                              list[BatchError]]:
    """(the requests in input order, the problems) of a batch on `endpoint`; a batch
    runs only with no problem."""
    out: list[InputLine] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for n, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(errors) >= MAX_ERRORS:
            break
        try:
            line = _decode(raw)
        except msgspec.DecodeError as exc:
            errors.append(BatchError(code="invalid_json_line", line=n,
                                     message=f"not a valid request line: {exc}"))
            continue
        problem = _check(line, seen, endpoint)
        if problem:
            errors.append(BatchError(code=problem[0], line=n, message=problem[1],
                                     param=problem[2]))
            continue
        seen.add(line.custom_id)
        out.append(line)
    if not out and not errors:
        errors.append(BatchError(code="empty_file", message="the input file holds no request"))
    if len(out) > max_lines:
        errors.append(BatchError(code="too_many_requests",
                                 message=f"the input file holds {len(out)} requests; the "
                                 f"limit is {max_lines} (TENSORBUS_BATCH_MAX_LINES)"))
    return out, errors


def _check(line: InputLine, seen: set[str], endpoint: str) -> tuple[str, str, str] | None:
    if line.method != "POST":
        return "invalid_method", f"method is '{line.method}'; only POST is served", "method"
    if line.url not in BATCH_ENDPOINTS:
        return ("invalid_url", f"url is '{line.url}'; use one of {', '.join(BATCH_ENDPOINTS)}",
                "url")
    if line.url != endpoint:
        return ("invalid_url", f"url is '{line.url}', which does not match the batch's "
                f"endpoint '{endpoint}': every line of a batch goes to its endpoint", "url")
    if not line.custom_id:
        return "invalid_custom_id", "custom_id is empty", "custom_id"
    if line.custom_id in seen:
        return ("duplicate_custom_id", f"custom_id '{line.custom_id}' appears more than once",
                "custom_id")
    if not isinstance(line.body.get("model"), str):
        return "missing_required_parameter", "body.model is required", "body.model"
    if line.body.get("stream"):
        return "invalid_value", "body.stream: a batch's requests are answered whole", "body.stream"
    return None
