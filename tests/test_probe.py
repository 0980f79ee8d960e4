"""The probe (marslm/eval/probe.py) against a literal computation: what decoding feeds, one block at a time."""

from __future__ import annotations

import json

import pytest
import torch

from marslm.chat import IGNORE, encode_conversation
from marslm.cli import main
from marslm.eval.probe import Measurements, measure, probe, summarise
from marslm.eval.probe_items import ProbeItem, load_probe_items
from tests.helpers import chat_conversations

B = 4
MASK_ID = 3  # tiny_tokenizer's <|mask|>


def distill_records(tokenizer, n=8):
    """Records shaped like a distill output, with prompts of every length modulo B; one answer cut
    short (unfinished), one without answer_ids (its text is the reference)."""
    records = []
    for i, messages in enumerate(chat_conversations(n, seed=1)):
        messages[0]["content"] += " Please" * i
        enc = encode_conversation(tokenizer, messages)
        answer = [t for t in enc.labels if t != IGNORE][:-1]  # the stop token excluded, as distill writes it
        record = {"id": f"q{i}", "source": "plus" if "plus" in messages[0]["content"] else "minus"}
        record["messages"] = messages
        if i == 1:
            record.update(answer_ids=answer[:5], finished=False)
        elif i != 2:
            record.update(answer_ids=answer, finished=True)
        records.append(record)
    return records


@pytest.fixture(scope="module")
def data(tiny_tokenizer, make_tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in distill_records(tiny_tokenizer)))
    items = load_probe_items(path, tiny_tokenizer)
    return make_tiny_model(), items, path


def test_items_are_the_training_encoding_with_the_reference_answer(tiny_tokenizer, data):
    _, items, _ = data
    records = {r["id"]: r for r in distill_records(tiny_tokenizer)}
    eot = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(items) == len(records)
    for item in items:
        record = records[item.id]
        enc = encode_conversation(tokenizer=tiny_tokenizer, messages=record["messages"])
        assert item.prompt_ids == enc.input_ids[: len(item.prompt_ids)]
        assert enc.labels[len(item.prompt_ids) - 1] == IGNORE != enc.labels[len(item.prompt_ids)]
        if "answer_ids" not in record:
            assert item.answer_ids == enc.labels[len(item.prompt_ids) :]
        else:
            assert item.answer_ids == record["answer_ids"] + ([eot] if record["finished"] else [])
    assert len({len(it.prompt_ids) % B for it in items}) == B  # the first answer block starts at every offset


def test_a_limit_takes_the_same_items_whatever_order_the_file_holds_them_in(tiny_tokenizer, data, tmp_path):
    """A batched distill writes short answers first: the first N lines are not a sample."""
    _, items, path = data
    lines = path.read_text().splitlines(keepends=True)
    backwards = tmp_path / "backwards.jsonl"
    backwards.write_text("".join(reversed(lines)))
    assert [it.id for it in load_probe_items(backwards, tiny_tokenizer)] == [it.id for it in items]
    assert [it.id for it in load_probe_items(backwards, tiny_tokenizer, limit=3)] == [it.id for it in items[:3]]


@torch.no_grad()
def test_every_offset_equals_a_plain_forward_of_the_prefix_and_its_masks(data):
    """Block by block: ``prompt + answer[:s] + [mask] * B`` through a plain causal forward (what
    decoding feeds) gives each offset's top-1, confidence and cross-entropy; ``prompt + answer``
    gives the clean stream's top-1."""
    model, items, _ = data
    m = measure(model, items, block_size=B, mask_token_id=MASK_ID, batch_size=3)
    compared = 0
    for b in range(len(m.valid)):
        item, s = items[int(m.item[b])], int(m.start[b])
        seq = item.prompt_ids + item.answer_ids
        logits = model(input_ids=torch.tensor([seq[:s] + [MASK_ID] * B])).logits[0]
        for j in range(B + 1):
            if not m.valid[b, j]:
                continue
            out = logits[s - 1 + j].float()
            probs = out.softmax(-1)
            assert int(m.token[b, j]) == int(probs.argmax()), (b, j)
            assert abs(float(m.conf[b, j]) - float(probs.max())) < 1e-5
            target = torch.tensor(seq[s + j])
            assert abs(float(m.ce[b, j]) - float(torch.nn.functional.cross_entropy(out, target))) < 1e-4
            assert bool(m.correct[b, j]) == (int(probs.argmax()) == seq[s + j])
            compared += 1
    # every answer block once; each mask with a reference token after it at exactly one offset
    for i, item in enumerate(items):
        P, L = len(item.prompt_ids), len(item.prompt_ids) + len(item.answer_ids)
        starts = sorted(int(s) for s in m.start[m.item == i])
        assert starts == [max(k * B, P) for k in range(P // B, (L - 1) // B + 1)]
        assert int(m.valid[m.item == i, 1:].sum()) == L - 1 - P
    assert compared == int(m.valid.sum()) > 60
    for item, clean in zip(items, m.clean_token):
        seq = item.prompt_ids + item.answer_ids
        plain = model(input_ids=torch.tensor([seq])).logits[0].argmax(-1)
        assert clean.tolist() == plain[len(item.prompt_ids) - 1 : -1].tolist()


def _synthetic(conf, valid, matches):
    """Two blocks of B=4 with given confidences / validity / clean matches at offsets 0..4."""
    conf, valid, matches = torch.tensor(conf), torch.tensor(valid), torch.tensor(matches)
    return Measurements(
        block_size=4,
        item=torch.tensor([0, 0]),
        start=torch.tensor([8, 12]),
        valid=valid,
        token=torch.zeros(2, 5, dtype=torch.long),
        conf=conf,
        correct=valid & (conf > 0.95),
        ce=torch.ones(2, 5),
        matches_clean=valid & matches,
        clean_token=[torch.tensor([5, 6])],
        clean_ce=[torch.tensor([0.5, 1.5])],
    )


def test_tokens_per_forward_counts_leading_passes_over_the_first_b_minus_1_masks():
    T, F = True, False
    m = _synthetic(
        # offset 0 (AR), masks 1..3, the last mask (4): never a candidate of the paper's sampler
        conf=[[0.5, 0.99, 0.99, 0.99, 1.0], [0.2, 1.0, 0.93, 1.0, 1.0]],  # 1.0: what float32 can round to
        valid=[[T, T, T, T, T], [T, T, T, F, F]],  # the answer ends inside the second block
        matches=[[T, T, T, T, T], [T, F, T, T, T]],
    )
    item = ProbeItem("a", "s", [1, 2], [5, 7])
    report = summarise([item], m, taus=(0.9, 0.95, 1.0))
    assert report["tokens_per_forward_paper_tf"] == {"0.9": 3.5, "0.95": 3.0, "1": 1.0}
    assert report["tokens_per_forward_lossless_tf"] == 2.5
    assert report["offsets"][1]["n"] == 2 and report["offsets"][1]["top1_accuracy"] == 1.0
    assert report["offsets"][2]["top1_accuracy"] == 0.5
    assert report["offsets"][2]["confident"]["0.9"] == {"share": 1.0, "precision": 0.5}
    assert report["offsets"][2]["confident"]["0.95"] == {"share": 0.5, "precision": 1.0}
    assert report["offsets"][3]["n"] == 1 and report["offsets"][4]["n"] == 1
    assert report["fidelity"]["top1_agreement"] == 0.5 and report["fidelity"]["mean_agreeing_prefix"] == 1
    assert report["clean_ce"] == 1.0


def test_probe_reports_every_key(data):
    model, items, _ = data
    report = probe(model, items, block_size=B, mask_token_id=MASK_ID, taus=(0.5, 0.95))
    assert report["items"] == len(items) and report["block_size"] == B
    assert [o["offset"] for o in report["offsets"]] == list(range(B + 1))
    assert set(report["tokens_per_forward_paper_tf"]) == {"0.5", "0.95"}
    assert report["tokens_per_forward_paper_tf"]["0.5"] >= report["tokens_per_forward_paper_tf"]["0.95"] >= 1.0
    assert set(report["fidelity"]["by_source"]) == {"plus", "minus"}
    assert sum(s["answer_tokens"] for s in report["fidelity"]["by_source"].values()) == report["answer_tokens"]


@pytest.fixture(scope="module")
def distilled(tiny_model_dir, tmp_path_factory):
    """The tiny model's own greedy answers, written by ``marslm distill`` (finished and unfinished files)."""
    from marslm.distill import Prompt, distill
    from marslm.modeling import load_model

    model, tokenizer, _ = load_model(str(tiny_model_dir))
    prompts = [Prompt(f"q{i}", "toy", m[:1]) for i, m in enumerate(chat_conversations(6, seed=2))]
    path = tmp_path_factory.mktemp("distilled") / "heldout.jsonl"
    distill(model, tokenizer, prompts, path, max_new_tokens=12, progress=False)
    return path


def test_cli_probe_json_table_and_original(tiny_model_dir, distilled, tmp_path, capsys):
    out = tmp_path / "probe.json"
    args = ["probe", "--model", str(tiny_model_dir), "--data", str(distilled), "--tau", "0.8", "0.9"]
    assert main(args + ["--json", "--out", str(out), "--original", str(tiny_model_dir)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["items"] == 6 and printed["block_size"] == 4 and printed["mask_token_id"] == MASK_ID
    # teacher-forced greedy decoding of the model's own greedy answers agrees everywhere
    assert printed["fidelity"]["top1_agreement"] == 1.0 and printed["fidelity"]["items_all_agree"] == 1.0
    assert set(printed["tokens_per_forward_paper_tf"]) == {"0.8", "0.9"}
    assert printed["tokens_per_forward_lossless_tf"] >= 1.0
    # the same weights in bf16: near, not necessarily at, full agreement
    assert 0.5 <= printed["original_bf16"]["fidelity"]["top1_agreement"] <= 1.0

    # the comma-separated list eval and bench take, the same thresholds
    commas = ["probe", "--model", str(tiny_model_dir), "--data", str(distilled), "--tau", "0.8,0.9", "--limit", "2"]
    assert main(commas + ["--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["tokens_per_forward_paper_tf"]) == {"0.8", "0.9"}

    assert main(args + ["--limit", "2"]) == 0
    table = capsys.readouterr().out
    assert "2 items" in table and "fidelity (clean top-1 = reference): 100.0%" in table
    assert "| offset | predicts |" in table and "paper rule tau 0.8" in table and "lossless" in table


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "missing.jsonl"], "data file not found"),
        (["--tau", "1.5"], "tau for the prob metric"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
    ],
)
def test_cli_probe_refuses_bad_input_in_one_line(tiny_model_dir, data, extra, message, capsys):
    _, _, path = data
    args = ["probe", "--model", str(tiny_model_dir), "--data", str(path)]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_probe_without_a_mask_token_reports_fidelity_only(make_tiny_model, distilled, tmp_path, capsys):
    """An AR checkpoint (no <|mask|>): its clean stream is all there is to probe, so the probe
    measures that instead of refusing."""
    from tests.helpers import save_model_dir
    from tests.test_train import tokenizer_without_mask

    model_dir = save_model_dir(make_tiny_model(seed=0), tokenizer_without_mask(), tmp_path / "ar")
    args = ["probe", "--model", str(model_dir), "--data", str(distilled)]
    assert main(args + ["--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["mask_token_id"] is None and "offsets" not in printed
    assert printed["fidelity"]["items"] == 6 and 0 <= printed["fidelity"]["top1_agreement"] <= 1
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "6 items" in table and "fidelity (clean top-1 = reference)" in table and "| offset |" not in table
