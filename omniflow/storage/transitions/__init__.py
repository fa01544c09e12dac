"""The transitions layer: one typed function per Lua script (`omniflow/storage/lua/`).

Each function builds the script's KEYS only from `Keys` (`omniflow.storage.keys`), packs its ARGV,
and returns the raw call (`Call`: send it alone, in a pipeline, or through a `Batcher`); its reply
decodes into the script's return-code enum (`RETURN_CODES`), and a code that means an error is
raised as one of `omniflow.errors`. Nothing outside this package builds a KEYS list, and no key
name is built outside `Keys`.

    admission      submit, abort
    sessions       claim, restart, heartbeat
    emit           emit, finish
    reconcile      stage_event, retry_due, dead_letter
    housekeeping   reap_consumer, lease (leader), purge
    listing        list_scan
    realtime       realtime_save
    inputs         append_input
"""
from __future__ import annotations

from omniflow.storage.transitions._base import RETURN_CODES, Call, code_of, script_call
from omniflow.storage.transitions.admission import AbortResult, SubmitResult
from omniflow.storage.transitions.emit import EmitResult, FinishResult
from omniflow.storage.transitions.inputs import AppendResult
from omniflow.storage.transitions.housekeeping import LeaseResult, PurgeResult, ReapResult
from omniflow.storage.transitions.listing import list_scan
from omniflow.storage.transitions.realtime import SaveResult
from omniflow.storage.transitions.reconcile import DeadLetterResult, EventResult, RetryResult
from omniflow.storage.transitions.sessions import ClaimResult, RestartResult

__all__ = ["RETURN_CODES", "AbortResult", "AppendResult", "Call", "ClaimResult", "DeadLetterResult", "EmitResult", "EventResult",
           "FinishResult", "LeaseResult", "PurgeResult", "ReapResult", "RestartResult", "RetryResult", "SaveResult",
           "SubmitResult", "code_of", "list_scan", "script_call"]
