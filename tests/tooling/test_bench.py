"""`marslm bench` runs every contender and reports a well-formed table (no speed asserts here)."""

import json

import pytest

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
            "--dtype",
            "float64",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "MARS cursor tau=0.95" in table and "refused" in table  # prompt lookup refuses batch 2
    assert "float64" in table
    report = json.loads(out.read_text())
    assert report["dtype"] == "float64"
    rows = {(r["contender"], r["batch_size"]): r for r in report["rows"]}
    assert rows[("HF generate (AR ckpt)", 1)]["speedup"] == 1.0
    for (name, batch), row in rows.items():
        if "refused" in row:
            assert name.startswith("HF prompt lookup") and batch > 1
            continue
        assert row["tokens_per_second"] > 0 and row["tokens_per_forward"] >= 1.0
        assert 0.0 <= row["accuracy"] <= 1.0
    # the lossless claim is checked per row (exact equality is proven in the decoding tests)
    assert isinstance(rows[("MARS lossless", 1)]["same_as_greedy"], bool)
    assert rows[("MARS hybrid tau=0.95", 2)]["tokens_per_forward"] >= 1.0  # a row per tau, as threshold's
    assert rows[("MARS hybrid +groups tau=0.9", 1)]["tokens_per_forward"] >= 1.0


def test_bench_contender_groups_and_interleaved_repeats(trained_dirs, tmp_path, capsys, monkeypatch):
    from marslm.bench import speed as bench

    root = trained_dirs["dir"]
    out = tmp_path / "bench.json"
    decoded = []  # each MARS call's settings: the contender's, not generate's defaults

    def generate(model, tokenizer, prompts, params, decoder, **kwargs):
        decoded.append((params.tau, params.mode, params.max_new_tokens, decoder.cache))
        return real_generate(model, tokenizer, prompts, params, decoder, **kwargs)

    real_generate = bench.generate
    monkeypatch.setattr(bench, "generate", generate)
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
    assert set(decoded) == {(0.9, "threshold", 8, "cursor"), (1.0, "lossless", 8, "cursor")}
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


def test_a_compiled_cost_curve_runs_the_bucket_widths_beside_eager(trained_dirs, tmp_path, capsys, monkeypatch):
    from marslm.decode import forward

    monkeypatch.setattr(forward, "BACKEND", "eager")
    out = tmp_path / "cost.json"
    argv = ["bench", "--cost-curve", "--model", str(trained_dirs["dir"] / "mars"), "--contexts", "8"]
    assert main(argv + ["--batch-sizes", "1", "--repeats", "1", "--compile", "--json", str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert report["eager"]["widths"] == report["compiled"]["widths"] == [1, 2, 4, 5, 8, 9]  # up to 2B + 2
    assert report["compiled"]["compiled"] and not report["eager"]["compiled"]
    assert "ratio to the eager step that feeds one token" in capsys.readouterr().out


def test_a_profiled_cost_curve_names_where_each_step_s_time_goes(trained_dirs, tmp_path, capsys):
    out = tmp_path / "cost.json"
    argv = ["bench", "--cost-curve", "--model", str(trained_dirs["dir"] / "mars"), "--contexts", "8,16"]
    assert main(argv + ["--batch-sizes", "1", "--repeats", "2", "--profile", "--json", str(out), "--quiet"]) == 0
    profile = json.loads(out.read_text())["profile"]
    assert set(profile) == {"1", "5"}  # the one-token step and a masked step at the checkpoint's B = 4
    for profiled in profile.values():
        assert profiled["context"] == 8 and profiled["ops"]
        ops = {op["op"]: op for op in profiled["ops"]}
        assert ops["aten::mm"]["calls"] >= 2 and all(op["ms"] >= 0 for op in ops.values())
        assert 0 < sum(op["share"] for op in ops.values()) <= 1 + 1e-9
    assert "eager step, width 5 (batch 1, context 8):" in capsys.readouterr().out


def test_bench_config_checks_what_its_mode_reads_when_made():
    from marslm.bench.config import BenchConfig
    from marslm.errors import UserError

    refused = [
        (dict(model="m"), "--ar-model is required"),
        (dict(model="m", ar_model="a", contenders=["cursor", "nope"]), "unknown contender group(s) nope"),
        (dict(model="m", ar_model="a", max_new_tokens=0), "--max-new-tokens must be >= 1, got 0"),
        (dict(model="m", ar_model="a", taus=[1.5]), "tau for the prob metric must be in (0, 1]"),
        (dict(model="m", ar_model="a", batch_sizes=[]), "every --batch-sizes value must be >= 1"),
        (dict(model="m", cost_curve=True, contexts=[0]), "every --contexts value and --block-size must be >= 1"),
        (dict(train_step=True), "exactly one of --model or --shape"),
        (dict(train_step=True, shape="smollm2-135m", prompt_share=1.0), "--prompt-share must be in [0, 1), got 1.0"),
        (dict(train_step=True, shape="smollm2-135m", seq_lens=[1]), "every --seq-lens value must be >= 2"),
        (dict(train_step=True, shape="smollm2-135m", dtype="bfloat16"), "--train-step keeps float32"),
    ]
    for settings, fragment in refused:
        with pytest.raises(UserError) as info:
            BenchConfig(**settings)
        assert fragment in str(info.value), settings
    BenchConfig(model="m", cost_curve=True)  # the cost curve has no AR baseline
    BenchConfig(train_step=True, shape="smollm2-135m", max_new_tokens=0, contenders=["nope"])  # nor decoding


def test_contenders_carry_their_decoding_settings_built_once():
    from marslm.bench.config import BenchConfig
    from marslm.bench.contenders import default_contenders

    config = BenchConfig(model="m", ar_model="a", taus=[0.9], contenders=["block", "lossless-groups"], max_new_tokens=7)
    contenders = {c.name: c for c in default_contenders(config)}
    assert list(contenders) == [
        "HF generate (AR ckpt)",
        "MARS block16 tau=0.9",
        "MARS block32 tau=0.9",
        "MARS lossless +groups",
    ]
    assert contenders["HF generate (AR ckpt)"].params is None
    block = contenders["MARS block32 tau=0.9"]
    assert block.options == {"tau": 0.9, "cache": "block", "block_cache_size": 32}  # what the report shows
    assert (block.params.tau, block.params.max_new_tokens) == (0.9, 7)
    assert (block.decoder.cache, block.decoder.block_cache_size) == ("block", 32)
    groups = contenders["MARS lossless +groups"]
    assert (groups.params.mode, groups.params.max_new_tokens, groups.decoder.draft_groups) == ("lossless", 7, True)


def test_block_size_sets_every_mars_contenders_masks_and_names_them():
    from marslm.bench.config import BenchConfig
    from marslm.bench.contenders import default_contenders

    config = BenchConfig(model="m", ar_model="a", contenders=["lossless-groups"], block_size=2, compile=True)
    contenders = {c.name: c for c in default_contenders(config)}
    assert list(contenders) == [
        "HF generate (AR ckpt)",
        "MARS lossless +groups B=2",
        "MARS lossless +groups B=2 compiled",
        "HF generate static+compile (AR ckpt)",
    ]
    for name in ("MARS lossless +groups B=2", "MARS lossless +groups B=2 compiled"):
        assert contenders[name].params.block_size == 2 and contenders[name].options["block_size"] == 2
    assert contenders["HF generate (AR ckpt)"].params is None


def test_hybrid_contenders_run_per_tau_with_and_without_draft_groups():
    from marslm.bench.config import BenchConfig
    from marslm.bench.contenders import default_contenders

    config = BenchConfig(model="m", ar_model="a", taus=[0.9, 0.8], contenders=["hybrid", "hybrid-groups"])
    contenders = {c.name: c for c in default_contenders(config)}
    assert list(contenders)[1:] == [
        "MARS hybrid tau=0.9",
        "MARS hybrid +groups tau=0.9",
        "MARS hybrid tau=0.8",
        "MARS hybrid +groups tau=0.8",
    ]
    groups = contenders["MARS hybrid +groups tau=0.8"]
    assert (groups.params.mode, groups.params.tau, groups.decoder.draft_groups) == ("hybrid", 0.8, True)
    assert not contenders["MARS hybrid tau=0.9"].decoder.draft_groups
