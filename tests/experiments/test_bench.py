"""`marslm bench` runs every contender and reports a well-formed table (no speed asserts here)."""

import json

from marslm.cli import main


def test_bench_smoke(trained_dirs, tmp_path, capsys):
    root = trained_dirs["dir"]
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--model",
            str(root / "mars"),
            "--ar-model",
            str(root / "ar"),
            "--n",
            "2",
            "--repeats",
            "1",
            "--batch-sizes",
            "1,2",
            "--max-new-tokens",
            "16",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "MARS cursor tau=0.95" in table and "refused" in table  # prompt lookup refuses batch 2
    report = json.loads(out.read_text())
    rows = {(r["contender"], r["batch_size"]): r for r in report["rows"]}
    assert rows[("HF generate (AR ckpt)", 1)]["speedup"] == 1.0
    for (name, batch), row in rows.items():
        if "refused" in row:
            assert name.startswith("HF prompt lookup") and batch > 1
            continue
        assert row["tokens_per_second"] > 0 and row["tokens_per_forward"] >= 1.0
        assert 0.0 <= row["accuracy"] <= 1.0
    # the lossless claim is checked per row (exact equality is proven in float64 in test_decode.py;
    # here the models are float32, where a near-tie may legitimately differ)
    assert isinstance(rows[("MARS lossless", 1)]["same_as_greedy"], bool)


def test_bench_contender_groups_and_interleaved_repeats(trained_dirs, tmp_path, capsys):
    root = trained_dirs["dir"]
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--model",
                str(root / "mars"),
                "--ar-model",
                str(root / "ar"),
                "--n",
                "2",
                "--repeats",
                "2",
                "--batch-sizes",
                "2",
                "--max-new-tokens",
                "8",
                "--contenders",
                "cursor,lossless",
                "--taus",
                "0.9",
                "--json",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    names = [r["contender"] for r in json.loads(out.read_text())["rows"]]
    assert names == ["HF generate (AR ckpt)", "MARS cursor tau=0.9", "MARS lossless"]
    assert main(["bench", "--model", str(root / "mars"), "--ar-model", str(root / "ar"), "--contenders", "nope"]) == 2
    assert "unknown contender group(s) nope" in capsys.readouterr().err


def test_cost_curve_runs_every_width_and_is_relative_to_one_token(trained_dirs, tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert (
        main(
            [
                "bench",
                "--cost-curve",
                "--model",
                str(trained_dirs["dir"] / "mars"),
                "--contexts",
                "8,16",
                "--batch-sizes",
                "1,2",
                "--repeats",
                "1",
                "--json",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["widths"] == list(range(1, 2 * 4 + 3))  # the checkpoint's B = 4: w = 1 .. 2B + 2
    assert len(report["rows"]) == 2 * 2 * 10
    assert all(r["ratio"] == 1.0 for r in report["rows"] if r["width"] == 1)
    assert all(r["ms"] > 0 for r in report["rows"])
    assert "| 2 | 16 | 1.00 |" in capsys.readouterr().out
