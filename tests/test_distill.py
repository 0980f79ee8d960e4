"""`marslm distill`: the model's own greedy answers as chat JSONL, resumable; the instruction set."""

import json

import pytest

import marslm
from marslm.cli import main
from marslm.data import instructions, load_conversations
from marslm.data.distilled import done_ids, read_answers, unfinished_path
from marslm.distill import distill, load_prompts

SPEC = "instructions:4,toy:2"


def test_instruction_splits_are_disjoint_deterministic_and_varied():
    train = instructions.make_split("train", 300, seed=0)
    test = instructions.make_split("test", 40, seed=0)
    prompts = [x.messages[0]["content"] for x in train]
    assert len(set(prompts)) == 300
    assert not set(prompts) & {x.messages[0]["content"] for x in test}
    assert all(instructions.split_of(p) == "train" for p in prompts)
    assert [x.id for x in instructions.make_split("train", 300, seed=0)] == [x.id for x in train]
    assert [x.id for x in instructions.make_split("train", 30, seed=0)] == [x.id for x in train[:30]]
    assert {x.family for x in train} == set(instructions.FAMILIES)
    assert instructions.make_split("train", 20, seed=1)[0].id != train[0].id


def test_distill_writes_greedy_answers_and_resumes(trained_dirs, tmp_path):
    from marslm.modeling import load_model

    model, tokenizer, _ = load_model(str(trained_dirs["dir"] / "ar"))
    prompts = load_prompts(SPEC, "train")
    assert [p.source for p in prompts] == ["instructions"] * 4 + ["toy"] * 2
    out = tmp_path / "distill.jsonl"

    first = distill(model, tokenizer, prompts[:3], out, max_new_tokens=24, batch_size=2, progress=False)
    assert first == {"done": 0, "new": 3, "unfinished": first["unfinished"]}
    # a run killed mid-write leaves half a line: it is dropped and that answer redone
    with out.open("a") as f:
        f.write('{"id": "' + prompts[3].id + '", "messa')
    second = distill(model, tokenizer, prompts, out, max_new_tokens=24, batch_size=2, progress=False)
    assert (second["done"], second["new"]) == (3, 3)
    assert distill(model, tokenizer, prompts, out, max_new_tokens=24, batch_size=2, progress=False)["new"] == 0
    assert done_ids(out) == {p.id for p in prompts}

    # each answer is the model's greedy answer (the oracle: marslm.generate at tau 1 on its own)
    records = read_answers(out)
    greedy = marslm.generate(
        model,
        tokenizer,
        [p.messages for p in prompts],
        tau=1.0,
        max_new_tokens=24,
        mask_token_id=tokenizer.eos_token_id,
    )
    for prompt, ids in zip(prompts, greedy.token_ids):
        record = records[prompt.id]
        assert record["answer_ids"] == ids
        assert record["messages"][:-1] == prompt.messages and record["messages"][-1]["role"] == "assistant"
        assert record["finished"] == (len(ids) < 24)
    # cut answers are kept apart: trained on, they would end in an end-of-turn the model never said
    finished = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["finished"] for r in finished)
    if unfinished_path(out).exists():
        assert not any(json.loads(line)["finished"] for line in unfinished_path(out).read_text().splitlines())
    # and `marslm train` reads the file as chat data
    assert load_conversations(str(out)) == [r["messages"] for r in finished]


def test_distill_cli_and_bad_prompt_specs(trained_dirs, tmp_path, capsys):
    out = tmp_path / "d.jsonl"
    assert (
        main(
            [
                "distill",
                "--model",
                str(trained_dirs["dir"] / "ar"),
                "--output",
                str(out),
                "--prompts",
                "toy:2",
                "--max-new-tokens",
                "8",
                "--quiet",
            ]
        )
        == 0
    )
    assert "2 of 2 prompts answered" in capsys.readouterr().out
    for spec in ("toy:x", "toy:0", "nonsense", ","):
        assert (
            main(["distill", "--model", str(trained_dirs["dir"] / "ar"), "--output", str(out), "--prompts", spec]) == 2
        )
        err = capsys.readouterr().err
        assert err.startswith("marslm distill: error: --prompts") and err.count("\n") == 1


@pytest.mark.parametrize("spec", ["instructions:3", "toy:2,instructions:2"])
def test_prompt_specs_from_a_file_and_sources(spec, tmp_path, write_chat_jsonl):
    assert len(load_prompts(spec)) == sum(int(part.split(":")[1]) for part in spec.split(","))
    path = write_chat_jsonl(tmp_path / "chat.jsonl", 3)
    from_file = load_prompts(str(path))
    assert [p.messages[-1]["role"] for p in from_file] == ["user"] * 3


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    prompts = load_prompts("toy:3")
    out = tmp_path / "d.jsonl"
    lines = [json.dumps({"id": p.id, "messages": p.messages, "finished": True}) for p in prompts]
    out.write_text("\n".join(lines))  # an editor, or a kill just before the newline, leaves the last one bare
    assert done_ids(out) == {p.id for p in prompts}
    # every prompt is answered, so nothing decodes: no model needed
    assert distill(None, None, prompts, out, progress=False) == {"done": 3, "new": 0, "unfinished": 0}
    assert out.read_text() == "\n".join(lines) + "\n"

    out.write_text("\n".join(lines)[:-5])  # cut inside the last record: that one is redone
    assert done_ids(out) == {p.id for p in prompts[:2]}


def test_bad_prompts_and_outputs_are_refused_before_any_file_is_written(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "assistant", "content": "an answer to nothing"}]})
        + "\n"
    )
    out = tmp_path / "out" / "d.jsonl"
    for output, prompts, fragment in (
        (out, data, "data.jsonl:2: the conversation opens with an answer"),
        (tmp_path, "toy:2", f"--output {tmp_path} is a directory"),
        (data / "d.jsonl", "toy:2", "data.jsonl is a file, not a directory"),
    ):
        rc = main(["distill", "--model", str(tiny_model_dir), "--output", str(output), "--prompts", str(prompts)])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("marslm distill: error: ") and err.count("\n") == 1, err
        assert fragment in err, err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]
