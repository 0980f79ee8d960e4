"""What the engine tests share: a decoding job run in vLLM's environment, and ``marslm serve
--engine vllm`` as a process."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 48  # each answer's budget


def run_job(vllm_env, job: dict, work: Path) -> dict:
    """``run_vllm.py`` over ``job`` in vLLM's environment: what each engine decoded."""
    (work / "job.json").write_text(json.dumps(job))
    run = subprocess.run(
        [str(vllm_env), str(HERE / "run_vllm.py"), str(work / "job.json"), str(work / "out.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((work / "out.json").read_text())


def answer(output: dict) -> list[int]:
    """vLLM's tokens without the stop token (marslm's and the HF oracle's convention)."""
    ids = output["token_ids"]
    return ids[:-1] if output["finish_reason"] == "stop" else ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_server(model: Path, log_dir: Path, *args: str, vllm_args=()):
    """`marslm serve --engine vllm` on ``model``: vLLM's engine core in its own process, the plugin
    loaded there through its entry point. Yields the server's URL once it answers."""
    import httpx

    port = _free_port()
    log = (log_dir / "log").open("w+")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1")
    command = [sys.executable, "-m", "marslm.cli", "serve", "--engine", "vllm", "--model", str(model), "--port"]
    proc = subprocess.Popen(
        [*command, str(port), *args, "--", *vllm_args, *os.environ.get("MARSLM_VLLM_EXTRA_ARGS", "").split()],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail("the vLLM server exited:\n" + log.read()[-4000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the vLLM server did not come up in 300 s"
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def marslm_oracle(checkpoint, prompt, first_token, settings):
    """marslm.generate on ``checkpoint`` (model, tokenizer) from the prompt and vLLM's prefill
    token: (tokens, forwards)."""
    from marslm import generate
    from marslm.decode import PAPER_RULE

    model, tokenizer = checkpoint
    out = generate(
        model,
        tokenizer,
        [prompt + [first_token]],
        tau=settings.get("tau", 0.95),
        metric=settings.get("metric", "prob"),
        mode=settings.get("mode", "threshold"),
        cache="none",
        use_last_mask=True,
        max_new_tokens=MAX_TOKENS - 1,
        **PAPER_RULE,  # the plugin reads every mask at every step
        apply_chat_template=False,
    )
    return [first_token] + out.token_ids[0], 1 + out.forwards[0]


def check_against_marslm(checkpoint, prompt, output, settings, greedy):
    """Same tokens as marslm's decoding, in the same forwards (lossless drafts the same way too)."""
    if not greedy:  # the first token already stops the answer
        assert answer(output) == []
        return
    expected, forwards = marslm_oracle(checkpoint, prompt, greedy[0], settings)
    assert answer(output) == expected
    assert output["forwards"] == forwards
