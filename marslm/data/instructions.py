"""A procedurally generated set of short, everyday instructions for self-distillation.

MARS on a pretrained instruct model trains on the model's own greedy answers (marslm/distill.py),
so what this set needs is not reference answers but *prompts*: varied, short, and of the kind a
small instruct model answers fluently (SmolLM2-135M-Instruct: lists, rewrites, simple facts,
small word problems, definitions, formatting, one-sentence writing). Each family draws a template
and fills its slots from small word pools, so a few hundred templates x pools give thousands of
distinct prompts from a seed.

Splits are disjoint by construction, as in the toy suite: a prompt belongs to the test split when
the hash of its text falls in one bucket of ten, and generation for a split redraws prompts of the
other one. Ids are ``<family>-<hash>``, stable across runs and machines.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

SPLITS = ("train", "test")
TEST_BUCKETS = 10
MAX_DRAWS_PER_PROMPT = 200


@dataclass(frozen=True)
class Instruction:
    id: str
    family: str
    messages: list[dict]  # the user turn only; the answer is the model's own


# ---------------------------------------------------------------------------- word pools

_COUNTS = {2: "two", 3: "three", 4: "four", 5: "five"}
_NAMES = ("Tom", "Anna", "Sam", "Maria", "Leo", "Zoe", "Ben", "Eva", "Max", "Lily", "Raj", "Nina", "Omar", "Paul")
_LIST_TOPICS = (
    "fruits",
    "vegetables",
    "colors",
    "farm animals",
    "wild animals",
    "birds",
    "ocean animals",
    "insects",
    "musical instruments",
    "sports",
    "kitchen tools",
    "jobs",
    "planets",
    "breakfast foods",
    "flowers",
    "board games",
    "things you find in a classroom",
    "ways to save water",
    "tips for better sleep",
    "reasons to exercise",
    "healthy snacks",
    "things to pack for a beach trip",
    "hobbies",
    "countries in Europe",
    "countries in Asia",
    "languages",
    "pieces of furniture",
    "types of weather",
    "things that are cold",
    "things that are round",
    "school subjects",
    "ways to be kind",
    "things to do on a rainy day",
    "kinds of trees",
    "clothes for winter",
    "vehicles",
    "body parts",
    "shapes",
    "desserts",
    "drinks",
)
_CAPITALS = (
    "France",
    "Germany",
    "Italy",
    "Spain",
    "Japan",
    "China",
    "India",
    "Canada",
    "Brazil",
    "Egypt",
    "Kenya",
    "Mexico",
    "Russia",
    "Australia",
    "Greece",
    "Portugal",
    "Norway",
    "Sweden",
    "Poland",
    "Ireland",
    "Turkey",
    "Peru",
    "Argentina",
    "Thailand",
    "Vietnam",
    "the United Kingdom",
)
_FACT_QUESTIONS = (
    "How many days are in a week?",
    "How many hours are in a day?",
    "How many minutes are in an hour?",
    "How many months are in a year?",
    "How many legs does a spider have?",
    "How many legs does a dog have?",
    "What color is the sky on a clear day?",
    "What color are bananas?",
    "What color is grass?",
    "What is the largest ocean on Earth?",
    "Which planet is known as the Red Planet?",
    "What do bees make?",
    "What is the freezing point of water in Celsius?",
    "What is the boiling point of water in Celsius?",
    "Which animal is known as the king of the jungle?",
    "What gas do plants take in from the air?",
    "What is the closest star to Earth?",
    "How many continents are there?",
    "What is the largest planet?",
    "What do caterpillars turn into?",
    "Which season comes after winter?",
    "What is the tallest animal?",
    "What do we call frozen water?",
    "How many sides does a triangle have?",
    "How many sides does a square have?",
    "What is the main language spoken in Brazil?",
    "Which organ pumps blood through the body?",
    "What is the opposite of north?",
    "What do cows drink?",
    "What is the color of a ripe tomato?",
    "How many seconds are in a minute?",
    "How many wheels does a bicycle have?",
    "What is the largest desert?",
    "Which animal gives us wool?",
    "What do plants need to grow?",
    "Which planet do we live on?",
    "How many players are on a soccer team?",
    "What is the fastest land animal?",
    "What shape has three sides?",
    "Which bird is a symbol of peace?",
    "What is the longest river in Africa?",
    "What do you call a baby cat?",
    "What do you call a baby dog?",
    "How many days are in a year?",
    "What is the hottest planet?",
    "Which instrument has black and white keys?",
    "What is the main ingredient in bread?",
    "Which sense do we use our ears for?",
    "What is the capital of the United States?",
    "What do fish breathe with?",
)
_TERMS = (
    "a noun",
    "a verb",
    "an adjective",
    "a planet",
    "a volcano",
    "a rainbow",
    "photosynthesis",
    "gravity",
    "a computer",
    "a recipe",
    "a habitat",
    "a molecule",
    "a budget",
    "a library",
    "an island",
    "a desert",
    "a poem",
    "a museum",
    "a map",
    "a calendar",
    "an email",
    "a password",
    "electricity",
    "a cloud",
    "a river",
    "a vaccine",
    "a battery",
    "a dictionary",
    "a mammal",
    "a fraction",
    "friendship",
    "a hobby",
    "a season",
    "an orchestra",
    "a telescope",
    "recycling",
    "a thermometer",
    "a forest",
    "a bridge",
    "a verb tense",
    "a pronoun",
    "a sentence",
    "a paragraph",
    "a synonym",
    "an antonym",
    "a planet's orbit",
    "an earthquake",
    "a glacier",
    "a hurricane",
    "a skeleton",
    "a muscle",
    "a cell",
    "an atom",
    "a magnet",
    "a lever",
    "a wheel",
    "a calculator",
    "a website",
    "a spreadsheet",
    "a keyboard",
    "a robot",
    "a satellite",
    "a rocket",
    "a compass",
    "a farmer",
    "a pilot",
    "a nurse",
    "a chef",
    "an election",
    "a law",
    "a tax",
    "a bank",
    "a market",
    "a coin",
    "a habit",
    "a goal",
    "a plan",
    "a schedule",
    "a team",
    "a neighbourhood",
    "a festival",
    "a tradition",
)
_TOPICS = (
    "the ocean",
    "autumn",
    "a cat",
    "the moon",
    "a rainy day",
    "friendship",
    "a mountain",
    "coffee",
    "the city at night",
    "a garden",
    "winter",
    "a dog",
    "the sun",
    "a library",
    "music",
    "a train ride",
    "the first day of school",
    "a birthday party",
    "a lost key",
    "a robot",
    "the forest",
    "snow",
    "a summer holiday",
    "a bicycle",
    "the stars",
    "a small village",
    "breakfast",
    "a river",
    "a thunderstorm",
    "a busy market",
    "an old house",
    "a lighthouse",
    "the desert",
    "a school trip",
    "a football match",
    "a cup of tea",
    "a snowy morning",
    "a quiet beach",
    "a new friend",
    "a kite",
    "a museum visit",
    "the spring",
    "a picnic",
    "a clock",
    "a bakery",
    "an island",
    "a hot day",
    "a puppy",
)
_ADJECTIVES = (
    "hot",
    "big",
    "happy",
    "fast",
    "dark",
    "old",
    "easy",
    "loud",
    "strong",
    "early",
    "full",
    "rich",
    "soft",
    "high",
    "wet",
    "young",
    "clean",
    "heavy",
    "near",
    "bright",
    "quiet",
    "long",
    "cheap",
    "cold",
    "small",
    "sad",
    "slow",
    "light",
    "new",
    "hard",
    "brave",
    "calm",
    "kind",
    "sharp",
    "thin",
    "warm",
    "wide",
    "deep",
    "sweet",
    "funny",
    "polite",
    "busy",
    "simple",
)
_ITEMS = ("apples", "pencils", "books", "cookies", "marbles", "stickers", "oranges", "cards", "balloons", "eggs")
_GOALS = (
    "staying focused while studying",
    "drinking more water",
    "saving money",
    "learning a new language",
    "keeping a room tidy",
    "sleeping better",
    "making new friends",
    "staying healthy in winter",
    "writing a good essay",
    "being on time",
    "reducing stress",
    "eating more vegetables",
    "reading more books",
    "waking up early",
    "keeping a plant alive",
    "preparing for an exam",
    "cooking a simple dinner",
    "staying safe online",
    "giving a short speech",
    "planning a trip",
    "exercising at home",
    "remembering names",
    "working in a team",
    "keeping a diary",
)
_SUBJECTS = ("a friend", "your teacher", "a neighbour", "your manager", "a classmate", "your grandmother")
_EMAIL_REASONS = (
    "to say thank you for a gift",
    "to ask for a meeting next week",
    "to invite them to a party",
    "to say you will be late",
    "to ask for help with homework",
    "to share some good news",
)
_SENTENCES = (
    "{name} walks to school every morning.",
    "{name} eats an apple after lunch.",
    "{name} plays the piano.",
    "{name} reads a book before bed.",
    "{name} cleans the kitchen on Sundays.",
    "{name} visits the park.",
    "{name} writes a letter to a friend.",
    "{name} cooks dinner for the family.",
    "{name} waters the plants.",
    "{name} watches a movie with friends.",
    "{name} buys bread at the bakery.",
    "{name} rides a bike to work.",
)
_INFORMAL = (
    "gimme the report asap.",
    "can u send me the file?",
    "we gotta fix this now.",
    "hey, what's up with the meeting?",
    "i dunno where the keys are.",
    "this stuff is super cool.",
)
_MISSPELLED = (
    "I beleive it will rain tomorow.",
    "She recieved a leter yesterday.",
    "We went to the libary.",
    "The wether is nice todday.",
    "He is verry happy.",
    "They definately liked the food.",
)


def _count(rng: random.Random) -> str:
    return _COUNTS[rng.randint(2, 5)]


# ---------------------------------------------------------------------------- families


def _lists(rng: random.Random) -> str:
    n, topic = _count(rng), rng.choice(_LIST_TOPICS)
    return rng.choice(
        (
            f"List {n} {topic}.",
            f"Name {n} {topic}.",
            f"Give me {n} examples of {topic}.",
            f"Write a numbered list of {n} {topic}.",
            f"What are {n} common {topic}?",
            f"Make a bulleted list of {n} {topic}.",
        )
    )


def _rewrite(rng: random.Random) -> str:
    sentence = rng.choice(_SENTENCES).format(name=rng.choice(_NAMES))
    kind = rng.randrange(6)
    if kind == 0:
        return f"Rewrite this sentence in the past tense: {sentence}"
    if kind == 1:
        return f"Rewrite this sentence in the future tense: {sentence}"
    if kind == 2:
        return f"Make this sentence more formal: {rng.choice(_INFORMAL)}"
    if kind == 3:
        return f"Correct the spelling in this sentence: {rng.choice(_MISSPELLED)}"
    if kind == 4:
        return f"Rewrite this sentence as a question: {sentence}"
    return f"Write this sentence in all capital letters: {sentence}"


def _facts(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return rng.choice(
            ("What is the capital of {c}?", "Name the capital city of {c}.", "Which city is the capital of {c}?")
        ).format(c=rng.choice(_CAPITALS))
    return rng.choice(_FACT_QUESTIONS)


def _word_problem(rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 12)
    kind = rng.randrange(6)
    if kind == 0:
        return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
    if kind == 1:
        a = max(a, b + 1)
        return f"{name} had {a} {item} and gave {b} to a friend. How many {item} are left?"
    if kind == 2:
        a = rng.randint(2, 9)
        return f"There are {a} boxes with {b} {item} in each box. How many {item} are there in total?"
    if kind == 3:
        return f"One {item[:-1]} costs {a} dollars. How much do {b} of them cost?"
    if kind == 4:
        return f"What is {a} plus {b}?"
    return f"What is {rng.randint(2, 9)} times {rng.randint(2, 9)}?"


def _definition(rng: random.Random) -> str:
    term = rng.choice(_TERMS)
    return rng.choice(
        (
            f"What is {term}?",
            f"Define {term} in one sentence.",
            f"Explain what {term} is in simple words.",
            f"Describe {term} to a child.",
        )
    )


def _formatting(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice(
            (
                "Write the days of the week as a numbered list.",
                "Write the months of the year as a comma-separated list.",
                "Write the numbers from one to ten in words.",
                "Write the first five letters of the alphabet, one per line.",
            )
        )
    if kind == 1:
        return f"Write a short shopping list with {_count(rng)} items."
    if kind == 2:
        words = rng.sample(_ADJECTIVES, 3)
        return f"Turn these words into a comma-separated list: {' '.join(words)}"
    if kind == 3:
        return f"Give a title for a short story about {rng.choice(_TOPICS)}."
    if kind == 4:
        return f"Write a short email to {rng.choice(_SUBJECTS)} {rng.choice(_EMAIL_REASONS)}."
    return f"Write a haiku about {rng.choice(_TOPICS)}."


def _writing(rng: random.Random) -> str:
    topic = rng.choice(_TOPICS)
    return rng.choice(
        (
            f"Write one sentence about {topic}.",
            f"Describe {topic} in two sentences.",
            f"Write a short poem about {topic}.",
            f"Tell me a fun fact about {topic}.",
            f"Write the first sentence of a story about {topic}.",
        )
    )


def _words(rng: random.Random) -> str:
    adjective = rng.choice(_ADJECTIVES)
    return rng.choice(
        (
            f"What is the opposite of '{adjective}'?",
            f"Give a synonym for '{adjective}'.",
            f"Use the word '{adjective}' in a sentence.",
            f"Give two words that rhyme with '{adjective}'.",
        )
    )


def _advice(rng: random.Random) -> str:
    goal = rng.choice(_GOALS)
    return rng.choice(
        (
            f"Give one tip for {goal}.",
            f"Give {_count(rng)} tips for {goal}.",
            f"Why is {goal} useful? Answer in one sentence.",
        )
    )


FAMILIES: dict[str, Callable[[random.Random], str]] = {
    "lists": _lists,
    "rewrite": _rewrite,
    "facts": _facts,
    "word_problem": _word_problem,
    "definition": _definition,
    "formatting": _formatting,
    "writing": _writing,
    "words": _words,
    "advice": _advice,
}


# ---------------------------------------------------------------------------- splits


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_of(prompt: str) -> str:
    return "test" if int(_digest(prompt)[:8], 16) % TEST_BUCKETS == 0 else "train"


def make_split(split: str, n: int, seed: int = 0) -> list[Instruction]:
    """``n`` distinct instructions of ``split``, the families in turn (round robin), from ``seed``.

    Raises ValueError when the pools run out before ``n`` distinct prompts are found.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"instructions-{split}-{seed}")
    families = list(FAMILIES)
    seen: set[str] = set()
    out: list[Instruction] = []
    for i in range(n):
        family = families[i % len(families)]
        for _ in range(MAX_DRAWS_PER_PROMPT):
            prompt = FAMILIES[family](rng)
            if prompt not in seen and split_of(prompt) == split:
                break
        else:
            prompt = None
            # this family's pool is used up: the next families in turn, so no one family takes over
            for other in families[i % len(families) + 1 :] + families[: i % len(families)]:
                for _ in range(MAX_DRAWS_PER_PROMPT):
                    candidate = FAMILIES[other](rng)
                    if candidate not in seen and split_of(candidate) == split:
                        family, prompt = other, candidate
                        break
                if prompt is not None:
                    break
            if prompt is None:
                raise ValueError(f"only {len(out)} distinct {split} instructions could be drawn, asked for {n}")
        seen.add(prompt)
        out.append(Instruction(f"{family}-{_digest(prompt)[:12]}", family, [{"role": "user", "content": prompt}]))
    return out
