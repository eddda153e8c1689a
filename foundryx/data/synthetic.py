"""A seeded synthetic corpus: English-like text about a small invented world.

A seed fixes a world of invented countries (capital, river, language, animal, flag colour)
and people (home city, trade, favourite food). Documents restate these facts in varied
templates and mix in small arithmetic, so a tiny model's loss falls quickly and an ICL eval
can later ask about the facts (:func:`world_facts`). Everything is deterministic for a seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

N_COUNTRIES = 16
N_PEOPLE = 32

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "qu", "r", "s",
           "st", "t", "th", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "nd", "rn", "th"]
_COUNTRY_ENDS = ["ia", "ar", "and", "onia", "el"]
_CITY_ENDS = ["port", "ford", "holm", "mere", "gate", "wick"]
_ANIMALS = ["fox", "heron", "otter", "lynx", "owl", "badger", "falcon", "stag", "hare", "crane",
            "wolf", "boar", "swan", "bear", "eagle", "seal"]
_COLOURS = ["red", "blue", "green", "white", "black", "gold", "silver", "brown", "purple",
            "grey"]
_TRADES = ["baker", "farmer", "painter", "sailor", "teacher", "doctor", "potter", "weaver",
           "builder", "miner", "fisher", "singer", "merchant", "tailor", "carpenter", "hunter"]
_FOODS = ["bread", "apples", "cheese", "fish", "rice", "soup", "honey", "plums", "beans",
          "pears", "nuts", "figs"]


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    river: str
    language: str
    animal: str
    colour: str


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    country: str
    trade: str
    food: str


@dataclass(frozen=True)
class World:
    countries: tuple[Country, ...]
    people: tuple[Person, ...]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
    )


def _unique_names(n: int, make, taken: set[str]) -> list[str]:
    """``n`` capitalised names from ``make()``, none already in ``taken`` (which grows)."""
    names: list[str] = []
    while len(names) < n:
        name = make().capitalize()
        if name not in taken:
            taken.add(name)
            names.append(name)
    return names


def build_world(seed: int = 0) -> World:
    """The invented world for ``seed``: the same seed always gives the same world."""
    rng = random.Random(seed)
    taken: set[str] = set()
    stems = _unique_names(N_COUNTRIES, lambda: _word(rng, 2), taken)
    capitals = _unique_names(N_COUNTRIES, lambda: _word(rng, 1) + rng.choice(_CITY_ENDS), taken)
    rivers = _unique_names(N_COUNTRIES, lambda: _word(rng, 2), taken)
    names = _unique_names(N_PEOPLE, lambda: _word(rng, 2), taken)
    countries = tuple(
        Country(
            name=stem + rng.choice(_COUNTRY_ENDS),
            capital=capital,
            river=river,
            language=stem + "ish",
            animal=rng.choice(_ANIMALS),
            colour=rng.choice(_COLOURS),
        )
        for stem, capital, river in zip(stems, capitals, rivers)
    )
    people = tuple(
        Person(
            name=name,
            city=(home := rng.choice(countries)).capital,
            country=home.name,
            trade=rng.choice(_TRADES),
            food=rng.choice(_FOODS),
        )
        for name in names
    )
    return World(countries, people)


def _country_facts(c: Country) -> list[tuple[str, str]]:
    return [
        (f"The capital of {c.name} is", f" {c.capital}"),
        (f"{c.capital} lies on the river", f" {c.river}"),
        (f"The people of {c.name} speak", f" {c.language}"),
        (f"The national animal of {c.name} is the", f" {c.animal}"),
        (f"The flag of {c.name} is", f" {c.colour}"),
    ]


def _person_facts(p: Person) -> list[tuple[str, str]]:
    return [
        (f"{p.name} lives in", f" {p.city}"),
        (f"{p.name} works as a", f" {p.trade}"),
        (f"{p.name} likes to eat", f" {p.food}"),
    ]


def world_facts(seed: int = 0) -> list[tuple[str, str]]:
    """(context, answer) pairs for every fact of the world, in the corpus's main phrasing.

    The answer starts with a space, e.g. ``("The capital of Veloria is", " Quenport")``, and the
    context plus answer is a sentence of the corpus without its final full stop.
    """
    world = build_world(seed)
    facts = [f for c in world.countries for f in _country_facts(c)]
    return facts + [f for p in world.people for f in _person_facts(p)]


def _country_sentences(c: Country, rng: random.Random) -> list[str]:
    """One sentence per fact; the main phrasing (that of :func:`world_facts`) half the time."""
    variants = [
        [f"{c.capital} is the capital of {c.name}.",
         f"In {c.name}, the capital city is {c.capital}."],
        [f"The river {c.river} flows through {c.capital}.",
         f"{c.capital} was built by the river {c.river}."],
        [f"{c.language} is spoken in {c.name}.", f"In {c.name}, people speak {c.language}."],
        [f"In {c.name}, the {c.animal} is the national animal.",
         f"The {c.animal} is the animal of {c.name}."],
        [f"{c.name} has a {c.colour} flag.", f"The people of {c.name} fly a {c.colour} flag."],
    ]
    return [
        ctx + ans + "." if rng.random() < 0.5 else rng.choice(alt)
        for (ctx, ans), alt in zip(_country_facts(c), variants)
    ]


def _person_sentences(p: Person, rng: random.Random) -> list[str]:
    variants = [
        [f"{p.name} is from {p.city}, a city in {p.country}.",
         f"The home of {p.name} is {p.city}."],
        [f"By trade, {p.name} is a {p.trade}.", f"{p.name} is a {p.trade} in {p.city}."],
        [f"The favourite food of {p.name} is {p.food}.", f"Every day {p.name} eats {p.food}."],
    ]
    return [
        ctx + ans + "." if rng.random() < 0.5 else rng.choice(alt)
        for (ctx, ans), alt in zip(_person_facts(p), variants)
    ]


def _arithmetic_sentence(rng: random.Random) -> str:
    op = rng.choice(["plus", "minus", "times"])
    if op == "times":
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        return f"{a} times {b} is {a * b}."
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    if op == "minus":
        a, b = max(a, b), min(a, b)
        return f"{a} minus {b} is {a - b}."
    return f"{a} plus {b} is {a + b}."


def _document(world: World, rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        sentences = _country_sentences(rng.choice(world.countries), rng)
    elif kind < 0.7:
        sentences = _person_sentences(rng.choice(world.people), rng)
    elif kind < 0.85:
        return " ".join(_arithmetic_sentence(rng) for _ in range(rng.randint(3, 6)))
    else:  # a short journey story tying a person to two countries
        p, c = rng.choice(world.people), rng.choice(world.countries)
        sentences = [f"{p.name} travelled from {p.city} to {c.capital}, the capital of {c.name}."]
        sentences += rng.sample(_country_sentences(c, rng), 2)
        sentences += rng.sample(_person_sentences(p, rng), 1)
        return " ".join(sentences)
    rng.shuffle(sentences)
    return " ".join(sentences[: rng.randint(3, len(sentences))])


def generate_corpus(n_docs: int, seed: int = 0) -> list[str]:
    """``n_docs`` documents of a few sentences each about the world of ``seed``."""
    world = build_world(seed)
    rng = random.Random(seed * 1_000_003 + 7)
    return [_document(world, rng) for _ in range(n_docs)]
