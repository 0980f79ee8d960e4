"""The off-distribution set: unseen content, unseen wording, the toy scorers still apply."""

from marslm.data import reworded, toy
from marslm.eval.sets import load_eval_set


def test_reworded_items_are_new_prompts_for_known_tasks():
    items = reworded.make_split(60, seed=3)
    assert len(items) == 60 and {e.family for e in items} == {"arithmetic", "lists"}
    assert all(toy.score_many(items, [e.answer for e in items]))  # references still pass
    assert not any(toy.score_many(items, ["no idea"] * len(items)))
    trained_prompts = {e.messages[-1]["content"] for e in toy.make_split("train", 4000, families=reworded.FAMILIES)}
    tested_prompts = {e.messages[-1]["content"] for e in toy.make_split("test", 200, families=reworded.FAMILIES)}
    for item in items:
        prompt = item.messages[-1]["content"]
        assert prompt not in trained_prompts and prompt not in tested_prompts
        assert "[" not in prompt  # lists are spoken, never bracketed
    assert [e.id for e in reworded.make_split(60, seed=3)] == [e.id for e in items]  # deterministic


def test_eval_set_by_name():
    eval_set = load_eval_set("reworded", 10)
    assert eval_set.name == "reworded" and len(eval_set.examples) == 10
