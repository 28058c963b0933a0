"""OpenAI-compatible HTTP server: `python -m tinyvllm serve --model DIR`.

    protocol.py     request bodies -> (prompt, SamplingParams), with OpenAI-style validation
    responses.py    response / SSE chunk / error bodies
    engine_loop.py  the one thread that owns the engine and batches every request
    app.py          FastAPI routes, API key, error handlers, streaming
    launch.py       build the engine + app and run uvicorn

Needs the `server` extra: pip install 'tinyvllm[server]'."""
