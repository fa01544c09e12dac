"""Listing: `list_scan.lua` (which of some workflows' records match the filters no index serves)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omniflow.storage.keys import Keys
from omniflow.storage.transitions._base import RETURN_CODES, Call, script_call

RETURN_CODES["list_scan"] = None        # answers positions, not a code


def list_scan(keys: Keys, ids: Sequence[str], *, want: int, state: str, tenant: str | None, stage: str,
              request_id: str, since_ms: int | None = None) -> Call:
    """The `list_scan.lua` call checking the records of `ids` (of one cell, in index order) against
    the filters; its reply is decoded by `list_scan_result`."""
    return script_call("list_scan", [keys.wf(wf_id) for wf_id in ids], [
        want, state, "1" if tenant is not None else "0", tenant or "", stage, request_id,
        "" if since_ms is None else since_ms])


def list_scan_result(ids: Sequence[str], reply: Any) -> tuple[list[str], int]:
    """(the matching ids, how many records were read) of a `list_scan.lua` reply."""
    return [ids[int(i) - 1] for i in reply[1:]], int(reply[0])
