"""marslm as an lm-evaluation-harness model: ``--model marslm``.

    python -m marslm.eval.lm_eval_adapter --model marslm \\
        --model_args pretrained=runs/demo/mars,tau=0.95,block_size=4,cache=cursor \\
        --tasks marslm_toy --apply_chat_template --output_path results/

``marslm_toy`` (the embedded suite, ``marslm/eval/lm_eval_tasks/``) is registered by the adapter itself;
lm-eval's own tasks (gsm8k, ...) need their datasets from the hub.

lm-eval (0.4.x) finds models by name in its own registry and offers no plugin entry point, so
the registration below must run before lm-eval resolves ``--model``: ``python -m
marslm.eval.lm_eval_adapter ARGS`` registers, then runs lm-eval's own command line with ARGS
unchanged. From Python, ``import marslm.eval.lm_eval_adapter`` before ``lm_eval.simple_evaluate(
model="marslm", ...)`` does the same.

What goes where:
  generate_until            marslm's batched MARS decoding (``marslm.generate``: continuous refill,
                            stops at the end-of-turn token and at lm-eval's ``until`` strings);
                            ``max_gen_toks`` caps new tokens. Sampling kwargs are ignored (with a
                            warning): the model args decide how to decode.
  loglikelihood(_rolling)   the plain AR forward of the same checkpoint (MARS keeps it intact).
  chat templates            ``--apply_chat_template`` renders with the checkpoint's tokenizer, as HFLM.

Tokens per forward: lm-eval stores ``get_model_info()`` in the ``config`` section of its results
JSON; ours adds ``"marslm": {tau, block_size, ..., "tokens_per_forward", "forwards", ...}``
there. ``stats_path=FILE`` in ``--model_args`` also writes that dict to FILE.

Model args: pretrained (required), tau (0.95), metric (prob), block_size (the trained B),
cache (cursor), mode (threshold), adaptive_width and mask_batch_limit (N, auto or off; the
decoder's fallback by default, ``adaptive_width=False,mask_batch_limit=off`` for the paper's rule,
whose text does not depend on the batch or the machine), max_gen_toks (256), max_length (the
model's), dtype, device, batch_size (also lm-eval's ``--batch_size``), stats_path.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import defaultdict
from dataclasses import replace

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from tqdm import tqdm

from ..errors import UserError
from ..settings import int_or_auto

log = logging.getLogger("marslm")

DEFAULT_BATCH_SIZE = 16


def _fallback(adaptive_width, mask_batch_limit) -> dict:
    """``DecoderOptions``' fallback fields from model args, which arrive as strings or as lm-eval's
    guesses (bools, ints); unset keeps the decoder's default, and ``mask_batch_limit=off`` with
    ``adaptive_width=False`` is the paper's rule."""
    fields = {}
    if adaptive_width is not None:
        text = str(adaptive_width).lower()
        if text not in ("true", "false"):
            raise UserError(f"adaptive_width must be True or False, got {adaptive_width!r}")
        fields["adaptive_width"] = text == "true"
    if mask_batch_limit is not None:
        try:  # the command line's rule for N, auto or off
            fields["mask_batch_limit"] = int_or_auto(str(mask_batch_limit))
        except argparse.ArgumentTypeError as exc:
            raise UserError(f"mask_batch_limit: {exc}") from None
    return fields


class MarsLM(TemplateLM):
    def __init__(
        self,
        pretrained: str,
        tau: float = 0.95,
        metric: str = "prob",
        block_size: int | None = None,
        cache: str = "cursor",
        mode: str = "threshold",
        adaptive_width: bool | str | None = None,
        mask_batch_limit: int | str | None = None,
        max_gen_toks: int = 256,
        max_length: int | None = None,
        dtype: str | None = None,
        device: str | None = None,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        stats_path: str | None = None,
        **unused,
    ) -> None:
        super().__init__()
        from ..decode import DecoderOptions, DecodingParams
        from ..modeling import checkpoint_block_size, load_model

        if unused:
            log.warning("marslm lm-eval adapter: ignoring model args %s", sorted(unused))
        block_size = int(block_size) if block_size else None
        trained = checkpoint_block_size(str(pretrained))
        self.params = DecodingParams(
            tau=float(tau), metric=metric, block_size=block_size, max_new_tokens=int(max_gen_toks), mode=mode
        ).validate(trained)
        self.decoder = DecoderOptions(cache=cache, **_fallback(adaptive_width, mask_batch_limit))
        self.model, self.tokenizer, _ = load_model(str(pretrained), dtype=dtype, device=_usable_device(device))
        self._device = next(self.model.parameters()).device
        self._max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length) if max_length else None
        # lm-eval passes "auto" or "auto:N" for automatic sizing; continuous refill makes that moot.
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else DEFAULT_BATCH_SIZE
        self.stats_path = stats_path
        self.stats = {"answers": 0, "generated_tokens": 0, "accepted_tokens": 0, "forwards": 0}
        self._warned_sampling = False

    # ------------------------------------------------------------------ what lm-eval asks of a model
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """Context for an empty prompt in loglikelihood: BOS if the tokenizer has one, else EOS."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or getattr(self.model.config, "max_position_embeddings", None) or 2048

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        # A chat-templated context already carries any BOS the template wants: add none twice.
        add = True if add_special_tokens is None else add_special_tokens
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            add = False
        ids = self.tokenizer.encode(string, add_special_tokens=add)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ scoring: the plain AR forward
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation)."""
        results: list = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        batch_size = override_bs or self.batch_size
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for first in tqdm(range(0, len(order), batch_size), disable=disable_tqdm, desc="marslm loglikelihood"):
            rows = order[first : first + batch_size]
            # Feed context + continuation minus its last token, keeping at most max_length tokens.
            inputs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1) :][:-1] for i in rows]
            width = max(map(len, inputs))
            input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(rows), width), dtype=torch.long)
            for r, ids in enumerate(inputs):
                input_ids[r, : len(ids)] = torch.tensor(ids)
                attention[r, : len(ids)] = 1
            logits = self.model(input_ids=input_ids.to(self._device), attention_mask=attention.to(self._device)).logits
            logprobs = F.log_softmax(logits.float(), dim=-1)
            for r, i in enumerate(rows):
                continuation = requests[i][2]
                end = len(inputs[r])
                picked = logprobs[r, end - len(continuation) : end]  # outputs that predict the continuation
                target = torch.tensor(continuation, device=picked.device)
                total = float(picked.gather(-1, target[:, None]).sum())
                greedy = bool((picked.argmax(dim=-1) == target).all())
                results[i] = (total, greedy)
                if requests[i][0] is not None and requests[i][0][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents, in disjoint windows of at most ``max_length`` tokens."""
        totals = []
        for (string,) in tqdm([req.args for req in requests], disable=disable_tqdm, desc="marslm rolling"):
            windows = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            totals.append(sum(logprob for logprob, _ in scored))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), totals[-1])
        return totals

    # ------------------------------------------------------------------ generation: MARS decoding
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from ..decode import TextStream, generate
        from ..decode.params import MAX_STOP_SEQUENCES

        # Requests with the same generation kwargs decode together (marslm refills the batch itself).
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        texts: list = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="marslm generate_until")
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1] or {})
            until = kwargs.pop("until", None) or []
            stop = tuple(s for s in ([until] if isinstance(until, str) else until) if s)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            self._warn_if_sampling(kwargs)
            contexts = [requests[i].args[0] for i in members]
            prompts = [self.tok_encode(c, left_truncate_len=max(1, self.max_length - max_new)) for c in contexts]
            out = generate(
                self.model,
                self.tokenizer,
                prompts,
                replace(self.params, max_new_tokens=max_new, stop=stop[:MAX_STOP_SEQUENCES]),
                self.decoder,
                batch_size=self.batch_size,
                on_finish=lambda _row: bar.update(1),
            )
            for i, context, text in zip(members, contexts, out.texts):
                # a task with more stop strings than a request may name: the rest cut the text after
                texts[i] = TextStream.cut(text, stop[MAX_STOP_SEQUENCES:])
                self.cache_hook.add_partial("generate_until", (context, requests[i].args[1]), texts[i])
            self.stats["answers"] += len(members)
            self.stats["generated_tokens"] += sum(map(len, out.token_ids))
            self.stats["accepted_tokens"] += sum(map(sum, out.accepted_per_step))
            self.stats["forwards"] += sum(out.forwards)
        bar.close()
        if self.stats_path:
            from ..files import write_json_atomically

            write_json_atomically(self.stats_path, self.summary())
        return texts

    def _warn_if_sampling(self, kwargs: dict) -> None:
        sampling = kwargs.get("do_sample") or float(kwargs.get("temperature", 0) or 0) > 0
        if sampling and not self._warned_sampling:
            log.warning("marslm decodes as its model args say; ignoring sampling kwargs %s", kwargs)
            self._warned_sampling = True

    # ------------------------------------------------------------------ what ends up in the results JSON
    def summary(self) -> dict:
        s, p = self.stats, self.params
        return {
            **{
                "tau": p.tau,
                "metric": p.metric,
                "block_size": p.block_size,
                "cache": self.decoder.cache,
                "mode": p.mode,
            },
            **s,
            "tokens_per_forward": s["accepted_tokens"] / s["forwards"] if s["forwards"] else None,
            "forwards_per_answer": s["forwards"] / s["answers"] if s["answers"] else None,
        }

    def get_model_info(self) -> dict:
        """lm-eval merges this into ``results["config"]`` after the run, so the stats are complete."""
        from ..modeling import count_parameters

        return {
            "model_num_parameters": count_parameters(self.model),
            "model_dtype": str(self.model.dtype),
            "marslm": self.summary(),
        }


# Register once: `python -m marslm.eval.lm_eval_adapter` runs this file as __main__, and anything that
# then imports marslm.eval.lm_eval_adapter would otherwise try to register a second class.
if "marslm" not in model_registry:
    register_model("marslm")(MarsLM)


def _usable_device(device: str | None) -> str:
    """lm-eval's default ``--device`` is cuda; fall back to the CPU where there is none."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.info("marslm lm-eval adapter: no CUDA device here; running on the CPU")
        return "cpu"
    return str(device)


def main(argv: list[str] | None = None) -> None:
    """``python -m marslm.eval.lm_eval_adapter ARGS``: lm-eval's command line, with ``--model marslm`` known."""
    from lm_eval.__main__ import cli_evaluate

    from ..errors import UserError
    from .lm_eval_tasks import TASKS_DIR

    args = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in args:  # marslm's own tasks (marslm_toy) are found without asking
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except UserError as exc:  # a bad path or setting in --model_args: one line, as the marslm command
        print(f"marslm lm-eval adapter: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
