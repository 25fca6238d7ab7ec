"""A stored response's input items (`GET /v1/responses/{id}/input_items`).

  1. When a response is made, its `input` becomes items with ids (`listed`): a
     string is one user message with an `input_text` part; each given item keeps
     the id it came with (a replayed output item has one) or gets a new one
     (`msg_`, `fc_`, `fco_`, `rs_`). A follow-up (`previous_response_id`) holds
     the earlier response's items and that response's output (`of_output`) first:
     the items a response lists are all those it was made from, oldest first, as
     the conversation reached the model (its `instructions` are not an item).
  2. They are kept with the response (shared.api_responses.Stored.items) in the
     response store (services.gateway.response_store).
  3. `page` answers a list request with OpenAI's cursor page: `limit` (1 to 100,
     default 20) items in `order` (`desc`, the default: newest first; or `asc`),
     those after the item `after` and before the item `before`; with `before`
     alone, the page is the `limit` items nearest it. A bad parameter, or a cursor
     that names no item of the response, is a 400 naming it.
"""

from __future__ import annotations

from typing import Mapping

from services.gateway.response_events import new_id
from shared.api_responses import (
    FunctionCallItem,
    InputItem,
    InputItemList,
    InputPart,
    ListedItem,
    ListedPart,
    MessageItem,
    OutputItem,
    ReasoningItem,
)
from shared.errors import bad_request

MAX_LIMIT = 100
DEFAULT_LIMIT = 20
PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
          "reasoning": "rs"}


# ------------------------------------------------------------------- keep
def listed(given: str | list[InputItem]) -> list[ListedItem]:
    """A request's `input` (already checked: services.gateway.responses) as items."""
    if isinstance(given, str):
        return [ListedItem(id=new_id("msg"), type="message", role="user", status="completed",
                           content=[ListedPart(type="input_text", text=given)])]
    out = []
    for item in given:
        rid = item.id or new_id(PREFIX.get(item.type, "item"))
        if item.type == "message":
            role = item.role or "user"
            out.append(ListedItem(id=rid, type="message", role=role, status="completed",
                                  content=_parts(item.content, role)))
        elif item.type == "function_call":
            out.append(ListedItem(id=rid, type="function_call", status="completed",
                                  call_id=item.call_id or "", name=item.name or "",
                                  arguments=item.arguments or ""))
        elif item.type == "function_call_output":
            output = item.output if isinstance(item.output, str) else _parts(item.output, "tool")
            out.append(ListedItem(id=rid, type="function_call_output", status="completed",
                                  call_id=item.call_id or "", output=output))
        else:  # reasoning (the only other type `input` takes)
            out.append(ListedItem(id=rid, type=item.type, summary=[],
                                  content=_parts(item.content, "reasoning")))
    return out


def of_output(output: list[OutputItem]) -> list[ListedItem]:
    """A response's output items, as the items of a follow-up's input."""
    out = []
    for item in output:
        if isinstance(item, MessageItem):
            out.append(ListedItem(id=item.id, type="message", role=item.role,
                                  status=item.status, content=[_output_text(p.text)
                                                               for p in item.content]))
        elif isinstance(item, FunctionCallItem):
            out.append(ListedItem(id=item.id, type="function_call", status=item.status,
                                  call_id=item.call_id, name=item.name,
                                  arguments=item.arguments))
        elif isinstance(item, ReasoningItem):
            out.append(ListedItem(id=item.id, type="reasoning", summary=list(item.summary),
                                  content=[ListedPart(type=p.type, text=p.text)
                                           for p in item.content]))
    return out


def _parts(content: str | list[InputPart] | None, role: str) -> list[ListedPart]:
    """A message's (or an output's) content as parts: an assistant's text is
    `output_text`, any other role's `input_text`; a given part keeps its type
    (chat's `text` named as the role's)."""
    own = "output_text" if role == "assistant" else "input_text"
    if content is None:
        return []
    if isinstance(content, str):
        return [_output_text(content) if own == "output_text" else ListedPart(type=own,
                                                                               text=content)]
    parts = []
    for p in content:
        kind = own if p.type == "text" else p.type
        parts.append(_output_text(p.text or "") if kind == "output_text"
                     else ListedPart(type=kind, text=p.text or ""))
    return parts


def _output_text(text: str) -> ListedPart:
    return ListedPart(type="output_text", text=text, annotations=[], logprobs=[])


# ------------------------------------------------------------------- list
def page(items: list[ListedItem], query: Mapping[str, str]) -> InputItemList:
    """One page of `items` (oldest first) as the list request's `query` asks (3.)."""
    raw = query.get("limit")
    try:
        limit = DEFAULT_LIMIT if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"'limit' is {raw!r}; it must be an integer from 1 to {MAX_LIMIT}")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"'order' is {order!r}; it must be 'asc' or 'desc'")
    seq = items if order == "asc" else items[::-1]
    ids = [i.id for i in seq]
    start, end = 0, len(seq)
    for name in ("after", "before"):
        cursor = query.get(name)
        if cursor is None:
            continue
        if cursor not in ids:
            raise bad_request(f"'{name}': the response has no input item with id {cursor!r}")
        if name == "after":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    window = seq[start:end] if start < end else []
    nearest_before = "before" in query and "after" not in query
    data = window[-limit:] if nearest_before else window[:limit]
    return InputItemList(data=data, first_id=data[0].id if data else None,
                         last_id=data[-1].id if data else None,
                         has_more=len(window) > limit)
