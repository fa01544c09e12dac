"""What every transition shares: the call it builds and the reply codes it maps.

A transition builds one `Call` (the raw FCALL command of one script: send it alone, in a
pipeline or through a `Batcher`), and decodes the script's reply into its enum (`code_of`);
a reply that is none of the declared codes is a `ScriptError` (a script and its caller disagree).
"""
from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

from omniflow.errors import ScriptError
from omniflow.storage.scripts import script_args
from omniflow.storage.schema import s

Call = tuple[Any, ...]
E = TypeVar("E", bound=Enum)

#: every script's return-code enum (None: the script answers data, not a code); what the
#: tests compare with each script's `Returns` header and its `return` statements
RETURN_CODES: dict[str, type[Enum] | None] = {}


def returns(script: str) -> Callable[[type[E]], type[E]]:
    """Class decorator: `cls` is the enum of `script`'s return codes."""

    def register(cls: type[E]) -> type[E]:
        RETURN_CODES[script] = cls
        return cls

    return register


def script_call(name: str, keys: list[str], args: list[Any]) -> Call:
    """The FCALL command of one registered script (KEYS built by the caller, from `Keys` only)."""
    return script_args(name, keys, args)


#: enum -> {the code as the server answers it (bytes): its member}: one dict lookup per reply (an Enum
#: call with a decode is several µs, and every script call's reply is decoded at least once)
_RAW_CODES: dict[type[Enum], dict[bytes, Enum]] = {}


def code_of(enum: type[E], reply: Any, script: str) -> E:
    """The code a script answered (`reply`, or its first element), as `enum`."""
    raw = reply[0] if isinstance(reply, list) and reply else reply
    if isinstance(raw, bytes):
        table = _RAW_CODES.get(enum)
        if table is None:
            table = _RAW_CODES[enum] = {str(m.value).encode(): m for m in enum}
        member = table.get(raw)
        if member is not None:
            return member      # type: ignore[return-value]
    try:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return enum(raw)
        return enum(s(raw))
    except ValueError:
        raise ScriptError(f"{script}.lua answered {reply!r:.200}, none of "
                          f"{[m.value for m in enum]}") from None
