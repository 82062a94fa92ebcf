"""Story-like synthetic English, so the pipeline and tests run without any download.

A tiny template grammar: a hero (name + animal), a friend, a treasured object and a place are
introduced in the first sentences and come back in the middle and at the end. That gives the
text long-range structure (a model can only predict "Pip" in the last paragraph by looking
hundreds of tokens back), which is what length-extrapolation experiments probe. Stories run
about 100-400 words, so packed streams easily hold 512+ token windows.
"""

from __future__ import annotations

import random

NAMES = [
    "Lily", "Ben", "Tom", "Mia", "Sam", "Max", "Anna", "Leo", "Zoe", "Tim", "Sue", "Jack",
    "Emma", "Finn", "Rosa", "Kai", "Pip", "Ella", "Noah", "Ruby", "Otto", "Lucy", "Milo", "Ivy",
]
ANIMALS = [
    "cat", "dog", "bunny", "bird", "fox", "frog", "bear", "duck", "mouse", "turtle", "owl",
    "pig", "lamb", "squirrel",
]
PLACES = [
    "park", "forest", "garden", "beach", "farm", "river", "hill", "town", "lake", "meadow",
    "playground", "big tree",
]
OBJECTS = [
    "red ball", "blue kite", "little hat", "shiny shell", "old book", "toy car", "soft blanket",
    "gold key", "yellow boat", "magic stone", "green cup", "wooden flute",
]
ADJECTIVES = ["little", "happy", "small", "brave", "curious", "kind", "silly", "shy", "fluffy"]
FEELINGS = ["happy", "sad", "scared", "excited", "proud", "tired", "surprised", "worried"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy"]
ACTIONS = [
    "ran fast", "jumped high", "sang a song", "looked around", "danced in a circle",
    "laughed out loud", "sat down to rest", "ate a snack", "counted the clouds",
    "picked a flower", "climbed a rock", "splashed in a puddle",
]

OPENINGS = [
    "Once upon a time, there was a {adj} {animal} named {hero}.",
    "One {weather} day, a {adj} {animal} named {hero} woke up early.",
    "There once lived a {adj} {animal} called {hero}.",
]
SETUP = [
    "{hero} lived near the {place} with a friend named {friend}.",
    "{hero} had a {obj} that {he} loved very much.",
    "Every day, {hero} and {friend} played at the {place}.",
]
MIDDLE = [
    "{hero} {action}.",
    "{friend} {action}, and {hero} {action2}.",
    "The sky was {weather}, and {hero} felt {feeling}.",
    "\"{friend}, look at this!\" said {hero}.",
    "{friend} smiled and said, \"I like the {place}, {hero}.\"",
    "They walked past the {place2} and saw a {animal2}.",
    "The {animal2} said hello to {hero}.",
    "{hero} wanted to show the {obj} to {friend}.",
    "{he_cap} held the {obj} close and {action2}.",
    "{friend} asked, \"Where did you get the {obj}?\"",
    "\"My mom gave it to me,\" said {hero}.",
    "Then they {action}.",
    "{hero} was {feeling}, but {friend} was {feeling2}.",
    "After a while, they went back to the {place}.",
]
TROUBLE = [
    "But one day, the {obj} was gone! {hero} looked everywhere and felt {feeling}.",
    "Then a big wind came and took the {obj} away. {hero} cried, \"Oh no!\"",
    "Suddenly, {hero} could not find the {obj} anywhere.",
]
ENDINGS = [
    "At last, {friend} found the {obj} near the {place2} and gave it back to {hero}.",
    "In the end, {hero} found the {obj} under a leaf at the {place}.",
    "{friend} helped, and soon the {obj} was safe with {hero} again.",
]
MORALS = [
    "{hero} hugged {friend} and said, \"Thank you, {friend}. You are my best friend.\"",
    "From that day on, {hero} and {friend} always played together at the {place}.",
    "{hero} learned that friends help each other, and the {animal} was very happy.",
]


def _story(rng: random.Random) -> str:
    hero, friend = rng.sample(NAMES, 2)
    place, place2 = rng.sample(PLACES, 2)
    animal, animal2 = rng.sample(ANIMALS, 2)
    he = rng.choice(["he", "she"])
    slots = {
        "hero": hero, "friend": friend, "place": place, "place2": place2, "animal": animal,
        "animal2": animal2, "obj": rng.choice(OBJECTS), "adj": rng.choice(ADJECTIVES),
        "he": he, "he_cap": he.capitalize(),
    }

    def say(template: str) -> str:
        return template.format(
            weather=rng.choice(WEATHER), feeling=rng.choice(FEELINGS),
            feeling2=rng.choice(FEELINGS), action=rng.choice(ACTIONS),
            action2=rng.choice(ACTIONS), **slots,
        )

    target_words = rng.randint(100, 400)
    intro = [say(rng.choice(OPENINGS))] + [say(t) for t in SETUP]
    ending = [say(rng.choice(ENDINGS)), say(rng.choice(MORALS))]
    trouble = say(rng.choice(TROUBLE))
    budget = target_words - sum(len(s.split()) for s in intro + ending + [trouble])
    middle: list[str] = []
    while budget > 0:
        sentence = say(rng.choice(MIDDLE))
        middle.append(sentence)
        budget -= len(sentence.split())
    # trouble somewhere in the second half of the middle, so the ending refers far back
    middle.insert(len(middle) // 2 + rng.randint(0, max(0, len(middle) // 2)), trouble)
    sentences = intro + middle + ending
    paragraphs, i = [], 0
    while i < len(sentences):
        n = rng.randint(3, 6)
        paragraphs.append(" ".join(sentences[i : i + n]))
        i += n
    return "\n".join(paragraphs)


def generate_stories(n: int, seed: int = 0, split: str = "train") -> list[str]:
    """``n`` synthetic stories, a pure function of ``(seed, split)``; splits never share a
    random stream, so train and validation text differ."""
    rng = random.Random(f"posbench-synthetic-{seed}-{split}")
    return [_story(rng) for _ in range(n)]
