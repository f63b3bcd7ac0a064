"""Synthetic near-miss negatives: each edit changes what is asked, keeps the rest of the sentence, and leaves alone
the sentences where it would not change the intent (names holding digits, infinitives, rhetorical yes/no questions)."""
import json

import pytest

from strata.cache.request.calibration import language_of
from strata.server.tuning.hard_negatives import hard_negatives
from strata.server.tuning.pairs import Pair
from strata.server.tuning.train_cross_encoder import TrainConfig, train


def same(cached: str, query: str) -> Pair:
    return Pair(cached, query, True, language_of(query), "test")


def edited(pair: Pair, kind: str) -> list[str]:
    out = hard_negatives([pair], (kind,))
    assert all(not p.same and p.cached == pair.cached and p.domain == f"synthetic_{kind}" for p in out)
    return [p.query for p in out]


def test_a_number_both_sides_share_is_changed_in_the_query():
    [query] = edited(same("calories in 2 boiled eggs", "How many calories do 2 boiled eggs have?"), "number")
    assert query.startswith("How many calories do ") and query.endswith(" boiled eggs have?")
    figure = query.split()[4]
    assert figure.isdigit() and figure != "2"


@pytest.mark.parametrize("cached, query", [
    ("calories in an egg", "How many calories do 2 eggs have?"),       # the figure is not the shared fact
    ("list files in an S3 bucket", "how to list an S3 bucket's files"),   # part of a name
    ("convert a string to uint8", "string to uint8 conversion"),
])
def test_numbers_that_are_not_a_shared_figure_are_left_alone(cached, query):
    assert edited(same(cached, query), "number") == []


@pytest.mark.parametrize("cached, query, expected", [
    ("pounds to kilograms", "how do I convert pounds to kilograms", "how do I convert kilograms to pounds"),
    ("flights Paris Rome", "cheap flights from Paris to Rome", "cheap flights from Rome to Paris"),
    ("gold or silver heavier", "is gold heavier than silver?", "is silver heavier than gold?"),
    ("git from svn", "migrating from the svn to git", "migrating from the git to svn"),
])
def test_the_two_nouns_of_an_ordered_relation_trade_places(cached, query, expected):
    assert edited(same(cached, query), "swap") == [expected]


@pytest.mark.parametrize("query", [
    "I really want to win again",                               # "to" before a verb
    "from time to time it crashes",                             # "time" twice
    "is it safer than walking",                                 # "it": a stop word
    " ".join(["word"] * 12) + " convert pounds to kilograms",   # a long sentence
])
def test_swaps_that_would_not_make_a_real_question_are_not_made(query):
    assert edited(same("anything", query), "swap") == []


@pytest.mark.parametrize("query, expected", [
    ("为什么不能用花呗", "为什么能用花呗"),          # 不 comes out
    ("花呗为什么能用了", "花呗为什么不能用了"),      # 不 goes in, in a why-question
    ("怎么可以提前还款", "怎么不可以提前还款"),
])
def test_chinese_negation_flips_a_modal(query, expected):
    assert edited(same("花呗", query), "negation") == [expected]


@pytest.mark.parametrize("query", [
    "花呗可以提前还款吗",            # yes/no question: "不可以...吗" asks the same
    "花呗能不能提前还款",            # A-not-A
    "为什么能量饮料提神",            # 能 inside a word
    "怎样才能提高额度",              # 才能
    "花呗能用",                      # no why / how: "不" would make an odd sentence
    "How can I pay?",                # English is not edited this way
])
def test_negation_is_not_made_where_it_keeps_the_intent_or_breaks_the_sentence(query):
    assert edited(same("花呗", query), "negation") == []


@pytest.mark.parametrize("cached, query, choices", [
    ("left eye twitching meaning", "What does it mean when my Left eye twitches?",
     {"What does it mean when my Right eye twitches?"}),
    ("translate hello to French", "how do I say hello in French", {f"how do I say hello in {lang.capitalize()}" for
     lang in "english spanish german italian portuguese russian chinese japanese korean arabic".split()}),
    ("左眼皮跳是什么征兆", "左眼皮一直跳预示什么", {"右眼皮一直跳预示什么"}),
    ("上个月的账单", "怎么查上个月账单", {"怎么查下个月账单"}),          # one word, not a "上" inside it
    ("开通花呗", "花呗怎么开通", {"花呗怎么关闭"}),
])
def test_a_shared_word_of_a_closed_class_is_replaced_by_a_sibling(cached, query, choices):
    [edit] = edited(same(cached, query), "contrast")
    assert edit in choices


@pytest.mark.parametrize("cached, query", [
    ("eye twitching meaning", "What does it mean when my left eye twitches?"),   # the word is not shared
    ("花呗", "花呗怎么开通"),
    ("left", "leftover rice recipes"),                                         # inside another word
])
def test_contrast_needs_the_word_on_both_sides_as_a_word(cached, query):
    assert edited(same(cached, query), "contrast") == []


def test_only_same_intent_pairs_are_edited_and_the_output_is_deterministic():
    pairs = [same("convert pounds to kilograms", "convert pounds to kilograms please"),
             Pair("为什么不能用花呗", "为什么不能用借呗", False, "zh", "test"),
             same("2 eggs", "calories in 2 eggs")]
    first = hard_negatives(pairs, seed=3)
    assert first == hard_negatives(pairs, seed=3)
    assert [p.domain for p in first] == ["synthetic_swap", "synthetic_number"]
    with pytest.raises(ValueError, match="unknown hard-negative kinds"):
        hard_negatives(pairs, ("typo",))


def test_training_adds_them_to_its_pairs(tmp_path):
    pairs = [same("convert pounds to kilograms", "convert pounds to kilograms please"),
             Pair("convert pounds to kilograms", "convert pounds to grams", False, "en", "test")]
    config = TrainConfig(epochs=1, batch_size=4, n_layers=1, rank=2, alpha=4.0, threads=1, eval_every=0, repeat={},
                         hard_negatives=("swap",))
    train(pairs, tmp_path, config)
    start = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert start["train_pairs"] == 3 and start["config"]["hard_negatives"] == ["swap"]
