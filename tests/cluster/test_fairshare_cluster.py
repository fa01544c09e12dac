"""Fair share on a real Valkey Cluster (16 cells over 3 primaries): the share is the deployment's,
not each cell's. Each cell counts its tenants; a submit is checked in its cell against the tenant's
share less what it holds in the other cells."""
from __future__ import annotations

import pytest

from omniflow.client.store import new_id
from omniflow.errors import FairShareRefused
from omniflow.models import Priority

from helpers import request


async def test_fair_share_holds_over_the_cells_not_per_cell(engine_factory) -> None:
    async with engine_factory(workers=False, max_in_flight=32, fair_share_from=0.0) as eng:
        store = eng.store
        assert store.keys.cells == 16
        await store.abort((await store.submit(request(), tenant="other")).id)     # two tenants share it
        await store.fair.refresh()
        assert store.fair.share("flood") == 16
        # two in one cell: more than a per-cell share (16 over 16 cells) would let it have there
        for _ in range(2):
            await store.submit(request(), tenant="flood", wf_id=new_id(0))
        for cell in range(1, 15):                   # and the rest of its share in other cells
            await store.submit(request(), tenant="flood", wf_id=new_id(cell))
        await store.fair.refresh()
        assert store.fair.live("flood") == 16
        # cell 15 holds nothing of it, but the tenant holds its share elsewhere
        with pytest.raises(FairShareRefused, match="it holds 16 live"):
            await store.submit(request(), tenant="flood", wf_id=new_id(15))
        await store.submit(request(), tenant="other", wf_id=new_id(15))
        # the classes' streams are per cell too: a batch workflow lands on its cell's batch stream
        sub = await store.submit(request(), tenant="other", wf_id=new_id(7), priority=Priority.BATCH)
        assert (await eng.redis.xinfo_stream(store.keys.tasks(eng.pipeline.queue("thinker"), 7, "batch")))["entries-added"] == 1
        assert (await store.document(sub.id))["priority"] == "batch"
