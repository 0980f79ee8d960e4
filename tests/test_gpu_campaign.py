"""marslm/demo/gpu_campaign.py and its carry kit (gpu_kit.py): the rehearsal runs every stage
on a CPU from the same split parts, so the campaign cannot rot between the rare lent GPUs, and the
kit fits what each device call may carry."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from marslm.demo import gpu_campaign, gpu_kit

ROOT = Path(__file__).resolve().parents[1]

MODEL_STAGES = ["convert", "distill", "train_exact", "train_full", "probe_exact", "probe_full", "decode"]
# transformers 5.24's wheel is 13 MiB; the stand-in leaves room for a later pin to grow
WHEELS_STAND_IN = 16 * 2**20


def marker_wheel(folder: Path) -> Path:
    """A minimal valid wheel: what the campaign installs into its private path, here without a registry."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "marslm_kit_marker-0.1-py3-none-any.whl"
    info = "marslm_kit_marker-0.1.dist-info"
    files = {
        "marslm_kit_marker/__init__.py": "CARRIED = True\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: marslm-kit-marker\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def campaign(tmp_path: Path, kit: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "campaign.json"
    run = subprocess.run(
        [sys.executable, "-m", "marslm.demo.gpu_campaign", "--dry-run", "--kit", str(kit)]
        + ["--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads(out.read_text())


@pytest.mark.slow
def test_the_campaign_dry_run_runs_every_stage_from_the_split_parts(tmp_path):
    from marslm.convert import smollm2_gguf

    kit = tmp_path / "kit"
    gpu_kit.split(smollm2_gguf(), kit)
    wheel = marker_wheel(kit / gpu_kit.CALLS[-1])
    _, report = campaign(tmp_path, kit)
    sections = report["sections"]
    assert list(sections) == ["kit", "environment", *MODEL_STAGES, "probe_attention"]
    for name, section in sections.items():
        assert "error" not in section and "skipped" not in section, (name, section)
    assert "fallback" not in report
    assert sections["kit"]["model"]["sha256"] == gpu_kit.sha256(smollm2_gguf())
    assert sections["kit"]["wheels"] == [wheel.name]
    assert sections["kit"]["from_site"] == {"marslm_kit_marker": True}
    for arm in ("exact", "full"):
        train = sections[f"train_{arm}"]
        assert train["summary"]["steps"] == train["planned_steps"] and train["attention"] == "sdpa"
        assert train["learning_curve"][0]["step"] == 0
    # exact mode keeps the model: its clean stream is the original's, token for token
    assert sections["probe_exact"]["fidelity"]["top1_agreement"] == 1.0
    assert "original_bf16" in sections["probe_full"]
    decode = sections["decode"]
    for arm in ("exact", "full"):
        rows = {(r["contender"], r["batch_size"]): r for bench in decode[arm] for r in bench["rows"]}
        assert {b for _, b in rows} == {1, 2}
        for batch in (1, 2):
            assert rows[("MARS lossless", batch)]["same_as_greedy"], (arm, batch)
            assert rows[("MARS cursor tau=1.0", batch)]["same_as_greedy"], (arm, batch)
    table = gpu_campaign.tables(report)
    assert "## exact: exact mode" in table and "## full: all layers" in table
    assert table.count("| MARS lossless | 1 |") == 2 and "fidelity (clean top-1 = reference): 100.0%" in table


def test_without_a_part_the_model_stages_fail_and_the_probe_still_runs(tmp_path):
    """The single-call fallback: the machine was given back between the two calls."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    kit = tmp_path / "kit"
    gpu_kit.split(source, kit)
    (kit / gpu_kit.CALLS[0] / "model.gguf.part1").unlink()
    _, report = campaign(tmp_path, kit)
    sections = report["sections"]
    assert "part call1/model.gguf.part1 is not under" in sections["kit"]["error"]
    assert "fallback" in report
    for name in MODEL_STAGES:
        assert "error" in sections[name], name
    assert "error" not in sections["probe_attention"]


def test_the_parts_reassemble_only_as_the_manifest_says(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 1000)
    kit = tmp_path / "kit"
    manifest = gpu_kit.split(source, kit, beside_last=50_000)
    assert [p["bytes"] for p in manifest["parts"]] == [153_000, 103_000]  # both calls carry about as much
    places = [kit / c for c in gpu_kit.CALLS]
    # a part found by its bare name, as the first call stages it outside the kit
    staged = tmp_path / "staged"
    staged.mkdir()
    (kit / gpu_kit.CALLS[0] / "model.gguf.part1").rename(staged / "model.gguf.part1")
    whole = gpu_kit.reassemble(kit / "call2" / gpu_kit.MANIFEST, [staged, *places], tmp_path / "out.gguf")
    assert whole.read_bytes() == source.read_bytes()
    manifest_path = kit / "call2" / gpu_kit.MANIFEST
    part2 = kit / gpu_kit.CALLS[1] / "model.gguf.part2"
    data = part2.read_bytes()
    part2.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ValueError, match=r"part .*part2 does not match the manifest"):
        gpu_kit.reassemble(manifest_path, [staged, *places], tmp_path / "again.gguf")
    assert not list(tmp_path.glob("again.gguf*"))  # neither the file nor its partial copy
    part2.write_bytes(data)
    manifest_path.write_text(json.dumps({**manifest, "sha256": "0" * 64}))
    with pytest.raises(ValueError, match="reassembled file's sha256"):
        gpu_kit.reassemble(manifest_path, [staged, *places], tmp_path / "again.gguf")
    assert not list(tmp_path.glob("again.gguf*"))


def test_training_stops_when_its_minutes_are_spent():
    from types import SimpleNamespace

    for seconds, stops in ((0, True), (3600, False)):
        control = SimpleNamespace(should_training_stop=False)
        callback = gpu_campaign.stop_after(seconds)
        callback.on_train_begin(None, None, control)
        callback.on_step_end(None, None, control)
        assert control.should_training_stop is stops


def test_an_arm_whose_flex_attention_fails_trains_again_with_sdpa(tmp_path, monkeypatch):
    tried = []

    def train_arm(c, arm, preset, original, data):
        tried.append(preset.train["attention"])
        if preset.train["attention"] == "flex":
            raise RuntimeError("no kernel")
        return {"steps": 1}

    monkeypatch.setattr(gpu_campaign, "train_arm", train_arm)
    c = gpu_campaign.Campaign(gpu_campaign.GPU, tmp_path, tmp_path, dry_run=False)
    c.made.update(original=tmp_path, distill=tmp_path)
    result = gpu_campaign.train_stage(c, "exact")
    assert tried == ["flex", "sdpa"]
    assert result == {"flex_error": "RuntimeError: no kernel", "attention": "sdpa", "steps": 1}


def test_each_device_call_carries_under_its_limit(tmp_path):
    """The real model's parts beside room for the pinned wheels, and the working tree, per call."""
    from marslm.convert import smollm2_gguf

    kit = tmp_path / "kit"
    manifest = gpu_kit.split(smollm2_gguf(), kit, beside_last=WHEELS_STAND_IN)
    (kit / gpu_kit.CALLS[-1] / "wheels.stand-in").write_bytes(bytes(WHEELS_STAND_IN))
    assert all(p["bytes"] < gpu_kit.PART_LIMIT for p in manifest["parts"])
    tree = gpu_kit.tree_bytes()
    assert gpu_kit.check_calls(kit, tree) == [], gpu_kit.call_bytes(kit, tree)
    built = ROOT / "gpu-kit"  # `make gpu-kit`'s own, where one was built
    if built.is_dir():
        assert gpu_kit.check_calls(built, tree) == []
    (kit / gpu_kit.CALLS[0] / "extra").write_bytes(bytes(gpu_kit.CALL_LIMIT))
    assert [line.split(":")[0] for line in gpu_kit.check_calls(kit, tree)] == ["call1"]


def test_the_kit_carries_the_suites_pinned_versions():
    versions = gpu_kit.pins()
    assert {"transformers", "gguf"} <= set(versions)
    assert set(gpu_kit.WHEELS) <= set(versions)


def test_the_campaign_refuses_a_machine_without_cuda_unless_dry(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = subprocess.run(
        [sys.executable, "-m", "marslm.demo.gpu_campaign", "--out", str(tmp_path / "c.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--dry-run" in run.stderr
