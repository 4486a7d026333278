"""An offline agentic task: a seeded fictional world, its document corpus, questions and an oracle policy.

Why: on a machine without internet (and a 135M model) we still need questions that can only be answered by
searching and computing, with exact golds and held-out entities.  The world is invented (syllable-built names,
every name token unique), so no pretrained model can know the answers; every fact is stated in a small search
corpus in one of several phrasings, next to distractor passages about near-namesakes and rivals.

- Entities: people (name, birth year, home city), cities (name, country, population) and companies (name,
  founder → person, headquarters → city, founding year).
- Question families: ``single_hop`` (one lookup), ``two_hop`` (a lookup whose answer names the next entity) and
  ``compute`` (lookups followed by arithmetic in Python).
- Splits are by company: a company (and its founder) appears in the questions of exactly one split.
- :func:`oracle_transcript` writes the ideal response in the tag protocol by actually calling the tools and
  reading the facts out of the search results, for cold-start SFT.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bm25s.stopwords import STOPWORDS_EN

from aepo_core.config import DataConfig, RolloutConfig
from aepo_core.protocol import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    PYTHON_CLOSE,
    PYTHON_OPEN,
    RESULT_CLOSE,
    RESULT_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    result_block,
)
from infra.data.rows import QuestionRow

logger = logging.getLogger(__name__)

DATA_SOURCE = "synthetic"
SPLITS: tuple[str, ...] = ("train", "validation", "test")
SPLIT_ALIASES: dict[str, str] = {"valid": "validation", "val": "validation", "dev": "validation"}
FAMILIES: tuple[str, ...] = ("single_hop", "two_hop", "compute")
RELATIONS: dict[str, tuple[str, ...]] = {
    "single_hop": ("founded_year", "founder", "headquarters"),
    "two_hop": ("founder_birth_year", "headquarters_country", "founder_home_city", "headquarters_population"),
    "compute": ("years_between_foundings", "founder_age_at_founding"),
}
# Segment roles of an oracle transcript: text the model writes, and tool results appended by the engine.
MODEL = "model"
TOOL = "tool"
DEFAULT_MAX_RESULT_CHARS: int = RolloutConfig.model_fields["max_result_chars"].default

# ------------------------------------------------------------------------------------------------------------
# The language of the corpus: fact templates (every phrasing of a kind shares the kind's keyword, so a query
# "<entity> <keyword>" retrieves it), query templates, questions, and fillers that state no fact.
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FactKind:
    """One kind of fact: ``subject`` and ``value`` name template fields; ``templates`` are its phrasings."""

    name: str
    subject: str
    value: str
    templates: tuple[str, ...]
    query: str
    need: str
    queries: tuple[str, ...] = ()  # other phrasings of ``query`` (varied transcripts), each with the kind's keyword
    needs: tuple[str, ...] = ()  # other phrasings of ``need``


FACT_KINDS: dict[str, FactKind] = {
    k.name: k
    for k in (
        FactKind("founded", "company", "year", (
            "{company} was founded in {year}.",
            "Founded in {year}, {company} grew quickly.",
            "The firm {company} was founded in the year {year}.",
        ), "When was {subject} founded", "the founding year of {subject}",
            ("{subject} founded", "year {subject} was founded"), ("when {subject} was founded",)),
        FactKind("founder", "company", "person", (
            "The founder of {company} is {person}.",
            "{person} is the founder of {company}.",
            "{company} counts {person} as its founder.",
        ), "{subject} founder", "the founder of {subject}",
            ("founder of {subject}", "who is the founder of {subject}"), ("who founded {subject}",)),
        FactKind("headquarters", "company", "city", (
            "{company} has its headquarters in {city}.",
            "The headquarters of {company} are in {city}.",
            "{company} keeps its headquarters in the city of {city}.",
        ), "{subject} headquarters", "the headquarters of {subject}",
            ("headquarters of {subject}", "where are the headquarters of {subject}"),
            ("where {subject} has its headquarters",)),
        FactKind("born", "person", "year", (
            "{person} was born in {year}.",
            "Born in {year}, {person} moved often as a child.",
            "{person} was born in the year {year}.",
        ), "When was {subject} born", "the birth year of {subject}",
            ("{subject} born", "year {subject} was born"), ("when {subject} was born",)),
        FactKind("home", "person", "city", (
            "{person} makes a home in {city}.",
            "The home of {person} is in {city}.",
            "{person} has a home in the city of {city}.",
        ), "{subject} home", "the home city of {subject}",
            ("home of {subject}", "where is the home of {subject}"), ("where {subject} has a home",)),
        FactKind("country", "city", "country", (
            "{city} is a city in the country of {country}.",
            "The country of {country} includes the city of {city}.",
            "{city} lies in the country {country}.",
        ), "{subject} country", "the country of {subject}",
            ("country of {subject}", "which country is {subject} in"), ("which country {subject} is in",)),
        FactKind("population", "city", "population", (
            "{city} has a population of {population}.",
            "The population of {city} is {population}.",
            "About {population} people make up the population of {city}.",
        ), "{subject} population", "the population of {subject}",
            ("population of {subject}", "what is the population of {subject}"), ("how many people live in {subject}",)),
    )
}
MAX_TEMPLATES_PER_FACT = min(len(k.templates) for k in FACT_KINDS.values())

# What a value looks like in text: names are capitalised invented words (persons: first + last name).
VALUE_PATTERNS: dict[str, str] = {
    "year": r"\d{4}",
    "person": r"[A-Z][a-z]+ [A-Z][a-z]+",
    "city": r"[A-Z][a-z]+",
    "country": r"[A-Z][a-z]+",
    "population": r"\d{1,3}(?:,\d{3})*",
}

# Passages that name a real company next to a fact about a different (distractor) company.
COMPARISON_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("founded", "{company} is often confused with {other}, which was founded in {year}."),
    ("headquarters", "Unlike {company}, {other} has its headquarters in {city}."),
    ("founder", "{other}, a rival of {company}, counts {person} as its founder."),
)
COMPANY_SUFFIXES: tuple[str, ...] = (
    "Labs", "Works", "Systems", "Foundry", "Mills", "Industries", "Dynamics", "Holdings", "Instruments", "Textiles",
)
FILLERS: dict[str, tuple[str, ...]] = {
    "company": (
        "The firm is known for its {thing}.", "It sells {thing} to many markets.", "Its {thing} are widely used.",
    ),
    "person": ("Colleagues describe this person as {thing}.", "Friends call this person {thing}."),
    "city": ("The town is known for its {thing}.", "Visitors come for the {thing}."),
}
FILLER_THINGS: dict[str, tuple[str, ...]] = {
    "company": ("copper wire", "glass lenses", "river barges", "paper lanterns", "wool blankets", "solar lamps",
                "field radios", "clay tiles", "bicycle gears", "weather balloons"),
    "person": ("patient", "restless", "careful", "generous", "stubborn", "cheerful", "quiet", "ambitious"),
    "city": ("old harbor", "stone bridge", "night market", "clock tower", "salt flats", "tram lines", "river walk",
             "hill gardens"),
}

QUESTION_TEMPLATES: dict[str, str] = {
    "founded_year": "In which year was {e0} founded?",
    "founder": "Who founded {e0}?",
    "headquarters": "In which city is {e0} headquartered?",
    "founder_birth_year": "In which year was the founder of {e0} born?",
    "headquarters_country": "In which country is {e0} headquartered?",
    "founder_home_city": "In which city does the founder of {e0} live?",
    "headquarters_population": "What is the population of the city where {e0} is headquartered?",
    "years_between_foundings": "How many years passed between the founding of {e0} and the founding of {e1}?",
    "founder_age_at_founding": "How old was the founder of {e0} when {e0} was founded?",
}


@dataclass(frozen=True)
class Lookup:
    """Search for fact ``kind`` about ``subject``: ``e<i>`` is the question's i-th entity, ``v<i>`` an earlier value."""

    kind: str
    subject: str


@dataclass(frozen=True)
class Compute:
    """Run ``print(<expression>)`` in Python; ``expression`` formats earlier values ``{v0}``, ``{v1}``…"""

    expression: str
    description: str


Step = Lookup | Compute

# How the oracle answers each relation: the same chain of lookups a careful reader would do.
RELATION_PLANS: dict[str, tuple[Step, ...]] = {
    "founded_year": (Lookup("founded", "e0"),),
    "founder": (Lookup("founder", "e0"),),
    "headquarters": (Lookup("headquarters", "e0"),),
    "founder_birth_year": (Lookup("founder", "e0"), Lookup("born", "v0")),
    "headquarters_country": (Lookup("headquarters", "e0"), Lookup("country", "v0")),
    "founder_home_city": (Lookup("founder", "e0"), Lookup("home", "v0")),
    "headquarters_population": (Lookup("headquarters", "e0"), Lookup("population", "v0")),
    "years_between_foundings": (
        Lookup("founded", "e0"), Lookup("founded", "e1"),
        Compute("abs({v1} - {v0})", "the difference between the two years"),
    ),
    "founder_age_at_founding": (
        Lookup("founder", "e0"), Lookup("born", "v0"), Lookup("founded", "e0"),
        Compute("{v2} - {v1}", "the founding year minus the birth year"),
    ),
}

# Invented-name syllables: short consonant-vowel syllables and an optional final coda.
ONSETS: tuple[str, ...] = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
                           "br", "dr", "gr", "kr", "tr", "vr", "sk", "zh", "th")
VOWELS: tuple[str, ...] = ("a", "e", "i", "o", "u", "y")
CODAS: tuple[str, ...] = ("n", "r", "l", "s", "k", "th", "x", "rn", "sk", "nd")
CODA_PROBABILITY = 0.7
MIN_NAME_CHARS = 4
NAME_ATTEMPTS = 10_000


def _template_words() -> frozenset[str]:
    """Every word the generator writes itself: an invented name must never coincide with one of them."""
    texts: list[str] = [*COMPANY_SUFFIXES, *QUESTION_TEMPLATES.values()]
    for kind in FACT_KINDS.values():
        texts.extend([*kind.templates, kind.query, kind.need])
    texts.extend(t for _, t in COMPARISON_TEMPLATES)
    for group in (FILLERS, FILLER_THINGS):
        for items in group.values():
            texts.extend(items)
    return frozenset(w.lower() for t in texts for w in re.findall(r"[A-Za-z]+", t))


RESERVED_WORDS: frozenset[str] = _template_words() | frozenset(STOPWORDS_EN)


# ------------------------------------------------------------------------------------------------------------
# The world
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Person:
    """A founder: the end of two-hop chains (birth year, home city)."""

    name: str
    birth_year: int
    home_city: str


@dataclass(frozen=True)
class City:
    """A city shared by many companies and people: the bridge of headquarters → country/population chains."""

    name: str
    country: str
    population: int


@dataclass(frozen=True)
class Company:
    """The unit of the train/validation/test split: every question is about one (or two) companies."""

    name: str
    founder: str
    headquarters: str
    founded: int
    split: str


@dataclass(frozen=True)
class World:
    """All entities (by name) and the corpus; distractor entities live only in the corpus."""

    companies: dict[str, Company]
    people: dict[str, Person]
    cities: dict[str, City]
    countries: tuple[str, ...]
    documents: tuple[dict[str, str], ...]


class NameGenerator:
    """Unique invented words from syllables; no word equals another or any word the templates use."""

    def __init__(self, rng: random.Random, min_syllables: int, max_syllables: int) -> None:
        self.rng = rng
        self.min_syllables = min_syllables
        self.max_syllables = max_syllables
        self.used: set[str] = set()

    def word(self) -> str:
        for _ in range(NAME_ATTEMPTS):
            n = self.rng.randint(self.min_syllables, self.max_syllables)
            text = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(n))
            if self.rng.random() < CODA_PROBABILITY:
                text += self.rng.choice(CODAS)
            if len(text) < MIN_NAME_CHARS or text in self.used or text in RESERVED_WORDS:
                continue
            self.used.add(text)
            return text.capitalize()
        raise RuntimeError("ran out of invented names: raise max_syllables")


def fact_sentence(kind: str, template_index: int, subject: str, value: str) -> str:
    """One fact in the phrasing ``template_index`` of ``kind``."""
    k = FACT_KINDS[kind]
    return k.templates[template_index].format(**{k.subject: subject, k.value: value})


def format_value(kind: str, value: int | str) -> str:
    """How a value is written in the corpus (populations with thousands separators)."""
    if FACT_KINDS[kind].value == "population":
        return f"{int(value):,}"
    return str(value)


def _split_counts(n: int, validation_fraction: float, test_fraction: float) -> dict[str, int]:
    n_val = round(n * validation_fraction)
    n_test = round(n * test_fraction)
    n_train = n - n_val - n_test
    if n_train < 1 or (validation_fraction > 0 and n_val < 1) or (test_fraction > 0 and n_test < 1):
        raise ValueError(
            f"{n} companies cannot be split {1 - validation_fraction - test_fraction:.2f}/{validation_fraction:.2f}/"
            f"{test_fraction:.2f} with at least one company per non-empty split: raise n_companies"
        )
    return {"train": n_train, "validation": n_val, "test": n_test}


# ------------------------------------------------------------------------------------------------------------
# The task
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticTask:
    """A seeded world with its corpus and questions; the same parameters always give the same task.

    Size: ``n_companies`` (each with its own founder), ``n_cities``, ``n_countries``.  Difficulty:
    ``templates_per_fact`` (phrasings in use, 1..3), ``mentions_per_fact`` (documents stating each fact),
    ``facts_per_document`` (1 spreads every fact into its own passage), ``near_name_distractors`` (per company and
    per founder: a namesake sharing one name word, with a fact of its own), ``comparison_distractors`` (per company:
    a passage naming it next to a rival's fact), ``families`` / ``relations`` (which questions),
    ``questions_per_company`` (a seeded sample of the relations; None: all).
    """

    seed: int = 0
    n_companies: int = 60
    n_cities: int = 12
    n_countries: int = 4
    families: tuple[str, ...] = FAMILIES
    relations: tuple[str, ...] | None = None
    questions_per_company: int | None = None
    validation_fraction: float = 0.2
    test_fraction: float = 0.2
    templates_per_fact: int = MAX_TEMPLATES_PER_FACT
    mentions_per_fact: int = 1
    facts_per_document: int = 1
    near_name_distractors: int = 1
    comparison_distractors: int = 1
    founding_years: tuple[int, int] = (1900, 2020)
    founder_age_at_founding: tuple[int, int] = (22, 60)
    population_range: tuple[int, int] = (20_000, 2_000_000)
    population_step: int = 1_000
    name_syllables: tuple[int, int] = (2, 2)
    fillers: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "families", tuple(self.families))
        if self.relations is not None:
            object.__setattr__(self, "relations", tuple(self.relations))
        unknown = [f for f in self.families if f not in RELATIONS]
        if unknown or not self.families:
            raise ValueError(f"families must be a non-empty subset of {FAMILIES}, got {self.families}")
        known = {r for rels in RELATIONS.values() for r in rels}
        if self.relations is not None and (not self.relations or not set(self.relations) <= known):
            raise ValueError(f"relations must be a non-empty subset of {sorted(known)}, got {self.relations}")
        if not self.active_relations:
            raise ValueError(f"no relation of {self.relations} belongs to the families {self.families}")
        if self.n_companies < 1 or self.n_cities < 1 or self.n_countries < 1:
            raise ValueError("n_companies, n_cities and n_countries must be >= 1")
        if not 1 <= self.templates_per_fact <= MAX_TEMPLATES_PER_FACT:
            raise ValueError(f"templates_per_fact must be in 1..{MAX_TEMPLATES_PER_FACT}")
        if not 1 <= self.mentions_per_fact <= self.templates_per_fact:
            raise ValueError("mentions_per_fact must be in 1..templates_per_fact (each mention has its own phrasing)")
        if self.facts_per_document < 1:
            raise ValueError("facts_per_document must be >= 1")
        if not 0 <= self.near_name_distractors < len(COMPANY_SUFFIXES):
            raise ValueError(f"near_name_distractors must be in 0..{len(COMPANY_SUFFIXES) - 1}")
        if self.comparison_distractors < 0:
            raise ValueError("comparison_distractors must be >= 0")
        if self.questions_per_company is not None and self.questions_per_company < 1:
            raise ValueError("questions_per_company must be >= 1 or None")
        for name in ("founding_years", "founder_age_at_founding", "population_range", "name_syllables"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be a range 0 < lo <= hi, got {(lo, hi)}")
        if self.founding_years[0] - self.founder_age_at_founding[1] < 1:
            raise ValueError("founding_years and founder_age_at_founding give birth years before year 1")
        if not 0 <= self.validation_fraction < 1 or not 0 <= self.test_fraction < 1:
            raise ValueError("validation_fraction and test_fraction must be in [0, 1)")
        _split_counts(self.n_companies, self.validation_fraction, self.test_fraction)

    @classmethod
    def from_config(cls, cfg: DataConfig) -> SyntheticTask:
        """The task a :class:`DataConfig` describes (``data.synthetic.entities`` is the number of companies)."""
        syn = cfg.synthetic
        return cls(
            seed=syn.seed,
            n_companies=syn.entities,
            n_cities=syn.cities,
            n_countries=syn.countries,
            families=tuple(syn.families),
            relations=tuple(syn.relations) if syn.relations is not None else None,
            questions_per_company=syn.questions_per_company,
            validation_fraction=syn.validation_fraction,
            test_fraction=syn.test_fraction,
            templates_per_fact=syn.templates_per_fact,
            mentions_per_fact=syn.mentions_per_fact,
            facts_per_document=syn.facts_per_document,
            near_name_distractors=syn.near_name_distractors,
            comparison_distractors=syn.comparison_distractors,
        )

    @property
    def birth_years(self) -> tuple[int, int]:
        """The range founders' birth years fall in (namesakes draw from it too, so they look alike)."""
        return (self.founding_years[0] - self.founder_age_at_founding[1],
                self.founding_years[1] - self.founder_age_at_founding[0])

    @property
    def active_relations(self) -> tuple[str, ...]:
        """Relations asked, in a fixed order: those of the chosen families, filtered by ``relations``."""
        chosen = [r for f in self.families for r in RELATIONS[f]]
        return tuple(r for r in chosen if self.relations is None or r in self.relations)

    # -------------------------------------------------------------------------------------------- the world
    @cached_property
    def world(self) -> World:
        rng = random.Random(self.seed)
        names = NameGenerator(rng, *self.name_syllables)
        countries = tuple(names.word() for _ in range(self.n_countries))
        cities: dict[str, City] = {}
        for _ in range(self.n_cities):
            city = City(names.word(), rng.choice(countries),
                        rng.randrange(*self.population_range, self.population_step))
            cities[city.name] = city
        city_names = list(cities)

        order = list(range(self.n_companies))
        rng.shuffle(order)
        counts = _split_counts(self.n_companies, self.validation_fraction, self.test_fraction)
        split_of: dict[int, str] = {}
        start = 0
        for split in SPLITS:
            for i in order[start : start + counts[split]]:
                split_of[i] = split
            start += counts[split]

        companies: dict[str, Company] = {}
        people: dict[str, Person] = {}
        for i in range(self.n_companies):
            founded = rng.randint(*self.founding_years)
            founder = Person(f"{names.word()} {names.word()}", founded - rng.randint(*self.founder_age_at_founding),
                             rng.choice(city_names))
            company = Company(f"{names.word()} {rng.choice(COMPANY_SUFFIXES)}", founder.name,
                              rng.choice(city_names), founded, split_of[i])
            people[founder.name] = founder
            companies[company.name] = company

        docs = self._entity_documents(rng, companies, people, cities)
        docs += self._distractor_documents(rng, names, companies, people, city_names)
        rng.shuffle(docs)
        documents = tuple({"id": f"syn{self.seed}-{i:05d}", "title": t, "text": x} for i, (t, x) in enumerate(docs))
        world = World(companies, people, cities, countries, documents)
        logger.info("synthetic world seed=%d: %d companies, %d people, %d cities, %d documents", self.seed,
                    len(companies), len(people), len(cities), len(documents))
        return world

    def _entity_documents(
        self, rng: random.Random, companies: dict[str, Company], people: dict[str, Person], cities: dict[str, City]
    ) -> list[tuple[str, str]]:
        """Each entity's facts, each mentioned ``mentions_per_fact`` times in distinct phrasings, spread over
        passages of ``facts_per_document`` sentences (plus a filler sentence that states nothing)."""
        entities: list[tuple[str, str, list[tuple[str, str]]]] = []
        for c in companies.values():
            entities.append((c.name, "company", [("founded", str(c.founded)), ("founder", c.founder),
                                                 ("headquarters", c.headquarters)]))
        for p in people.values():
            entities.append((p.name, "person", [("born", str(p.birth_year)), ("home", p.home_city)]))
        for t in cities.values():
            entities.append((t.name, "city", [("country", t.country), ("population", str(t.population))]))
        docs: list[tuple[str, str]] = []
        for name, kind, facts in entities:
            sentences: list[str] = []
            for fact, value in facts:
                phrasings = rng.sample(range(self.templates_per_fact), self.mentions_per_fact)
                sentences.extend(fact_sentence(fact, j, name, format_value(fact, value)) for j in phrasings)
            rng.shuffle(sentences)
            for start in range(0, len(sentences), self.facts_per_document):
                docs.append((name, self._with_filler(rng, kind, sentences[start : start + self.facts_per_document])))
        return docs

    def _with_filler(self, rng: random.Random, kind: str, sentences: list[str]) -> str:
        if self.fillers:
            sentences = [*sentences, rng.choice(FILLERS[kind]).format(thing=rng.choice(FILLER_THINGS[kind]))]
        return " ".join(sentences)

    def _distractor_documents(
        self,
        rng: random.Random,
        names: NameGenerator,
        companies: dict[str, Company],
        people: dict[str, Person],
        city_names: list[str],
    ) -> list[tuple[str, str]]:
        """Passages that look relevant but answer nothing: namesakes (same first word / same surname) with facts
        of their own, and comparisons that name a real company next to a rival's fact."""
        docs: list[tuple[str, str]] = []

        def passage(kind: str, fact: str, subject: str, value: str) -> tuple[str, str]:
            sentence = fact_sentence(fact, rng.randrange(self.templates_per_fact), subject, value)
            return subject, self._with_filler(rng, kind, [sentence])

        for company in companies.values():
            first, suffix = company.name.split(" ", 1)
            for other_suffix in rng.sample([s for s in COMPANY_SUFFIXES if s != suffix], self.near_name_distractors):
                namesake = f"{first} {other_suffix}"
                fact = rng.choice(("founded", "founder", "headquarters"))
                if fact == "founded":
                    value = str(rng.randint(*self.founding_years))
                elif fact == "founder":
                    value = f"{names.word()} {names.word()}"
                else:
                    value = rng.choice(city_names)
                docs.append(passage("company", fact, namesake, value))
            for _ in range(self.comparison_distractors):
                other = f"{names.word()} {rng.choice(COMPANY_SUFFIXES)}"
                _, text = rng.choice(COMPARISON_TEMPLATES)
                sentence = text.format(company=company.name, other=other, year=rng.randint(*self.founding_years),
                                       city=rng.choice(city_names), person=f"{names.word()} {names.word()}")
                docs.append((other, self._with_filler(rng, "company", [sentence])))
        for person in people.values():
            surname = person.name.split(" ", 1)[1]
            for _ in range(self.near_name_distractors):
                namesake = f"{names.word()} {surname}"
                if rng.choice(("born", "home")) == "born":
                    docs.append(passage("person", "born", namesake, str(rng.randint(*self.birth_years))))
                else:
                    docs.append(passage("person", "home", namesake, rng.choice(city_names)))
        return docs

    # -------------------------------------------------------------------------------------------- public API
    def documents(self) -> list[dict[str, str]]:
        """The search corpus: ``{"id", "title", "text"}`` per passage (a fresh list of fresh dicts)."""
        return [dict(d) for d in self.world.documents]

    def companies(self, split: str) -> list[Company]:
        """The companies whose questions belong to ``split``, in a fixed order."""
        split = _canonical_split(split)
        return [c for c in self.world.companies.values() if c.split == split]

    def questions(self, split: str) -> list[QuestionRow]:
        """The questions of ``split`` (train / validation / test), in a fixed order."""
        split = _canonical_split(split)
        world = self.world
        members = self.companies(split)
        # A per-split stream, so one split's questions do not depend on how many another split has.
        rng = random.Random(f"{self.seed}:{split}")
        rows: list[QuestionRow] = []
        for i, company in enumerate(members):
            relations = list(self.active_relations)
            if self.questions_per_company is not None and self.questions_per_company < len(relations):
                relations = sorted(rng.sample(relations, self.questions_per_company), key=relations.index)
            for relation in relations:
                entities = [company.name]
                if relation == "years_between_foundings":
                    if len(members) < 2:
                        logger.info("split %s has one company: no %s question", split, relation)
                        continue
                    entities.append(members[(i + 1) % len(members)].name)
                gold = _gold(world, relation, entities)
                family = next(f for f, rels in RELATIONS.items() if relation in rels)
                plan = RELATION_PLANS[relation]
                rows.append(QuestionRow(
                    id=f"syn{self.seed}-{split}-{relation}-{company.name.split(' ', 1)[0].lower()}",
                    question=QUESTION_TEMPLATES[relation].format(**{f"e{j}": e for j, e in enumerate(entities)}),
                    golds=(gold,),
                    data_source=DATA_SOURCE,
                    family=family,
                    split=split,
                    metadata={
                        "relation": relation,
                        "entities": entities,
                        "searches": sum(isinstance(s, Lookup) for s in plan),
                        "python_calls": sum(isinstance(s, Compute) for s in plan),
                        "seed": self.seed,
                    },
                ))
        return rows

    def summary(self) -> dict[str, Any]:
        """Sizes for logging: entities, documents and questions per split."""
        world = self.world
        return {
            "companies": len(world.companies),
            "people": len(world.people),
            "cities": len(world.cities),
            "documents": len(world.documents),
            **{f"questions_{s}": len(self.questions(s)) for s in SPLITS},
        }


def _canonical_split(split: str) -> str:
    split = SPLIT_ALIASES.get(split, split)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return split


def _gold(world: World, relation: str, entities: Sequence[str]) -> str:
    """The true answer, straight from the world (the oracle must rediscover it from the corpus)."""
    company = world.companies[entities[0]]
    founder = world.people[company.founder]
    hq = world.cities[company.headquarters]
    answers: dict[str, Callable[[], int | str]] = {
        "founded_year": lambda: company.founded,
        "founder": lambda: founder.name,
        "headquarters": lambda: hq.name,
        "founder_birth_year": lambda: founder.birth_year,
        "headquarters_country": lambda: hq.country,
        "founder_home_city": lambda: founder.home_city,
        "headquarters_population": lambda: hq.population,
        "years_between_foundings": lambda: abs(world.companies[entities[1]].founded - company.founded),
        "founder_age_at_founding": lambda: company.founded - founder.birth_year,
    }
    return str(answers[relation]())


# ------------------------------------------------------------------------------------------------------------
# The oracle policy
# ------------------------------------------------------------------------------------------------------------


class OracleError(RuntimeError):
    """The oracle could not answer from what the tools returned (a fact missing from the results)."""


def _fact_regexes(kind: str, subject: str) -> list[re.Pattern[str]]:
    """Every phrasing of ``kind`` with the subject fixed to exactly ``subject`` and the value captured."""
    k = FACT_KINDS[kind]
    patterns = []
    for template in k.templates:
        parts = re.split(r"(\{\w+\})", template)
        regex = ""
        for part in parts:
            if part == "{" + k.subject + "}":
                regex += r"(?<![\w])" + re.escape(subject) + r"(?![\w])"
            elif part == "{" + k.value + "}":
                regex += r"(?<![\w])(" + VALUE_PATTERNS[k.value] + r")(?![\w])"
            else:
                regex += re.escape(part)
        patterns.append(re.compile(regex))
    return patterns


def read_fact(text: str, kind: str, subject: str) -> str | None:
    """The value of fact ``kind`` about ``subject`` stated in ``text`` (the first statement wins), or None.

    Only sentences whose subject is exactly ``subject`` count, so a namesake's or a rival's fact is ignored.
    """
    best: tuple[int, str] | None = None
    for pattern in _fact_regexes(kind, subject):
        match = pattern.search(text)
        if match and (best is None or match.start() < best[0]):
            best = (match.start(), match.group(1))
    if best is None:
        return None
    value = best[1]
    return value.replace(",", "") if FACT_KINDS[kind].value == "population" else value


def _think(text: str) -> str:
    return f"{THINK_OPEN}{text}{THINK_CLOSE}"


VARIED_WORDS: dict[str, tuple[str, ...]] = {  # each: the one-template transcripts' phrasing first, then others
    "first": ("I need {need}.", "First, find {need}.", "To answer this, look up {need}."),
    "next": ("Next: {need}.", "Now find {need}.", "Then I need {need}."),
    "compute": ("Compute {description}.", "Now compute {description}.", "Next, compute {description}."),
    "reuse": ("The results above say: {summary}", "Already in the results: {summary}",
              "From the earlier result: {summary}"),
    "printed": ("The result is {printed}.", "Python printed {printed}.", "That gives {printed}."),
    "final": ("The answer is \\boxed{{{answer}}}.", "So the answer is \\boxed{{{answer}}}.",
              "Final answer: \\boxed{{{answer}}}."),
}
"""The words of an oracle transcript that ``varied`` draws from (:func:`oracle_transcript`)."""


def oracle_transcript(
    row: QuestionRow,
    search: Callable[[str], str],
    python: Callable[[str], str],
    *,
    max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
    reuse_results: bool = True,
    varied: bool = False,
) -> list[tuple[str, str]]:
    """The ideal response to a synthetic question, as ``(role, text)`` segments (role ``model`` or ``tool``).

    It follows the relation's plan (metadata ``relation`` and ``entities``: what the question names), calls the
    real tools, and reads every fact out of the returned text — never out of the world — so the transcript is
    exactly what a policy would see at RL time: model segments end at the stop strings (``</search>``,
    ``</python>``, ``</answer>``) and tool segments are ``result_block(tool output, max_result_chars)``.
    With ``reuse_results`` a fact already visible in an earlier search result is not searched for again (the
    efficient behaviour we want the policy to learn).  ``varied`` (``train.sft.varied``): the transcript draws its
    words from :data:`VARIED_WORDS`, the kinds' query and need phrasings and the corpus's fact phrasings, and searches
    again for a fact already seen half the time, all seeded by the row's id (the same row, the same transcript);
    without it every transcript of a relation is worded alike.  Raises :class:`OracleError` when a fact is not in
    the results or Python does not print an integer.
    """
    relation = row.metadata.get("relation")
    if relation not in RELATION_PLANS:
        raise OracleError(f"row {row.id} has no known synthetic relation ({relation!r})")
    rng = random.Random(f"oracle:{row.id}")

    def pick(options: Sequence[str]) -> str:
        return rng.choice(options) if varied else options[0]

    entities: dict[str, str] = {f"e{i}": e for i, e in enumerate(row.metadata["entities"])}
    values: list[str] = []
    segments: list[tuple[str, str]] = []
    seen: list[str] = []  # search results so far, as the model saw them
    thought: list[str] = []  # sentences of the next model segment's think block

    def ref(name: str) -> str:
        return entities[name] if name.startswith("e") else values[int(name[1:])]

    def summary(kind: str, subject: str, value: str) -> str:  # the fact just read, in the corpus's words
        template = rng.randrange(len(FACT_KINDS[kind].templates)) if varied else 0  # the first: terse think text
        return fact_sentence(kind, template, subject, format_value(kind, value))

    for step in RELATION_PLANS[relation]:
        if isinstance(step, Compute):
            code = f"print({step.expression.format(**{f'v{i}': v for i, v in enumerate(values)})})"
            thought.append(pick(VARIED_WORDS["compute"]).format(description=step.description))
            segments.append((MODEL, f"{_think(' '.join(thought))}{PYTHON_OPEN}{code}{PYTHON_CLOSE}"))
            visible = result_block(python(code), max_result_chars)
            segments.append((TOOL, visible))
            printed = visible.strip().removeprefix(RESULT_OPEN).removesuffix(RESULT_CLOSE).strip()
            if not re.fullmatch(r"-?\d+", printed):
                raise OracleError(f"row {row.id}: python printed {printed!r} for {code!r}, not an integer")
            values.append(printed)
            thought = [pick(VARIED_WORDS["printed"]).format(printed=printed)]
            continue
        subject = ref(step.subject)
        kind = FACT_KINDS[step.kind]
        known = read_fact("\n".join(seen), step.kind, subject) if reuse_results and seen else None
        if known is not None and not (varied and rng.random() < 0.5):
            values.append(known)
            thought.append(pick(VARIED_WORDS["reuse"]).format(summary=summary(step.kind, subject, known)))
            continue
        need = pick((kind.need, *kind.needs)).format(subject=subject)
        thought.append(pick(VARIED_WORDS["next" if thought else "first"]).format(need=need))
        query = pick((kind.query, *kind.queries)).format(subject=subject)
        segments.append((MODEL, f"{_think(' '.join(thought))}{SEARCH_OPEN}{query}{SEARCH_CLOSE}"))
        visible = result_block(search(query), max_result_chars)  # read only what the model would see
        seen.append(visible)
        segments.append((TOOL, visible))
        value = read_fact(visible, step.kind, subject)
        if value is None:
            raise OracleError(f"row {row.id}: no '{step.kind}' fact about {subject!r} in the results of {query!r}")
        values.append(value)
        thought = [summary(step.kind, subject, value)]
    final = pick(VARIED_WORDS["final"]).format(answer=values[-1])
    segments.append((MODEL, f"{_think(' '.join(thought))}{ANSWER_OPEN}{final}{ANSWER_CLOSE}"))
    return segments


def expected_reward(row: QuestionRow, tool_bonus: float) -> float:
    """The deep-search reward of a perfect answer: 1, plus the bonus when the plan uses both tools."""
    return 1.0 + (tool_bonus if row.metadata.get("python_calls", 0) and row.metadata.get("searches", 0) else 0.0)


__all__ = [
    "DATA_SOURCE",
    "FACT_KINDS",
    "FAMILIES",
    "MODEL",
    "RELATIONS",
    "SPLITS",
    "TOOL",
    "OracleError",
    "SyntheticTask",
    "World",
    "expected_reward",
    "oracle_transcript",
    "read_fact",
]
