"""The omniflow HTTP service (FastAPI), installed as `omniflow.api`.

    app.py        create_app / serve: lifespan (Redis, stream hub), middleware, routers
    deps.py       shared dependencies: principal (auth + tenant), store, hub, submit rate limit
    errors.py     omniflow errors -> JSON `{"error": {"message", "type", "code", "param"}}` (OpenAI's shape)
    schemas.py    response models (the OpenAPI document is built from them)
    hub.py        fan-out of workflow event logs to many waiters over one blocking XREAD
    limits.py     body-size middleware and the per-tenant submit token bucket
    audio.py      PCM <-> wav/flac/ogg/opus/mp3 files with soundfile (uploads decoded, limits)
    audio_stream.py  the same formats encoded as a response streams
    speech.py     a workflow's audio encoded as it is produced (`/v1/audio/speech`)
    knobs.py      OpenAI fields that tune a stage (speed, instructions, ...), honoured where declared
    metrics.py    Prometheus collector read from Redis at scrape time
    realtime/     the OpenAI Realtime protocol: events, session config, state machine, turns, transport
    routes/       one APIRouter per resource: workflows, openai (chat, models), audio (speech, voices),
                  realtime (the WebSocket), admin, health, ui
"""
