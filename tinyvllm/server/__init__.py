"""OpenAI-compatible HTTP server: `python -m tinyvllm serve --model DIR`.

    protocol.py       request bodies -> (prompt, SamplingParams), with OpenAI-style validation
    responses.py      response / SSE chunk / error bodies
    engine_loop.py    the one thread that owns the engine and batches every request
    request_stream.py the handler's end of one request: its events, in order
    app.py            FastAPI app: OpenAI routes, API key, CORS, error handlers
    serving.py        submit prompt(s), then collect or stream (SSE) the answer
    utility.py        /ping, /version, /tokenize, /detokenize, /metrics
    metrics.py        the Prometheus metrics, folded from the engine's StepStats
    launch.py         build the engine + app and run uvicorn; Ctrl-C / SIGTERM shutdown
    serve_cli.py      the `serve` command's arguments -> ServeOptions

Needs the `server` extra: pip install 'tinyvllm[server]'."""
