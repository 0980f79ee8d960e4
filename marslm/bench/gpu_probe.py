"""What marslm's training and decoding cost on a GPU, in one run of at most about eight minutes.

    python -m marslm.bench.gpu_probe --out probe.json            # on the GPU machine
    python -m marslm.bench.gpu_probe --dry-run --out probe.json  # tiny shapes, any machine (make test runs it)

It needs nothing from the network: every model is a named shape with random weights
(marslm.bench.train_step.SHAPES) and the tokenizer is trained on the spot from the toy
suite. A machine whose transformers is older than marslm's floor can be given a wheel:
``pip install --no-index --no-deps --target /tmp/site transformers-*.whl`` and
``PYTHONPATH=/tmp/site``. The JSON is rewritten after every section, so a run that is cut off
still reports what it finished; a section that fails records its error and the next one runs.

Sections:
  environment   versions, the GPU, which attention kernels exist
  correctness   marslm.generate at tau 1 and lossless against HF greedy decoding (float32), and
                how often bf16 decoding departs from float32
  attention     one attention layer over a two-stream row of W columns, forward and backward:
                sdpa with the boolean MARS mask, FlexAttention with the block mask, and causal
                sdpa over the W / 2 clean tokens alone (what an AR step attends)
  train_step    a Qwen2.5-0.5B-shaped model: MARS step against AR step per sequence length, with
                and without activation checkpointing, target-only against full logits
  cost_curve    one cached forward feeding w = 1..9 tokens, against one token, per batch size
  generate      marslm.generate against HF generate, tokens per second (tau 1: the engine's own cost)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from marslm.bench.train_step import build_shape, train_step_bench  # noqa: E402

FULL = {
    "deadline_s": 450,
    "generate_shape": ("qwen2.5-0.5b", None),
    "correctness": {"prompts": 16, "new_tokens": 64},
    "attention": {"widths": (4096, 8192, 16384), "heads": 14, "head_dim": 64, "repeats": 5},
    "train_step": {
        "shape": ("qwen2.5-0.5b", None),
        "runs": [
            # (sequence lengths, activation checkpointing, logits)
            ((1024, 2048, 4096, 8192), False, "targets"),
            ((4096, 8192), True, "targets"),
            ((1024, 4096), False, "full"),
        ],
        "repeats": 2,
    },
    "cost_curve": {"widths": tuple(range(1, 10)), "contexts": (512,), "batch_sizes": (1, 8, 64), "repeats": 5},
    "generate": {"batch_sizes": (1, 8), "prompts": 8, "new_tokens": 64, "repeats": 2},
}
DRY = {
    "deadline_s": 240,
    "generate_shape": ("smollm2-135m", 2),
    "correctness": {"prompts": 3, "new_tokens": 8},
    "attention": {"widths": (64,), "heads": 2, "head_dim": 16, "repeats": 1},
    "train_step": {
        "shape": ("smollm2-135m", 1),
        "runs": [((32,), False, "targets"), ((32,), True, "both")],
        "repeats": 1,
    },
    "cost_curve": {"widths": (1, 2, 5), "contexts": (16,), "batch_sizes": (1, 2), "repeats": 1},
    "generate": {"batch_sizes": (1, 2), "prompts": 2, "new_tokens": 8, "repeats": 1},
}


class Report:
    """The probe's JSON, rewritten (atomically) after every section."""

    def __init__(self, path: Path, plan: dict, dry_run: bool):
        self.path = path
        self.started = time.time()
        self.deadline = self.started + plan["deadline_s"]
        self.data = {"dry_run": dry_run, "sections": {}}

    def run(self, name: str, section, *args) -> None:
        if time.time() > self.deadline:
            self.data["sections"][name] = {"skipped": "past the probe's deadline"}
        else:
            started = time.time()
            try:
                result = section(*args)
            except Exception as exc:  # noqa: BLE001 - a failing section is a finding; the next one runs
                result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            result["seconds"] = round(time.time() - started, 1)
            self.data["sections"][name] = result
        self.data["seconds"] = round(time.time() - self.started, 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)
        print(f"[gpu probe] {name}: {json.dumps(self.data['sections'][name], default=str)[:400]}", flush=True)


def tokenizer():
    from marslm.data import toy
    from marslm.data.tokenizer import train_chat_tokenizer

    texts = [toy.to_chat_record(e)["messages"][0]["content"] for e in toy.make_split("train", 400)]
    return train_chat_tokenizer(texts, vocab_size=320)


def prompts(n: int, length: int = 24, vocab: int = 300, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length + i % 5,), generator=generator).tolist() for i in range(n)]


def environment(device) -> dict:
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
        info["sdpa_flash"] = torch.backends.cuda.flash_sdp_enabled()
        info["sdpa_mem_efficient"] = torch.backends.cuda.mem_efficient_sdp_enabled()
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        info["flex_attention"] = True
    except ImportError:
        info["flex_attention"] = False
    return info


def _hf_greedy(model, prompt_ids, new_tokens):
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids], device=model.device)
        y = model.generate(x, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, pad_token_id=0)
        out.append(y[0, len(ids) :].tolist())
    return out


def correctness(device, plan, tok) -> dict:
    import marslm

    name, layers = plan["generate_shape"]
    cfg = plan["correctness"]
    model = build_shape(name, layers or 4, "sdpa", device=device).eval()
    ids = prompts(cfg["prompts"])
    reference = _hf_greedy(model, ids, cfg["new_tokens"])
    result = {"shape": name, "layers": model.config.num_hidden_layers, "prompts": len(ids)}
    for label, options in (("tau1", {"tau": 1.0}), ("lossless", {"mode": "lossless"})):
        out = marslm.generate(
            model,
            tok,
            ids,
            max_new_tokens=cfg["new_tokens"],
            mask_token_id=3,
            batch_size=len(ids),
            **options,
        )
        result[f"{label}_equals_hf_greedy_fp32"] = sum(a == b for a, b in zip(out.token_ids, reference))
    bf16 = build_shape(name, layers or 4, "sdpa", dtype=torch.bfloat16, device=device).eval()
    bf16.load_state_dict(model.state_dict())
    in_bf16 = _hf_greedy(bf16, ids, cfg["new_tokens"])
    result["bf16_greedy_differs_from_fp32"] = sum(a != b for a, b in zip(in_bf16, reference)) / len(ids)
    return result


def _time(fn, device, repeats: int) -> tuple[float, float | None]:
    """Median seconds and peak MiB (CUDA) of ``fn`` after one warm-up call."""
    fn()
    times, peak = [], None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    if device.type == "cuda":
        peak = round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)
    return sorted(times)[len(times) // 2], peak


def attention(device, plan) -> dict:
    cfg = plan["attention"]
    rows = [_attention_row(width, cfg, device) for width in cfg["widths"]]
    return {"forward_and_backward": device.type == "cuda", "rows": rows}


def _attention_row(width: int, cfg: dict, device) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from marslm.masks import packed_two_stream_mask, two_stream_block_mask

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    half = width // 2
    positions = torch.arange(half, device=device).repeat(2)[None]
    segments = torch.zeros_like(positions)
    noisy = (torch.arange(width, device=device) >= half)[None]
    shape = (1, cfg["heads"], width, cfg["head_dim"])
    # torch has no FlexAttention backward on a CPU: forward only there
    grad = device.type == "cuda"
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
    dense = packed_two_stream_mask(positions, segments, noisy, 4)
    block = two_stream_block_mask(positions, segments, noisy, 4)
    compiled = torch.compile(flex_attention) if device.type == "cuda" else flex_attention

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    def flex():
        return compiled(q, k, v, block_mask=block)

    def causal():
        return F.scaled_dot_product_attention(q[:, :, :half], k[:, :, :half], v[:, :, :half], is_causal=True)

    row = {"W": width, "mask_density": round(float(dense.float().mean()), 3)}
    with torch.no_grad():
        row["flex_max_abs_diff_vs_sdpa"] = float((sdpa() - flex()).abs().max())
    for name, attend in (("sdpa_bool_mask", sdpa), ("flex", flex), ("causal_ar_reference", causal)):

        def step(attend=attend):
            out = attend()
            if grad:
                out.sum().backward()

        try:
            seconds, peak = _time(step, device, cfg["repeats"])
            row[name] = {"ms": round(1000 * seconds, 3), "peak_mib": peak}
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            row[name] = {"error": "out of memory"}
    if "ms" in row["flex"] and "ms" in row["sdpa_bool_mask"]:
        row["flex_speedup_vs_sdpa"] = round(row["sdpa_bool_mask"]["ms"] / row["flex"]["ms"], 2)
    return row


def train_step(device, plan) -> dict:
    from marslm.training.surgery import enable_activation_checkpointing

    cfg = plan["train_step"]
    name, layers = cfg["shape"]
    attention_impl = "flex_attention" if device.type == "cuda" else "sdpa"
    runs = []
    for seq_lens, checkpointing, logits in cfg["runs"]:
        model = build_shape(name, layers, attention_impl, device=device)
        if checkpointing:
            enable_activation_checkpointing(model)
        settings = {"targets": (True,), "full": (False,), "both": (True, False)}[logits]
        report = train_step_bench(
            model,
            seq_lens=seq_lens,
            repeats=cfg["repeats"],
            target_logits=settings,
            bf16=device.type == "cuda",
            progress=False,
        )
        runs.append(report)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"shape": name, "runs": runs}


def cost_curve_section(device, plan) -> dict:
    from marslm.decode.cost_curve import cost_curve

    name, layers = plan["generate_shape"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_shape(name, layers, "sdpa", dtype=dtype, device=device).eval()
    cfg = plan["cost_curve"]
    return cost_curve(
        model,
        widths=list(cfg["widths"]),
        contexts=cfg["contexts"],
        batch_sizes=cfg["batch_sizes"],
        repeats=cfg["repeats"],
        progress=False,
    )


def generate_section(device, plan, tok) -> dict:
    name, layers = plan["generate_shape"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_shape(name, layers, "sdpa", dtype=dtype, device=device).eval()
    cfg = plan["generate"]
    ids = prompts(cfg["prompts"], seed=1)
    rows = [_generate_row(model, tok, ids[:batch], cfg, device) for batch in cfg["batch_sizes"]]
    return {"shape": name, "layers": model.config.num_hidden_layers, "dtype": str(dtype), "rows": rows}


def _generate_row(model, tok, ids: list[list[int]], cfg: dict, device) -> dict:
    import marslm

    width = max(map(len, ids))
    x = torch.tensor([[0] * (width - len(p)) + p for p in ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=device)
    new = cfg["new_tokens"]

    def hf():
        model.generate(
            x, attention_mask=attention_mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        )

    def ours(**options):
        marslm.generate(model, tok, ids, max_new_tokens=new, mask_token_id=3, batch_size=len(ids), **options)

    row = {"batch": len(ids)}
    for label, fn in (
        ("hf_generate", hf),
        ("marslm_tau1", lambda: ours(tau=1.0)),
        ("marslm_lossless", lambda: ours(mode="lossless")),
    ):
        seconds, _ = _time(fn, device, cfg["repeats"])
        row[label] = {"tokens_per_s": round(len(ids) * new / seconds, 1)}
    row["tau1_vs_hf"] = round(row["marslm_tau1"]["tokens_per_s"] / row["hf_generate"]["tokens_per_s"], 2)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_probe.json", help="the JSON report (rewritten after every section)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes: checks the probe itself, on any machine")
    parser.add_argument(
        "--sections",
        default="environment,correctness,attention,train_step,cost_curve,generate",
        help="comma-separated sections to run, in this order",
    )
    args = parser.parse_args(argv)
    plan = DRY if args.dry_run else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.dry_run:
        print("no CUDA device: run with --dry-run to check the probe on a CPU", file=sys.stderr)
        return 2
    report = Report(Path(args.out), plan, args.dry_run)
    wanted = args.sections.split(",")
    tok = tokenizer() if {"correctness", "generate"} & set(wanted) else None
    sections = {
        "environment": (environment, device),
        "correctness": (correctness, device, plan, tok),
        "attention": (attention, device, plan),
        "train_step": (train_step, device, plan),
        "cost_curve": (cost_curve_section, device, plan),
        "generate": (generate_section, device, plan, tok),
    }
    for name in wanted:
        if name not in sections:
            print(f"unknown section {name!r}; choose from {', '.join(sections)}", file=sys.stderr)
            return 2
        fn, *fn_args = sections[name]
        report.run(name, fn, *fn_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
