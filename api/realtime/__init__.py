"""The OpenAI Realtime protocol over a WebSocket (`/v1/realtime`), each turn a workflow.

    events.py      client events parsed (every malformed one a `ProtocolError`), server events built
    config.py      the session's configuration: what `session.update` may set, checked against what
                   the pipeline can do, and the `session` object the server reports
    state.py       the session state machine (pure): conversation items, the input audio buffer, the
                   active response; client events in, effects out (send, submit a turn, cancel it)
    turn.py        one turn's server events, numbered: a workflow's log (text deltas, audio chunks,
                   its terminal) -> response.created ... deltas ... response.done (pure)
    connection.py  the transport: one WebSocket's loop, the effects run against the store and the
                   log hub, a turn followed (and resumed after a reconnect) from the workflow log

The route (`omniflow.api.routes.realtime`) authenticates the handshake and hands the socket here.
"""
