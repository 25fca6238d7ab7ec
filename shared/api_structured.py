"""`structured_bounds`: a request's say over the default bounds a JSON-schema
structured output's values get (services/gateway/structured_bounds.py applies them;
docs/protocol.md, Structured outputs, lists the defaults).

A field left out keeps its default; a field set to null turns that one bound off. The
whole setting as null (or false) turns every default off; true is the defaults.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

# Past these the grammar grows (or llguidance refuses it: a `multipleOf` finer than
# 1e-10, a range past 64-bit integers) faster than any reply needs.
MAX_NUMBER_DIGITS = 18
MAX_FRACTION_DIGITS = 10
MAX_STRING_LENGTH = 65_536
MAX_ARRAY_ITEMS = 65_536


class StructuredBounds(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True,
                       kw_only=True):
    """The bounds a schema's unbounded values get, where the schema sets none."""

    # digits of an integer, and of a number before its point
    number_digits: Annotated[int, Meta(ge=1, le=MAX_NUMBER_DIGITS)] | None | UnsetType = UNSET
    # digits of a number after its point (0: a number is written as an integer)
    fraction_digits: Annotated[int, Meta(ge=0, le=MAX_FRACTION_DIGITS)] | None | UnsetType = UNSET
    string_length: Annotated[int, Meta(ge=1, le=MAX_STRING_LENGTH)] | None | UnsetType = UNSET
    array_items: Annotated[int, Meta(ge=1, le=MAX_ARRAY_ITEMS)] | None | UnsetType = UNSET
    # an object with `properties` and no `additionalProperties` of its own: true, it
    # may hold other keys as JSON Schema reads it; false (the default), only those
    additional_properties: bool | UnsetType = UNSET
    # compact: no whitespace between JSON tokens; flexible: up to 16 characters of it
    whitespace: Literal["compact", "flexible"] | UnsetType = UNSET
