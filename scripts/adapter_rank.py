"""How much of an exact checkpoint's gated LoRA a lower rank keeps, and a copy truncated to it.

    python scripts/adapter_rank.py runs/sml/mars --ranks 8,16,32 --out runs/sml/rank
    marslm probe --model runs/sml/rank/r16 --data runs/sml/distill/heldout.jsonl

Each gated Linear's update ``(alpha / rank) * B @ A`` is replaced by its best rank-r approximation
(a truncated SVD), saved as rank r with alpha = r, so the scale folds into the factors. The copy's
model files are links to the checkpoint's (the base weights do not change), so OUT/r<rank> is a
checkpoint like any other: ``marslm probe`` says what the masks lost, ``marslm bench`` what the
smaller factors save. Prints, per rank, the share of each update's energy (squared singular
values) it keeps, as the mean over the Linears and the least.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marslm.adapter import FILENAME  # noqa: E402
from marslm.settings import ints  # noqa: E402


def truncated(weights: dict, scale: float, rank: int) -> tuple[dict, list[float]]:
    """The adapter's tensors with every LoRA pair ``lora.i.a`` / ``lora.i.b`` at ``rank`` (scale
    folded in), and the share of each update's energy kept."""
    out, kept = {}, []
    for name, tensor in weights.items():
        if not name.endswith(".a"):
            if not name.endswith(".b"):
                out[name] = tensor  # the mask rows
            continue
        pair = name[: -len(".a")]
        u, s, vh = torch.linalg.svd(scale * weights[f"{pair}.b"].double() @ tensor.double(), full_matrices=False)
        kept.append(float((s[:rank] ** 2).sum() / (s**2).sum().clamp_min(1e-30)))
        out[f"{pair}.a"] = vh[:rank].float().contiguous()
        out[f"{pair}.b"] = (u[:, :rank] * s[:rank]).float().contiguous()
    return out, kept


def write_copy(source: Path, target: Path, tensors: dict, meta: dict, rank: int) -> None:
    """``target``: links to ``source``'s files, and the truncated adapter with its entry."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and path.name not in (FILENAME, "marslm.json"):
            (target / path.name).symlink_to(path.resolve())
    save_file(tensors, str(target / FILENAME))
    meta = {**meta, "adapter": {**meta["adapter"], "rank": rank, "alpha": float(rank)}}
    (target / "marslm.json").write_text(json.dumps(meta, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="an exact-mode checkpoint (marslm train mars --exact)")
    parser.add_argument("--ranks", type=ints, default=[8, 16, 32], help="comma-separated ranks (default 8,16,32)")
    parser.add_argument("--out", type=Path, required=True, help="the copies go to OUT/r<rank>")
    args = parser.parse_args()
    meta_path = args.checkpoint / "marslm.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    spec = meta.get("adapter")
    if not spec or not spec.get("rank"):
        print(f"adapter_rank: error: {args.checkpoint} holds no gated LoRA (not an exact checkpoint)", file=sys.stderr)
        return 2
    too_big = [r for r in args.ranks if not 1 <= r < spec["rank"]]
    if too_big:
        print(f"adapter_rank: error: ranks must be in 1..{spec['rank'] - 1}, got {too_big[0]}", file=sys.stderr)
        return 2
    weights = load_file(str(args.checkpoint / FILENAME))
    for rank in args.ranks:
        tensors, kept = truncated(weights, spec["alpha"] / spec["rank"], rank)
        write_copy(args.checkpoint, args.out / f"r{rank}", tensors, meta, rank)
        share = f"mean {sum(kept) / len(kept):.3f}, least {min(kept):.3f}"
        print(f"rank {rank}: energy kept, {share} -> {args.out}/r{rank}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
