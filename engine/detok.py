"""Incremental detokenization with stop strings, one `Detokenizer` per sequence.

1. Text: each new token is decoded together with a few tokens before it (the
   tokenizer's own decoder, so byte-level BPE, sentencepiece `▁` spaces, byte-fallback
   `<0xE2>` pieces and leading-space stripping all behave as in a full decode), and
   only the difference from the previous decode is new text. While that text ends in
   U+FFFD, the last token(s) are part of a multi-byte character still arriving: it is
   held back until the character is whole.
2. Stop strings: new text joins a pending buffer. When a stop string appears (the one
   that completes first, if several do), the text before it is emitted (with the
   stop string at its end for `include_stop`, vLLM's include_stop_str_in_output),
   what follows it is not, and the sequence is `stopped`. Otherwise the longest
   suffix of the buffer that could still grow into a stop string is held back and
   the rest is emitted. With `min_tokens` (vLLM's), no stop string ends a sequence
   before it has more than that many tokens: a match must end in the text of a later
   token (it may begin earlier), as vLLM's stop checker searches only the text that
   is new once the count is reached.
3. `flush()` at the end returns whatever is still held (never after a stop).

Concatenating every `feed` and the `flush` gives exactly the full decode of the
tokens, cut before the stop string that completes first.
"""

from __future__ import annotations

from typing import Protocol, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # tokens decoded before the new ones: enough for any merge rule


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class StopMatcher:
    """Stop-string search over a stream of text pieces."""

    def __init__(self, stop: Sequence[str] = (), include: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include = include  # the matched stop string is emitted, at the end
        self.pending = ""
        self.guarded = 0  # pending's first chars no match may end in (min_tokens)
        self.matched: str | None = None

    def push(self, text: str, armed: bool = True) -> str:
        """Add text; return what is now safe to emit. Unless `armed`, no match may
        end in it: still held (min_tokens), its end may only begin a later match."""
        if self.matched is not None:
            return ""
        self.pending += text
        if not self.stop:
            out, self.pending = self.pending, ""
            return out
        if not armed:
            self.guarded = len(self.pending)
        # The stop that completes first wins: generation would have ended there. A
        # match ends past the guarded text (it may begin inside it).
        hits = [(i + len(s), i, s) for s in self.stop
                if (i := self.pending.find(s, max(0, self.guarded - len(s) + 1))) >= 0]
        if hits:
            _, at, stop = min(hits)
            end = at + len(stop) if self.include else at
            out, self.pending, self.matched = self.pending[:end], "", stop
            self.guarded = 0
            return out
        keep = self._held_suffix()
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.guarded = max(0, self.guarded - cut)
        return out

    def _held_suffix(self) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        self.guarded = 0
        return out


class Detokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tok = tokenizer
        self._min = min_tokens  # stop strings end no match in its first tokens' text
        self._skip = skip_special_tokens
        # The prompt's last tokens give the first generated token its left context
        # (a sentencepiece decoder drops the leading space of a sequence's first piece).
        self._ids: list[int] = list(prompt_ids)[-CONTEXT_TOKENS:]
        self._prefix = 0  # ids[prefix:read] decode to text already emitted (as context)
        self._read = len(self._ids)
        self._stops = StopMatcher(stop, include_stop)
        self.tokens = 0  # tokens fed

    @property
    def stopped(self) -> bool:
        return self._stops.matched is not None

    @property
    def matched_stop(self) -> str | None:
        return self._stops.matched

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _new_text(self) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(before) or full.endswith(REPLACEMENT):
            return ""  # nothing yet, or a character is still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(before) :]

    def feed(self, token_id: int) -> str:
        """Add one generated token; return newly safe text ("" after a stop)."""
        if self.stopped:
            return ""
        self.tokens += 1
        self._ids.append(int(token_id))
        return self._stops.push(self._new_text(), self.tokens > self._min)

    def flush(self) -> str:
        """End of sequence: everything still held, incomplete characters included."""
        if self.stopped:
            return ""
        tail = ""
        if self._read < len(self._ids):
            before = self._decode(self._ids[self._prefix : self._read])
            full = self._decode(self._ids[self._prefix :])
            tail = full[len(before) :]
            self._prefix = self._read = len(self._ids)
        return self._stops.push(tail, self.tokens > self._min) + self._stops.flush()
