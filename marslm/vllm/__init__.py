"""MARS decoding inside vLLM, as an out-of-tree plugin (no fork of vLLM).

Install it into vLLM's own environment (``make vllm-env``) and serve a MARS checkpoint with
``marslm serve --engine vllm --model DIR``. The pieces:

    engine_args.py       the engine arguments that turn it on (LLM(...) and `vllm serve` alike)
    request_settings.py  per-request settings (tau, metric, mode), checked once, and PluginConfig:
                         the checkpoint's mask token and the server's defaults, as every process gets them
    proposer.py          drafts: masks, and in lossless mode the last step's mask predictions
    sampler.py           acceptance: vLLM's rejection sampler plus the MARS rule (decode/acceptance.py)
    scheduler.py         re-feeds accepted mask positions; counts forwards per request
    exact.py             an exact checkpoint: its adapter exported as a PEFT LoRA; where a step's masks are
    exact_runner.py      ... and in the runner: the LoRA mapped per token onto the masks, the mask rows
    plugin.py            the entry points vLLM loads in every process
    middleware.py        HTTP: tau/metric/mode as top-level request fields, tokens per forward in usage
    serve.py             `python -m marslm.vllm.serve`, run inside vLLM's environment
    launch.py            marslm's side: finding that environment and starting the server there

``marslm serve --engine vllm`` reaches launch.py through the engine registry
(``marslm/serve/engines.py``); the load test against vLLM is ``marslm/bench/vllm_loadtest.py``.

The plugin imports, of marslm, only modules that need no transformers (config, errors, the
request checks of decode/params.py and the pure-torch acceptance rule), so it runs with the
transformers release vLLM pins.
"""
