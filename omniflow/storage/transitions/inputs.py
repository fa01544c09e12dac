"""A client's streamed input: `append_input.lua` (audio chunks appended to a running workflow)."""
from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

from omniflow.storage.keys import Keys
from omniflow.storage.schema import s
from omniflow.storage.transitions._base import Call, code_of, returns, script_call


@returns("append_input")
class AppendResult(str, Enum):
    """What `append_input.lua` answered."""

    OK = "ok"                  # appended: the input's last sequence number
    CLOSED = "closed"          # the input was ended already: nothing written
    ENDED = "ended"            # the workflow is terminal or gone: nothing written
    NO_INPUT = "no_input"      # the workflow takes no streamed input at this stage
    INBOX = "inbox"            # the stage is bound to a replica whose inbox was not declared: nothing written


def append_input(keys: Keys, wf_id: str, stage: str, *, final: bool, payloads: Sequence[bytes],
                 inboxes: Sequence[str] = ()) -> Call:
    """The `append_input.lua` call: `payloads` (codec-encoded chunks) onto `stage`'s `@input` edge,
    copied to the inbox of the replica bound to it when that replica is among `inboxes` (worker ids)."""
    cell = keys.cell_of(wf_id)
    return script_call("append_input", [keys.wf(wf_id), keys.stages_legacy(wf_id), keys.input_edge(wf_id, stage),
                                        *(keys.inbox(replica, cell) for replica in inboxes)],
                       [wf_id, stage, "1" if final else "0", *payloads])


def append_result(reply: Any) -> tuple[AppendResult, str]:
    """(code, its value: the last sequence number, the state, or the replica to declare)."""
    code = code_of(AppendResult, reply, "append_input")
    return code, s(reply[-1]) if len(reply) > 1 else ""
