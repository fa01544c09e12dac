"""Who goes first under load: priority classes and per-tenant fair share, as pure functions.

- **Priority classes** (`omniflow.models.Priority`): interactive > api > batch. Stage intake picks the
  next session to start by *smooth weighted round robin* over the classes that have one waiting
  (`OMNIFLOW_PRIORITY_WEIGHTS`, default interactive=16, api=4, batch=1): a higher class gets most
  starts, a lower one is bounded below by its weight's share, so none starves. Admission keeps
  headroom for the higher classes (a class may fill only its share of `max_in_flight`).
- **Fair share per tenant**: tenant `t` with weight `w_t` may hold `max_in_flight * w_t / W` live
  workflows once the deployment is busy, `W` the weights of the tenants that hold any (and `t`).
  Under that line everyone is admitted (work-conserving); over it a tenant over its share gets 429.
  Within a class, intake also takes tenants in weighted round robin.

Nothing here does I/O; `omniflow.storage.fairshare` holds the weights and counts in Redis,
`omniflow.engine.worker.slots` applies the order to a worker's session slots.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Generic, TypeVar

from omniflow.models import PRIORITY_ORDER, Priority

MIN_WEIGHT = 0.01
MAX_WEIGHT = 1000.0
DEFAULT_WEIGHT = 1.0
DEFAULT_PRIORITY_WEIGHTS = "interactive=16,api=4,batch=1"
MAX_TENANT_CHARS = 128

K = TypeVar("K", bound=Hashable)


def check_weight(value: float, *, what: str = "weight") -> float:
    """A weight in [MIN_WEIGHT, MAX_WEIGHT]; ValueError saying the range otherwise."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) \
            or not MIN_WEIGHT <= value <= MAX_WEIGHT:
        raise ValueError(f"{what} {value!r} is out of range: a weight is a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}")
    return float(value)


def check_tenant(name: str) -> str:
    """A tenant name as weights and allowances use it (not empty, no ',' '=' ':' or spaces)."""
    if not name or len(name) > MAX_TENANT_CHARS or any(c in name for c in ",=: \t\n"):
        raise ValueError(f"bad tenant name {name!r}: 1 to {MAX_TENANT_CHARS} characters, none of ',=:' or spaces")
    return name


def parse_pairs(raw: str, *, what: str) -> dict[str, str]:
    """'a=1,b=2' (or 'a:1,b:2') -> {'a': '1', 'b': '2'}; ValueError naming the bad item."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        sep = "=" if "=" in item else ":"
        name, found, value = item.partition(sep)
        if not found or not name.strip() or not value.strip():
            raise ValueError(f"{what}: {item!r} is not NAME=VALUE")
        if name.strip() in out:
            raise ValueError(f"{what}: {name.strip()!r} is given twice")
        out[name.strip()] = value.strip()
    return out


def parse_weights(raw: str, *, what: str = "tenant weights") -> dict[str, float]:
    """'acme=2,free=0.5' -> {'acme': 2.0, 'free': 0.5}, every weight checked."""
    out: dict[str, float] = {}
    for name, value in parse_pairs(raw, what=what).items():
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{what}: {name}={value!r} is not a number") from None
        out[check_tenant(name)] = check_weight(number, what=f"{what}: {name}")
    return out


def parse_priority_weights(raw: str) -> dict[Priority, float]:
    """'interactive=16,api=4,batch=1' -> weight per class; every class must be given, higher classes
    may not weigh less than lower ones (that would invert the order)."""
    given = parse_weights(raw, what="priority weights")
    out: dict[Priority, float] = {}
    for name, weight in given.items():
        try:
            out[Priority.parse(name)] = weight
        except ValueError as exc:
            raise ValueError(f"priority weights: {exc}") from None
    missing = [p.value for p in PRIORITY_ORDER if p not in out]
    if missing:
        raise ValueError(f"priority weights: no weight for {missing}")
    for high, low in itertools.pairwise(PRIORITY_ORDER):
        if out[high] < out[low]:
            raise ValueError(f"priority weights: {high.value} ({out[high]:g}) weighs less than {low.value} ({out[low]:g})")
    return out


def parse_allowances(raw: str) -> dict[str, Priority]:
    """'acme=interactive,free=batch' -> the highest class each tenant may ask for."""
    out: dict[str, Priority] = {}
    for name, value in parse_pairs(raw, what="tenant priorities").items():
        try:
            out[check_tenant(name)] = Priority.parse(value)
        except ValueError as exc:
            raise ValueError(f"tenant priorities: {name}: {exc}") from None
    return out


def allowed(asked: Priority, allowance: Priority) -> bool:
    """Whether a tenant allowed up to `allowance` may ask for `asked`."""
    return asked.rank >= allowance.rank


def cap(asked: Priority, allowance: Priority) -> Priority:
    """`asked`, lowered to the tenant's allowance (a default class, never one the caller named)."""
    return asked if allowed(asked, allowance) else allowance


def tenant_share(max_in_flight: int, tenant: str, weights: Mapping[str, float], active: Iterable[str],
                 *, default_weight: float = DEFAULT_WEIGHT) -> int:
    """The live workflows `tenant` may hold once the deployment is busy: its weight's part of
    `max_in_flight` among the tenants holding any (and itself); at least 1."""
    def weight(t: str) -> float:
        return weights.get(t, default_weight)

    present = set(active) | {tenant}
    total = sum(weight(t) for t in present)
    return max(1, math.floor(max_in_flight * weight(tenant) / total))


class WeightedPicker(Generic[K]):
    """Smooth weighted round robin (nginx's): among the keys that have work, each pick adds every
    key's weight to its credit and takes the key with the most, which then pays the total. Over any
    run of picks with the same keys waiting, a key's share of picks is its weight's share, within one
    pick; a key that stops waiting keeps no credit."""

    def __init__(self, weight_of: Mapping[K, float] | None = None, *, default: float = DEFAULT_WEIGHT) -> None:
        self.weight_of = weight_of if weight_of is not None else {}
        self.default = default
        self.credit: dict[K, float] = {}

    def pick(self, waiting: Iterable[K]) -> K:
        keys = list(waiting)
        if not keys:
            raise ValueError("nothing to pick from")
        if len(keys) == 1:
            self.credit = {keys[0]: 0.0}
            return keys[0]
        total = 0.0
        credit = {k: self.credit.get(k, 0.0) for k in keys}
        best = keys[0]
        for k in keys:
            w = self.weight_of.get(k, self.default)
            credit[k] += w
            total += w
            if credit[k] > credit[best]:
                best = k
        credit[best] -= total
        self.credit = credit
        return best
