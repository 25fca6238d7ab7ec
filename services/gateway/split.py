"""Embeddings requests larger than one bus message, answered whole.

A request of thousands of inputs can exceed the bus's `max_payload` twice over: its
token ids on the way to a worker, and its vectors (inputs x width x 4 bytes) on the
way back. The gateway cuts such a request into parts that each fit both ways
(`cuts`), under ids of their own (`<wire>-<i>`), and joins the answers in order:

  1. Parts go one after another. The first names the version that answered it and
     the others are pinned to it, so a promotion in between cannot mix two models'
     vectors in one answer.
  2. Each part is admitted by the schedulers as any request of its size (a
     reservation made for the whole body is handed back first). One at a time, a
     part never waits behind its own siblings, and a request of thousands of inputs
     does not fill a model's queue at once ahead of everyone else's: others' requests
     interleave with its parts. A part that fails fails the request.
  3. Usage is the sum of the parts'; the timing is the last part's, with the
     engine time of all of them.

Rerank and score requests are not cut (their answers are a few bytes an input).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from shared.messages import EmbedResult, EmbedWork

if TYPE_CHECKING:
    from services.gateway.call import Call
    from services.gateway.frontend import Frontend

HEADROOM = 0.75  # of max_payload a part may take each way (framing, headers, Results)
ID_BYTES = 5  # msgpack bytes of one token id, at most
INPUT_BYTES = 8  # a list's own framing
VECTOR_BYTES = 16  # an answer's framing per input


def cuts(inputs: list[list[int]], dim: int, max_payload: int) -> list[slice]:
    """Consecutive slices of `inputs` whose token ids and vectors (`dim` float32 each;
    0: unknown, then the ids alone decide) each fit in HEADROOM of `max_payload`.
    One input always makes a part, however large (the worker refuses what cannot go)."""
    budget = int(max_payload * HEADROOM)
    answer = dim * 4 + VECTOR_BYTES
    out, start, sent, back = [], 0, 0, 0
    for i, ids in enumerate(inputs):
        size = len(ids) * ID_BYTES + INPUT_BYTES
        if i > start and (sent + size > budget or back + answer > budget):
            out.append(slice(start, i))
            start, sent, back = i, 0, 0
        sent, back = sent + size, back + answer
    out.append(slice(start, len(inputs)))
    return out


async def computed_in_parts(front: Frontend, work: EmbedWork, parts: list[slice],
                            call: Call, computed) -> EmbedResult:
    """`work` answered as one EmbedResult, computed as `parts` (see the module's
    docstring); `computed(front, part, call)` runs one part."""
    if work.reserved:
        front.admission.unreserve(work.request_id)
    works = [msgspec.structs.replace(work, request_id=f"{work.request_id}-{i}",
                                     inputs=work.inputs[cut], reserved="")
             for i, cut in enumerate(parts)]
    call.parts = [w.request_id for w in works]
    results = [await computed(front, works[0], call)]
    for w in works[1:]:
        results.append(await computed(front, msgspec.structs.replace(
            w, version=results[0].version), call))
    timing = msgspec.structs.replace(results[-1].timing,
                                     compute=sum(r.timing.compute for r in results))
    return msgspec.structs.replace(
        results[0], vectors=b"".join(r.vectors for r in results), timing=timing,
        prompt_tokens=sum(r.prompt_tokens for r in results))
