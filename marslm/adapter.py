"""Exact MARS: parameters that act only where the decoder put a mask.

MARS's attention rule never lets a clean position attend to a mask position (masks.py). So a
change that acts only at mask positions cannot change any clean position's output: the model's
next-token path stays the original, bit for bit, whatever the change learns. This module is that
change, for a frozen model:

- ``rows``: the mask's input embedding, one row per offset inside a block (the i-th mask of a
  block reads row i) or one shared row;
- a LoRA of rank r on every Linear of the decoder layers, added to the Linear's output only at
  mask positions (a gate per position, Apple's "Your LLM Knows the Future", arXiv 2507.11851).

No model code is touched. Hooks do the work, for the forwards inside :meth:`MaskAdapter.gate`
(or :func:`placed_masks`), which names the mask positions: the decoding step and the objective
know them, having put the masks there. A pre-hook on the model reads them, the embedding's hooks
put the mask rows there, and each gated Linear's hook adds its low-rank update there alone. A
decoding step puts the masks last in every row and says so with :meth:`MaskAdapter.tail_gate`:
the hooks then slice instead of searching, so that the step has no data-dependent operation and
compiles as one graph (decode/forward.py). An input id is never taken for a mask: a forward
outside a gate (HF ``generate``, a clean stream, a prompt that holds the mask id) runs exactly as
the original does.

The mask token needs no row of the original embedding: by default its id is one past the last
row, an id no tokenizer produces and no output layer predicts, so the base checkpoint's files,
tokenizer included, stay the original's. ``AdapterSpec`` is saved in ``marslm.json`` and the
weights in ``mars_adapter.safetensors`` beside them (:func:`save` / :func:`load`).
"""

from __future__ import annotations

import math
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .adapter_proof import base_fingerprints, check_base, check_tensors, read_tensors
from .errors import UserError
from .mars_json import ADAPTER_FILENAME, AdapterSpec
from .unwrap import unwrap_model

FILENAME = ADAPTER_FILENAME
# Where the adapter lives on the model it is attached to: a submodule, so that the optimizer, the
# Trainer's checkpoints, ``.to(device)`` and ``.to(dtype)`` all see its parameters.
ATTRIBUTE = "mars_adapter"


def linear_targets(model, modules: list[str] | None = None) -> tuple[str, ...]:
    """Every Linear inside the decoder layers, by name, or those whose own name (the last part) is
    one of ``modules``. The output projection is never one of them: the fused loss runs it outside
    the model's forward."""
    layers = unwrap_model(model).get_decoder().layers
    prefix = _name_of(model, layers)
    names = [name for name, module in layers.named_modules() if isinstance(module, nn.Linear) and name]
    if modules is not None:
        check_linear_names(modules, {name.rsplit(".", 1)[-1] for name in names})
        names = [name for name in names if name.rsplit(".", 1)[-1] in modules]
    return tuple(f"{prefix}.{name}" for name in names)


def check_linear_names(modules: list[str], present: set[str]) -> None:
    """Refuse, in one line, a LoRA module name that no decoder Linear of the model has."""
    unknown = [name for name in modules if name not in present]
    if unknown:
        raise UserError(
            f"lora modules: this model's decoder layers have no Linear called {unknown[0]!r} "
            f"(they have {', '.join(sorted(present))})"
        )


def _name_of(model, target: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is target)


class _LoRA(nn.Module):
    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, in_features))
        self.b = nn.Parameter(torch.zeros(out_features, rank))  # starts as no change at all
        nn.init.kaiming_uniform_(self.a, a=math.sqrt(5))
        self._factors = None  # (versions, a^T, scale * b^T) for inference

    def factors(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``a^T`` and ``scale * b^T``, contiguous, in the weights' dtype: decoding reads every
        factor once per forward, so their bytes count, and the scale folds in once. Rebuilt
        whenever the weights change in place (an optimizer step bumps their versions)."""
        versions = (self.a._version, self.b._version, self.a.data_ptr(), self.b.data_ptr())
        if self._factors is None or self._factors[0] != versions:
            with torch.no_grad():
                a_t = self.a.detach().t().contiguous()
                b_t = (self.b.detach() * scale).t().contiguous()
            self._factors = (versions, a_t, b_t)
        return self._factors[1], self._factors[2]


class MaskAdapter(nn.Module):
    """Mask rows and gated LoRA weights; :meth:`attach` hooks them into a model."""

    def __init__(self, spec: AdapterSpec, shapes: dict[str, tuple[int, int]] | None = None):
        super().__init__()
        self.spec = spec
        self.rows = nn.Parameter(torch.zeros(spec.rows, spec.hidden_size))
        shapes = shapes or {}
        self.lora = nn.ModuleList(
            _LoRA(*shapes.get(name, (1, 1)), spec.rank) for name in (spec.targets if spec.rank else ())
        )
        self._handles: list = []
        self._gate = None  # (flat indices of the mask positions, their offsets) during one forward
        self._placed = None  # (where the masks are, their offsets or None), set by gate()

    @classmethod
    def for_model(
        cls, model, mask_token_id: int, rank: int, rows: int, alpha: float | None = None, modules=None
    ) -> MaskAdapter:
        """A fresh adapter for ``model``: LoRA factors ``b`` at zero (no change yet) on the decoder
        Linears named in ``modules`` (all by default), mask rows at the mask token's embedding where
        the model has one, else the mean embedding."""
        inner = unwrap_model(model)
        embedding = inner.get_input_embeddings().weight
        targets = linear_targets(inner, modules) if rank else ()
        modules = dict(inner.named_modules())
        shapes = {name: (modules[name].in_features, modules[name].out_features) for name in targets}
        spec = AdapterSpec(
            mask_token_id, embedding.shape[1], rows, rank, float(alpha or rank or 1), targets, base_fingerprints(inner)
        )
        adapter = cls(spec, shapes)
        with torch.no_grad():
            start = embedding[mask_token_id] if mask_token_id < len(embedding) else embedding.mean(dim=0)
            adapter.rows.copy_(start.float().expand_as(adapter.rows))
        return adapter.to(device=embedding.device)

    # --- hooks -----------------------------------------------------------------------------------

    def attach(self, model) -> None:
        """Hook the adapter into ``model`` and register it as its ``mars_adapter`` submodule."""
        inner = unwrap_model(model)
        if getattr(inner, ATTRIBUTE, None) is not None:
            raise UserError("the model already has a MARS adapter attached")
        modules = dict(inner.named_modules())
        missing = [name for name in self.spec.targets if name not in modules]
        if missing:
            raise UserError(f"the adapter gates {missing[0]}, which this model does not have")
        setattr(inner, ATTRIBUTE, self)
        embedding = inner.get_input_embeddings()
        decoder = inner.get_decoder()  # every path to the layers goes through it, with the input ids
        self._handles = [
            decoder.register_forward_pre_hook(self._find_masks, with_kwargs=True),
            decoder.register_forward_hook(self._forget_masks),
            embedding.register_forward_pre_hook(self._valid_ids),
            embedding.register_forward_hook(self._put_rows),
        ]
        for i, (name, lora) in enumerate(zip(self.spec.targets if self.spec.rank else (), self.lora)):
            self._handles.append(modules[name].register_forward_hook(self._gated_update(i, lora)))

    def detach(self, model) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        inner = unwrap_model(model)
        if getattr(inner, ATTRIBUTE, None) is self:
            delattr(inner, ATTRIBUTE)

    @contextmanager
    def gate(self, is_mask: torch.Tensor, offsets: torch.Tensor | None = None):
        """Within the block, the next forwards have masks where ``is_mask`` (``[rows, columns]``,
        like the input ids) is True: where the decoder, or the objective, put them. Nowhere else
        does the adapter act, whatever an input id is. ``offsets`` (the same shape): each mask's
        offset inside its block, where it is not read off the attention mask."""
        self._placed = (is_mask, offsets)
        try:
            yield
        finally:
            self._placed = None

    @contextmanager
    def tail_gate(self, offsets: torch.Tensor):
        """Within the block, the next forwards' masks are every row's last ``len(offsets)`` columns,
        the i-th at offset ``offsets[i]``: a decoding step's layout, known on the host before the
        forward. Nothing is then read off the forward's data (no search for the masks, no
        transfer), so a compiled step traces through the adapter as straight-line code."""
        factors = tuple(lora.factors(self.scale) for lora in self.lora)
        self._placed = _Gate(None, None, offsets.clamp(0, self.spec.rows - 1), len(offsets), factors)
        try:
            yield
        finally:
            self._placed = None

    @property
    def scale(self) -> float:
        """The LoRA update's scale, alpha / rank (no LoRA: 0)."""
        return self.spec.alpha / self.spec.rank if self.spec.rank else 0.0

    def _find_masks(self, module, args, kwargs):
        if isinstance(self._placed, _Gate):
            self._gate = self._placed
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if self._placed is None or input_ids is None:
            self._gate = None
            return None
        is_mask, offsets = self._placed
        if tuple(is_mask.shape) != tuple(input_ids.shape):
            raise UserError(f"masks placed over {tuple(is_mask.shape)} columns for {tuple(input_ids.shape)} input ids")
        is_mask = is_mask.to(input_ids.device)
        index = is_mask.flatten().nonzero().squeeze(1)
        if offsets is not None:
            offsets = offsets.to(input_ids.device).flatten()[index]
        else:
            offsets = mask_offsets(is_mask, kwargs.get("attention_mask"))[is_mask]
        self._gate = _Gate(input_ids.shape, index, offsets.clamp(0, self.spec.rows - 1), _trailing_masks(is_mask))
        return None

    def _forget_masks(self, module, args, output):
        self._gate = None

    def _valid_ids(self, module, args):
        # a placed mask's id may lie past the embedding's last row; the row put there replaces the lookup
        gate, (ids,) = self._gate, args
        if gate is None or not gate.tail and not len(gate.index):
            return None
        if gate.index is None:
            return (torch.cat([ids[:, : -gate.tail], ids.new_zeros(len(ids), gate.tail)], dim=1),)
        return (ids.flatten().index_fill(0, gate.index, 0).reshape(ids.shape),)

    def _put_rows(self, module, args, output):
        gate = self._gate
        if gate is None or not gate.tail and not len(gate.index):
            return output
        rows = self.rows[gate.offsets].to(output.dtype)
        if gate.index is None:
            return torch.cat([output[:, : -gate.tail], rows.expand(len(output), -1, -1)], dim=1)
        flat = output.reshape(-1, output.shape[-1])
        return flat.index_copy(0, gate.index, rows).reshape(output.shape)

    def _gated_update(self, i: int, lora: _LoRA):
        scale = self.scale

        def hook(module, args, output):
            gate = self._gate
            if gate is None or not gate.tail and not len(gate.index):
                return output
            x = args[0]
            if gate.index is None:  # a decoding step: the masks are each row's last columns
                a_t, b_t = gate.factors[i]
                return torch.cat([output[:, : -gate.tail], output[:, -gate.tail :] + x[:, -gate.tail :] @ a_t @ b_t], 1)
            if x.shape[:-1].numel() != gate.shape.numel():
                raise UserError(f"a gated Linear saw {tuple(x.shape[:-1])} tokens for {tuple(gate.shape)} input ids")
            if gate.tail and x.shape[:-1] == gate.shape and not torch.is_grad_enabled():
                # decoding: the masks are each row's last columns, so the update is one fused
                # multiply-add into a slice of the output, with no gather, scatter or copy
                a_t, b_t = lora.factors(scale)
                if len(x) == 1:
                    output[0, -gate.tail :].addmm_(x[0, -gate.tail :] @ a_t, b_t)
                else:
                    output[:, -gate.tail :].baddbmm_(x[:, -gate.tail :] @ a_t, b_t.expand(len(x), -1, -1))
                return output
            picked = x.reshape(-1, x.shape[-1])[gate.index]
            update = (picked.to(lora.a.dtype) @ lora.a.T @ lora.b.T) * scale
            flat = output.reshape(-1, output.shape[-1])
            return flat.index_add(0, gate.index, update.to(output.dtype)).reshape(output.shape)

        return hook


@dataclass(frozen=True)
class _Gate:
    """Where one forward's masks are: ``index`` into the flattened ``[rows, columns]`` input, each
    mask's ``offsets``, and ``tail``: how many last columns of every row are all the masks (a
    decoding step's layout), 0 where they lie elsewhere (training's interleaved streams)."""

    shape: torch.Size | None
    index: torch.Tensor | None  # None: the masks are the last ``tail`` columns of every row
    offsets: torch.Tensor
    tail: int
    factors: tuple = ()  # each gated Linear's (a^T, scale * b^T), with a tail gate


def _trailing_masks(is_mask: torch.Tensor) -> int:
    """``n`` if every row's masks are exactly its last ``n`` columns, else 0."""
    if is_mask.dim() != 2:
        return 0
    n = int(is_mask[0].sum())
    if n == 0 or not bool(is_mask[:, -n:].all()) or bool(is_mask[:, :-n].any()):
        return 0
    return n


def mask_offsets(is_mask: torch.Tensor, attention_mask) -> torch.Tensor:
    """``[rows, columns]``: how many mask tokens of the fed input each position attends to, itself
    excluded: a mask's offset inside its block (training) or its group (decoding).

    Read off a dense 4-D mask (True or 0 where a query may attend; its last ``columns`` keys are
    the fed tokens, the ones before them cached slots, which never hold a mask), else counted as
    causal attention over the row.
    """
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        fed = attention_mask[:, 0, :, -is_mask.shape[1] :]
        visible = fed if fed.dtype == torch.bool else fed > torch.finfo(fed.dtype).min / 2
        return (visible & is_mask[:, None, :]).sum(-1) - 1
    return is_mask.long().cumsum(1) - 1


def choose_mask_id(model, tokenizer, mask_token: str) -> int:
    """The mask token's id for a new adapter: the tokenizer's own mask token where the embedding has a
    row for it, else the first id past the embedding's rows (one no text encodes to)."""
    rows = unwrap_model(model).get_input_embeddings().weight.shape[0]
    if mask_token in tokenizer.get_vocab():
        mask_id = tokenizer.convert_tokens_to_ids(mask_token)
        if mask_id < rows:
            return mask_id
    return rows


def placed_masks(model, is_mask, offsets: torch.Tensor | None = None):
    """The context of a forward of ``model`` with masks where ``is_mask`` (a tensor or array; None:
    no masks) says: its adapter's :meth:`~MaskAdapter.gate` in exact mode, nothing else for a
    plain model or a forward without masks."""
    adapter = adapter_of(model)
    if adapter is None or is_mask is None:
        return nullcontext()
    return adapter.gate(torch.as_tensor(is_mask, dtype=torch.bool), offsets)


def tail_gate(model, offsets: torch.Tensor | None):
    """The context of a decoding forward of ``model`` whose masks are every row's last
    ``len(offsets)`` columns (:meth:`~MaskAdapter.tail_gate`); nothing for a plain model, a
    forward without masks (None) or with none (empty)."""
    adapter = adapter_of(model)
    if adapter is None or offsets is None or not len(offsets):
        return nullcontext()
    return adapter.tail_gate(offsets)


def adapter_of(model) -> MaskAdapter | None:
    """The adapter attached to ``model`` (None: a plain model)."""
    return getattr(unwrap_model(model), ATTRIBUTE, None)


def save(adapter: MaskAdapter, directory: str | Path) -> None:
    """The adapter's weights, in float32, as ``mars_adapter.safetensors`` in ``directory``."""
    from safetensors.torch import save_file

    tensors = {name: value.detach().float().cpu().contiguous() for name, value in adapter.state_dict().items()}
    save_file(tensors, str(Path(directory, FILENAME)))


def save_checkpoint(model, tokenizer, source: str, directory: str | Path) -> None:
    """An exact-mode checkpoint in ``directory``: the original model's own files and the adapter.

    From a local directory the original's files are copied as they are, so the weights (and their
    dtype) are the original's byte for byte; from a hub id the model is saved in the dtype its
    config names. Either way ``from_pretrained`` on the result is the original model.
    """
    adapter = adapter_of(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    adapter.detach(model)
    try:
        if Path(source).is_dir():
            for path in Path(source).iterdir():
                if path.is_file() and path.name not in MARSLM_FILES:
                    shutil.copy2(path, directory / path.name)
        else:
            from transformers import AutoConfig

            dtype = getattr(AutoConfig.from_pretrained(source), "dtype", None) or torch.float32
            unwrap_model(model).to(dtype).save_pretrained(directory)
            tokenizer.save_pretrained(directory)
        save(adapter, directory)
    finally:
        adapter.attach(model)


# Files a marslm checkpoint holds beside the model's own, which an exact checkpoint does not copy.
MARSLM_FILES = ("marslm.json", FILENAME, "training_log.json")


def load(spec: AdapterSpec, directory: str | Path, model) -> MaskAdapter:
    """The adapter saved in ``directory``, attached to ``model``, in the model's dtype and device;
    proved first: its file parses, holds the spec's tensors with only finite values, and the model
    is the one it was trained on (:func:`base_fingerprint`)."""
    path = Path(directory, FILENAME)
    inner = unwrap_model(model)
    modules = dict(inner.named_modules())
    missing = [name for name in spec.targets if name not in modules]
    if missing:
        raise UserError(f"{directory}: the adapter gates {missing[0]}, which the model does not have")
    shapes = {name: (modules[name].in_features, modules[name].out_features) for name in spec.targets}
    adapter = MaskAdapter(spec, shapes)
    tensors = read_tensors(path)
    check_tensors(tensors, adapter.state_dict(), path)
    check_base(spec, inner, directory)
    adapter.load_state_dict(tensors)
    weight = inner.get_input_embeddings().weight
    adapter.to(device=weight.device, dtype=weight.dtype)
    adapter.attach(inner)
    return adapter
