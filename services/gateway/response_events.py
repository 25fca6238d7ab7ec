"""The streamed events of one `POST /v1/responses` (services.gateway.responses), made
from the chat pipeline's chunks: created and in_progress, then per output item (a
message's text, a function call's arguments) added / its deltas / done, each item
opened when its first piece arrives and closed when another starts or the stream
ends; then completed (or incomplete, cut by length) with the whole response, or
failed after an error."""

from __future__ import annotations

import os

import msgspec

from shared.api_responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    FunctionCallItem,
    IncompleteDetails,
    ItemEvent,
    MessageItem,
    OutputText,
    PartEvent,
    Response,
    ResponseError,
    ResponseEvent,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from shared.errors import ServiceError


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"


def finished(base: Response, output: list, cut: bool, usage: ResponseUsage | None) -> Response:
    return msgspec.structs.replace(
        base, output=output, usage=usage, status="incomplete" if cut else "completed",
        incomplete_details=IncompleteDetails("max_output_tokens") if cut else None)


def response_usage(prompt: int, completion: int) -> ResponseUsage:
    return ResponseUsage(input_tokens=prompt, output_tokens=completion,
                         total_tokens=prompt + completion)


class Events:
    """The streamed events of one response, from the chat pipeline's chunks: each
    output item opened when its first piece arrives and closed when another starts
    or the stream ends; `sequence_number` counts from 0."""

    def __init__(self, base: Response) -> None:
        self.base = base
        self.seq = 0
        self.output: list = []
        self.message: MessageItem | None = None  # open
        self.text: list[str] = []
        self.call: FunctionCallItem | None = None  # open
        self.args: list[str] = []
        self.calls: dict[int, FunctionCallItem] = {}  # the chat stream's index -> item
        self.reason: str | None = None
        self.usage: ResponseUsage | None = None

    def _n(self) -> int:
        self.seq += 1
        return self.seq - 1

    def _response(self, kind: str, resp: Response) -> ResponseEvent:
        return ResponseEvent(type=f"response.{kind}", sequence_number=self._n(), response=resp)

    def start(self) -> list:
        return [self._response("created", self.base), self._response("in_progress", self.base)]

    def feed(self, chunk) -> list:
        """Events for one chat chunk (shared.api_replies.ChatCompletionChunk)."""
        out: list = []
        if chunk.usage is not None:
            self.usage = response_usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens or 0)
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                out += self._text(delta.content)
            for tc in delta.tool_calls or ():
                out += self._call(tc)
            if choice.finish_reason:
                self.reason = choice.finish_reason
        return out

    def _open_message(self) -> list:
        self.message = MessageItem(id=new_id("msg"), content=[], status="in_progress")
        self.text = []
        return [self._item("added", self.message), self._part("added", "")]

    def _text(self, piece: str) -> list:
        out = self._close_call()
        if self.message is None:
            out += self._open_message()
        self.text.append(piece)
        assert self.message is not None  # _open_message() opened it, if none was open
        out.append(TextDeltaEvent(type="response.output_text.delta", sequence_number=self._n(),
                                  item_id=self.message.id, output_index=len(self.output),
                                  content_index=0, delta=piece))
        return out

    def _call(self, tc) -> list:
        out: list = []
        fn = tc.function
        if tc.index not in self.calls:
            out += self._close_message() + self._close_call()
            self.call = FunctionCallItem(id=new_id("fc"), call_id=tc.id or new_id("call"),
                                         name=(fn.name if fn else None) or "", arguments="",
                                         status="in_progress")
            self.calls[tc.index] = self.call
            self.args = []
            out.append(self._item("added", self.call))
        piece = fn.arguments if fn is not None else None
        if piece and self.call is self.calls[tc.index]:
            self.args.append(piece)
            out.append(ArgumentsDeltaEvent(
                type="response.function_call_arguments.delta", sequence_number=self._n(),
                item_id=self.call.id, output_index=len(self.output), delta=piece))
        return out

    def _item(self, kind: str, item) -> ItemEvent:
        return ItemEvent(type=f"response.output_item.{kind}", sequence_number=self._n(),
                         output_index=len(self.output), item=item)

    def _part(self, kind: str, text: str) -> PartEvent:
        assert self.message is not None  # a part of the open message
        return PartEvent(type=f"response.content_part.{kind}", sequence_number=self._n(),
                         item_id=self.message.id, output_index=len(self.output),
                         content_index=0, part=OutputText(text=text))

    def _status(self) -> str:
        return "incomplete" if self.reason == "length" else "completed"

    def _close_message(self) -> list:
        if self.message is None:
            return []
        text = "".join(self.text)
        done = MessageItem(id=self.message.id, content=[OutputText(text=text)],
                           status=self._status())
        out = [TextDoneEvent(type="response.output_text.done", sequence_number=self._n(),
                             item_id=done.id, output_index=len(self.output), content_index=0,
                             text=text),
               self._part("done", text), self._item("done", done)]
        self.output.append(done)
        self.message = None
        return out

    def _close_call(self) -> list:
        if self.call is None:
            return []
        c = self.call
        done = FunctionCallItem(id=c.id, call_id=c.call_id, name=c.name,
                                arguments="".join(self.args), status=self._status())
        out = [ArgumentsDoneEvent(type="response.function_call_arguments.done",
                                  sequence_number=self._n(), item_id=done.id,
                                  output_index=len(self.output), arguments=done.arguments),
               self._item("done", done)]
        self.output.append(done)
        self.call = None
        return out

    def finish(self) -> list:
        """The open item closed (an empty message when nothing came), then
        `response.completed` (or `.incomplete`) with the whole response."""
        if not self.output and self.message is None and self.call is None:
            out = self._open_message()  # an empty message: added, its part, no delta
        else:
            out = []
        out += self._close_message() + self._close_call()
        cut = self.reason == "length"
        resp = finished(self.base, self.output, cut, self.usage)
        return out + [self._response("incomplete" if cut else "completed", resp)]

    def failed(self, err: ServiceError) -> ResponseEvent:
        resp = msgspec.structs.replace(self.base, output=self.output, status="failed",
                                       error=ResponseError(err.code, err.message))
        return self._response("failed", resp)
