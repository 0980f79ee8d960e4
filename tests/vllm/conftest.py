"""vLLM's environment, for the engine tests (their helpers: harness.py).

Without it (``make vllm-env``) the engine tests skip, unless ``MARSLM_REQUIRE_VLLM=1`` (CI),
where they fail.
"""

import os

import pytest

from marslm.errors import UserError
from marslm.vllm.launch import vllm_python


@pytest.fixture(scope="session")
def vllm_env():
    try:
        return vllm_python()
    except UserError as exc:
        if os.environ.get("MARSLM_REQUIRE_VLLM"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
