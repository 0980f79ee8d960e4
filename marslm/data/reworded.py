"""An off-distribution set: the toy suite's arithmetic and list tasks, worded as it never words them.

Speculative decoders are known to lose their speed-up on prompts unlike their training data; this
set measures that for MARS. It takes test-split items of the two families (so their content is
unseen too), keeps what the scorer checks (the result, the expected list) and rewrites the prompt
with framings and list renderings the training data never uses. Answers are scored by the toy
suite's own scorers, so a model that still answers in the trained format still gets credit.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace

from . import toy

FAMILIES = ("arithmetic", "lists")

_ARITHMETIC_FRAMES = (
    "Could you help me with this one? {story} Please explain how you get there.",
    "Here is a little puzzle for you.\n{story}\nWalk me through it.",
    'My kid brought this home from school: "{story}" What would the answer be?',
    "{story} I'd like to see the working, not just the result.",
)

_LIST_FRAMES = {
    "sort_ascending": "I have these numbers: {items}. Could you give them back from the smallest one up?",
    "sort_descending": "Starting with the biggest, how would you order {items}?",
    "sort_words": "Which order would {items} be in a dictionary?",
    "reverse": "Take {items} and give me the same items last-to-first.",
    "dedupe": "Some of {items} appear more than once; I only want each of them the first time it shows up.",
    "keep_even": "From {items}, which ones can be divided by two?",
    "keep_odd": "From {items}, which ones leave a remainder when halved?",
    "maximum": "Out of {items}, tell me which is the greatest.",
    "minimum": "Out of {items}, tell me which is the least.",
}


def _spoken_list(items: list) -> str:
    """``[3, 1, 2]`` -> ``3, 1 and 2``: the training data always shows bracketed lists."""
    words = [str(x) for x in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _story_of(prompt: str) -> str:
    """The story part of a toy arithmetic prompt: the phrasing's lead-in, if any, removed."""
    for phrasing in toy._ARITHMETIC_PHRASINGS:
        lead = phrasing.replace("{story}", "")
        if lead and prompt.startswith(lead):
            return prompt[len(lead) :]
    return prompt


def make_split(n: int, seed: int = 0) -> list[toy.Example]:
    """``n`` reworded test-split items, arithmetic and lists alternating."""
    rng = random.Random(seed)
    source = toy.make_split("test", 2 * n + 16, seed=seed, families=FAMILIES)
    out = []
    for example in source:
        if len(out) == n:
            break
        prompt = example.messages[-1]["content"]
        if example.family == "arithmetic":
            text = rng.choice(_ARITHMETIC_FRAMES).format(story=_story_of(prompt))
        else:
            items = re.search(r"\[(.*)\]", prompt)
            if items is None:
                continue
            listed = [part.strip() for part in items.group(1).split(",")]
            text = _LIST_FRAMES[example.meta["op"]].format(items=_spoken_list(listed))
        out.append(replace(example, id=example.id + "-reworded", messages=[{"role": "user", "content": text}]))
    return out
