"""Everything omniflow keeps in Redis, and the one way to reach it.

    client.py       RedisClient: the connection, every command, errors translated
    sync_client.py  SyncRedisClient: its synchronous twin (the synchronous client's submits)
    topology.py     which kind of server a URL names (single, cluster, sentinel), the redis-py client for it
    keys.py         every key name (cells)           schema.py   record / stage-hash fields, typed decoding
    transitions/    one typed function per Lua script (KEYS from Keys, ARGV, return codes as enums)
    lua/, scripts.py  the scripts and their registry
    batcher.py, mux.py, listing.py, entries.py, cells.py, usage.py

This package imports nothing of the engine, the client, the API or the operator tools
(`tests/test_structure.py`).
"""
