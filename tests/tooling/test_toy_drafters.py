"""scripts/toy_drafters.py at --quick sizes on a stand-in demo folder (its marker and a tokenizer in
ar/, all the script reads): a drafter a quarter as wide, trained AR then MARS, that a target with
the demo's tokenizer accepts."""

import json
import sys
from dataclasses import asdict
from pathlib import Path

from marslm import generate
from marslm.demo.presets import resolve_preset
from marslm.demo.toy import DEMO_MARKER
from marslm.demo.toy_model import MODEL_SIZES
from marslm.mars_json import MarsConfig
from marslm.modeling import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import toy_drafters  # noqa: E402


def test_quick_drafters_are_a_quarter_as_wide_and_draft_for_the_demo_tokenizer(
    tmp_path, tiny_tokenizer, make_tiny_model, capsys
):
    demo = tmp_path / "demo"
    tiny_tokenizer.save_pretrained(demo / "ar")
    (demo / DEMO_MARKER).write_text(json.dumps({"preset": asdict(resolve_preset("quick"))}))
    assert toy_drafters.main([str(demo), "--quick", "--quiet"]) == 0

    target = MODEL_SIZES[resolve_preset("quick").model]
    for stage in ("ar", "mars"):
        drafter, tokenizer, config = load_model(str(demo / f"drafter-{stage}"))
        assert config.stage == stage == MarsConfig.load(demo / f"drafter-{stage}").stage
        assert drafter.config.hidden_size == target.hidden_size // 4
        assert drafter.config.num_hidden_layers == target.num_hidden_layers
        assert tokenizer.get_vocab() == tiny_tokenizer.get_vocab()
    model, prompts = make_tiny_model(), [[1, 20, 30, 40]]
    plain = generate(model, tiny_tokenizer, prompts, max_new_tokens=6)
    drafted = generate(model, tiny_tokenizer, prompts, max_new_tokens=6, draft_model=drafter, draft_tokenizer=tokenizer)
    assert drafted.token_ids == plain.token_ids and drafted.stats.drafter_forwards > 0


def test_a_folder_without_a_demo_is_refused_in_one_line(tmp_path, capsys):
    assert toy_drafters.main([str(tmp_path), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "holds no demo output" in err and err.count("\n") == 1
