"""`omniflow tenants ls` / `omniflow tenants weight TENANT W|--reset`: per-tenant fair-share weights,
changed live (held in Redis over `OMNIFLOW_TENANT_WEIGHTS`; every process follows within a refresh).
Thin parsing over `omniflow.storage.fairshare`; a weight out of range or a bad name exits 2."""
from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from omniflow.cli.common import JsonOpt, _print_json, _run, _with_client, console, handle_errors
from omniflow.errors import InvalidRequest

tenants_app = typer.Typer(help="Per-tenant fair share: weights (set live) and what each tenant holds.",
                          no_args_is_help=True)


def tenants_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="tenants", caption="share: the live workflows a tenant may hold once the deployment is busy")
    for col in ("tenant", "weight", "from", "live", "share"):
        table.add_column(col, justify="left" if col in ("tenant", "from") else "right")
    for r in rows:
        table.add_row(r["tenant"], f"{r['weight']:g}", r["source"], str(r["live"]), str(r["share"]))
    return table


@tenants_app.command("ls")
@handle_errors
def tenants_ls(as_json: bool = JsonOpt) -> None:
    """Every tenant with a weight or live workflows: weight (live, config or default), live, share."""
    from omniflow.storage.fairshare import weights_table

    rows = _run(_with_client, lambda client: weights_table(client.store.client, client.settings, client.store.keys))
    _print_json(rows) if as_json else console.print(tenants_table(rows))


@tenants_app.command("weight")
@handle_errors
def tenants_weight(tenant: str = typer.Argument(..., help="the tenant (as OMNIFLOW_API_KEYS names it)"),
                   weight: str = typer.Argument(None, help="0.01 to 1000 (1 is everyone's default)"),
                   reset: bool = typer.Option(False, "--reset", help="back to the configured weight"),
                   as_json: bool = JsonOpt) -> None:
    """Set a tenant's fair-share weight live (or --reset it to the configured one)."""
    from omniflow.fairness import check_tenant, check_weight
    from omniflow.storage.fairshare import set_weight, weights_table

    if reset == (weight is not None):
        raise InvalidRequest("give a WEIGHT or --reset (one of them)")
    try:
        check_tenant(tenant)
        value = None if reset else check_weight(_number(weight))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None

    async def go(client: Any) -> dict[str, Any]:
        await set_weight(client.store.client, client.store.keys, tenant, value)
        rows = await weights_table(client.store.client, client.settings, client.store.keys)
        return next((r for r in rows if r["tenant"] == tenant),
                    {"tenant": tenant, "weight": 1.0, "source": "default", "live": 0, "share": 0})

    row = _run(_with_client, go)
    if as_json:
        _print_json(row)
    else:
        console.print(f"tenant {tenant}: weight {row['weight']:g} ({row['source']})")


def _number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"weight {raw!r} is not a number") from None


def register(app: typer.Typer) -> None:
    app.add_typer(tenants_app, name="tenants")
