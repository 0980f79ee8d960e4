"""What an exact-mode adapter proves before it is used (adapter.py's :func:`~marslm.adapter.load`):
its file parses, it holds the tensors its ``marslm.json`` entry calls for, of their shapes and with
finite values, and it belongs to the base weights it is loaded on.

A NaN anywhere in the adapter reaches clean positions too (attention multiplies a masked-out key's
value by 0, and 0 x NaN is NaN), so exact mode's promise holds only for finite weights; and an
adapter trained on other weights of the same shape would load without a word but for the
fingerprint training records (:func:`base_fingerprints`) and loading checks (:func:`check_base`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch import nn

from .errors import UserError
from .mars_json import AdapterSpec
from .unwrap import unwrap_model

log = logging.getLogger("marslm")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the adapter file ``path``, or one line naming it (missing, truncated, empty)."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type, OSError, ...
        reason = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0]
        raise UserError(f"{path} is not a readable adapter file ({reason}); restore it or retrain") from None


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], path) -> None:
    """``tensors`` (read from ``path``) are ``expected``'s, by name and shape, and hold only finite values."""
    for name in sorted(set(expected) | set(tensors)):
        if name not in tensors:
            raise UserError(f"{path} has no tensor {name}, which its marslm.json entry calls for")
        if name not in expected:
            raise UserError(f"{path} holds a tensor {name} that its marslm.json entry does not describe")
        if tuple(tensors[name].shape) != tuple(expected[name].shape):
            raise UserError(
                f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}; "
                f"its marslm.json entry calls for {tuple(expected[name].shape)}"
            )
        if not bool(torch.isfinite(tensors[name]).all()):
            raise UserError(f"{path}: tensor {name} holds NaN or infinite values; restore it or retrain")


# Elements of each fingerprinted weight read: enough that other weights of the same shape differ
# there, few enough that loading does not notice.
FINGERPRINT_SAMPLES = 4096
# The dtypes a checkpoint may be loaded in, each with its own digest: a value rounded to bfloat16
# from float32 is what loading in bfloat16 gives, but no rounding of the loaded value gets back
# to a digest taken in another dtype (rounding twice is not rounding once).
FINGERPRINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def base_fingerprints(model) -> dict[str, str]:
    """Digests of the weights an adapter belongs to, as loading in each of ``FINGERPRINT_DTYPES``
    will find them: recorded at training (:meth:`MaskAdapter.for_model`), checked at load."""
    samples = _fingerprint_samples(model)
    return {name: _digest(samples, name) for name in FINGERPRINT_DTYPES}


def base_fingerprint(model) -> tuple[str, str]:
    """``(dtype, digest)`` of ``model``'s weights as loaded (wider float dtypes read as float32)."""
    samples = _fingerprint_samples(model)
    name = str(samples[0][1].dtype).removeprefix("torch.")
    name = name if name in FINGERPRINT_DTYPES else "float32"
    return name, _digest(samples, name)


def _fingerprint_samples(model) -> list[tuple[tuple, torch.Tensor]]:
    """An even sample of the input embedding, the output layer (if it is its own matrix) and the
    first and last decoder Linear, each with its shape."""
    inner = unwrap_model(model)
    weights = [inner.get_input_embeddings().weight]
    head = inner.get_output_embeddings()
    if head is not None and head.weight.data_ptr() != weights[0].data_ptr():
        weights.append(head.weight)
    layers = inner.get_decoder().layers
    for layer, pick in ((layers[0], 0), (layers[-1], -1)):
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        weights += [linears[pick].weight] if linears else []
    samples = []
    for weight in weights:
        flat = weight.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES]
        samples.append((tuple(weight.shape), sample.to("cpu")))
    return samples


def _digest(samples, dtype: str) -> str:
    digest = hashlib.sha256()
    for shape, sample in samples:
        digest.update(repr(shape).encode())
        digest.update(sample.to(FINGERPRINT_DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()[:16]


def check_base(spec: AdapterSpec, model, directory) -> None:
    """The adapter was trained on ``model``'s weights: refused where its recorded fingerprint differs
    (another model of the same shape); a warning where none was recorded (an older checkpoint)."""
    dtype, found = base_fingerprint(model)
    recorded = (spec.base_fingerprint or {}).get(dtype)
    if recorded is None:
        log.warning(
            "%s: marslm.json records no fingerprint of the base weights in %s (an older checkpoint): its "
            "adapter is not checked against them",
            directory,
            dtype,
        )
    elif recorded != found:
        raise UserError(
            f"{directory}: the adapter was trained on other base weights (fingerprint {recorded} in marslm.json, "
            f"{found} in the model's weights, read in {dtype}); use the model it was trained on"
        )
