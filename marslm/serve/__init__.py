"""``marslm serve``: an OpenAI-compatible HTTP server over marslm's own continuous-batching engine
(``--engine vllm`` hands the same checkpoint to vLLM instead).

    config.py        ServeConfig: every knob of ``marslm serve``, checked once as it is made;
                     served_names: the names a server answers to, under either engine
    requests.py      what a request is: its settings (request_params), the limits they are checked
                     against, the engine's record of it, its stream, its result, its refusals
    engine.py        the engine: a bounded queue and one thread that admits, steps a decoder
                     and publishes tokens; the one place the default tau reaches a request
    drafting.py      a separate draft model (--draft-model): one request at a time, one drafted
                     step per engine turn, behind the batch's interface
    tau.py           TauController: the default tau, fixed or adaptive with load
    metrics.py       the engine's counters and histograms, and the Prometheus text of /metrics
    openai.py        the OpenAI API's objects: request fields, prompt ids, responses, stream
                     chunks, error objects
    app.py           the routes (FastAPI): parse, submit, answer whole or as server-sent events
    guard.py         the API key, the body's limits, one handler per error type, the outermost guard
    http.py          serve(): the socket, uvicorn with a guarded h11 protocol, a draining shutdown
    engines.py       the engines by name (marslm's, vLLM's): what each serves and supports, its
                     refusals, and where it serves and load-tests (vLLM's launch: vllm/launch.py)

A request's path: app.py reads the body (guard.py bounds it), openai.py parses it into a
``DecodingParams`` (``tau`` and ``max_new_tokens`` None where the request names none: the
server's defaults) and token ids, the engine checks them against the model and queues them, and
app.py turns the engine's tokens back into OpenAI objects (openai.py again), whole or as
server-sent events.
"""
