"""A batch input file's checks (services/batch/lines.py), line by line."""

from __future__ import annotations

import json

from services.batch.lines import MAX_ERRORS, parse

EMBED = "/v1/embeddings"


def line(cid: str, url: str = "/v1/embeddings", **kw) -> bytes:
    body = {"model": "all-MiniLM-L6-v2", "input": "x"} | kw
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}).encode()


def test_good_lines_in_order_blank_lines_skipped():
    data = b"\n".join([line("a"), b"", line("b"), line("c")]) + b"\n"
    lines, errors = parse(data, max_lines=10, endpoint=EMBED)
    assert not errors and [x.custom_id for x in lines] == ["a", "b", "c"]


def test_every_line_must_be_on_the_batch_endpoint():
    """OpenAI's rule: a line whose `url` is not the batch's `endpoint` fails the batch
    with `invalid_url` (param `url`) on that line, naming both."""
    data = b"\n".join([line("a"), line("b", "/v1/chat/completions"), line("c"),
                       line("d", "/v1/completions")])
    lines, errors = parse(data, max_lines=10, endpoint=EMBED)
    assert [(e.line, e.code, e.param) for e in errors] == [(2, "invalid_url", "url"),
                                                           (4, "invalid_url", "url")]
    assert "'/v1/chat/completions'" in errors[0].message and f"'{EMBED}'" in errors[0].message
    assert [x.custom_id for x in lines] == ["a", "c"]  # (the batch runs none of them)
    _, errors = parse(data, max_lines=10, endpoint="/v1/chat/completions")
    assert [e.line for e in errors] == [1, 3, 4]


def test_each_problem_is_named_by_its_line():
    data = b"\n".join([line("a"), b"{oops", line("a"), line("b", "/v1/responses"),
                       line("c", stream=True),
                       json.dumps({"custom_id": "d", "method": "GET", "url": "/v1/embeddings",
                                   "body": {"model": "m"}}).encode(),
                       json.dumps({"custom_id": "e", "method": "POST",
                                   "url": "/v1/embeddings", "body": {}}).encode()])
    _, errors = parse(data, max_lines=10, endpoint=EMBED)
    assert [(e.line, e.code) for e in errors] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_url"),
        (5, "invalid_value"), (6, "invalid_method"), (7, "missing_required_parameter")]


def test_limits():
    _, errors = parse(b"\n".join(line(str(i)) for i in range(3)), max_lines=2, endpoint=EMBED)
    assert [e.code for e in errors] == ["too_many_requests"]
    assert [e.code for e in parse(b"\n\n", max_lines=2, endpoint=EMBED)[1]] == ["empty_file"]
    _, errors = parse(b"\n".join(b"{" for _ in range(MAX_ERRORS + 5)), max_lines=10,
                      endpoint=EMBED)
    assert len(errors) == MAX_ERRORS
