"""The transposition rule: two questions of the same words with two parts swapped around a middle ask the other way
round and are never served from each other; fronting, symmetric joins and lists are left to the model."""
import pytest

from strata.cache.request.cross_encoder import RULED_OUT, shared_cross_encoder
from strata.cache.request.transposition import tokens, transposed

SWAPPED = [
    ("lb to kg", "kg to lb"),
    ("Convert 5 lb to kg", "Convert 5 kg to lb"),
    ("How many kilograms is one pound?", "How many pounds is one kilogram?"),    # plural folded
    ("The dog bit the man", "The man bit the dog"),
    ("冰变成水", "水变成冰"),
    ("从北京到上海怎么走", "从上海到北京怎么走"),                               # two-character parts
    ("把英文翻译成中文", "把中文翻译成英文"),
    ("男人对女人说的情话", "女人对男人说的情话"),
    ("从python转到java难吗", "从java转到python难吗"),                         # Latin words inside Chinese text
]
NOT_SWAPPED = [
    ("为什么花呗不能用", "花呗为什么不能用"),                                   # fronted: nothing between
    ("2014年除夕为什么不放假？", "为什么2014年除夕不放假？"),
    ("我可以用花呗吗", "我用花呗可以吗"),
    ("cats and dogs", "dogs and cats"),                                         # symmetric joins
    ("difference between tea and coffee", "difference between coffee and tea"),
    ("北京和上海哪个大", "上海和北京哪个大"),
    ("怎样过一个环保又文明的春节", "怎样过一个文明又环保的春节"),
    ("写出下列词语的反义词或近义词。", "写出下列词语的近义词或反义词"),          # parts sharing their ends (义词)
    ("不过，麦当娜、普林斯和迈克尔·杰克逊都对该专辑产生了影响。",               # a list
     "不过，迈克尔·杰克逊、普林斯和麦当娜都对该专辑产生了影响。"),
    ("下雪了，房子像什么？高山像什么？小树像什么？", "下雪了,小树像什么？房子像什么？高山像什么？"),
    ("What is the capital of Spain?", "What is the capital of Portugal?"),      # other words: the model's call
    ("How do I boil an egg?", "how do I boil an egg"),                          # the same words in the same order
    ("lb to kg", "lb to kg"),
]


@pytest.mark.parametrize("a, b", SWAPPED)
def test_swapped_parts_around_a_middle_are_a_transposition_both_ways(a, b):
    assert transposed(a, b) and transposed(b, a)


@pytest.mark.parametrize("a, b", NOT_SWAPPED)
def test_fronting_symmetric_joins_lists_and_other_words_are_not(a, b):
    assert not transposed(a, b) and not transposed(b, a)


def test_tokens_fold_case_plurals_and_list_separators():
    assert tokens("Kilograms, POUNDS、class") == ["kilogram", ",", "pound", ",", "class"]
    assert tokens("冰变成水！") == ["冰", "变", "成", "水"]
    assert tokens("用python读取excel") == ["用", "python", "读", "取", "excel"]   # a word stops at an ideograph


def test_long_texts_are_never_called_transposed():
    words = [f"w{i}" for i in range(100)]
    a = " ".join(["x", "to", "y"] + words)
    b = " ".join(["y", "to", "x"] + words)
    assert not transposed(a, b)
    assert transposed(" ".join(["x", "to", "y"] + words[:20]), " ".join(["y", "to", "x"] + words[:20]))


def test_the_second_stage_rules_a_transposed_pair_out_and_says_so_in_its_version():
    ce = shared_cross_encoder()
    assert "transposition" in ce.version.split("+")
    assert ce.score("Convert 5 lb to kg", "Convert 5 kg to lb") == RULED_OUT
    assert ce.logit("Convert 5 lb to kg", "Convert 5 kg to lb") > 0          # what the model alone says: "same"
    pair = ("How many days are in a leap year?", "How many days in a leap year?")
    assert ce.score(*pair) == ce.logit(*pair)
