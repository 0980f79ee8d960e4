"""``marslm serve``: an OpenAI-compatible HTTP server over marslm's own continuous-batching engine
(``--engine vllm`` hands the same checkpoint to vLLM instead).

    config.py        ServeConfig: every knob of ``marslm serve``, checked once as it is made;
                     served_names: the names a server answers to, under either engine
    engine.py        the engine: request types, a bounded queue and one thread that admits, steps
                     a DecodeBatch and publishes tokens
    tau.py           TauController: the default tau, fixed or adaptive with load
    metrics.py       the engine's counters and histograms, and the Prometheus text of /metrics
    openai.py        the OpenAI API's objects: request fields, prompt ids, responses, stream
                     chunks, error objects
    app.py           the routes (FastAPI), the body's limits, one handler per error type
    http.py          serve(): the socket, uvicorn with a guarded h11 protocol, a draining shutdown
    vllm_launch.py   finds vLLM's environment and starts ``python -m marslm.vllm.serve`` there

A request's path: app.py reads the body, openai.py parses it into ``RequestOptions`` (requests.py) and token
ids, the engine checks them against the model and queues them, and app.py turns the engine's
tokens back into OpenAI objects (openai.py again), whole or as server-sent events.
"""
