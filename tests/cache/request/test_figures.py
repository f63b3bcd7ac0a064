"""The figures rule: two questions that both state figures, and not the same ones, are another question; a question
without figures, or the same figures written another way, is left to the model."""
import pytest

from strata.cache.request.cross_encoder import RULED_OUT, shared_cross_encoder
from strata.cache.request.figures import different_figures, figures


@pytest.mark.parametrize("a, b", [
    ("Count to 47.", "Count to 96."),
    ("convert 5 km to miles", "convert 8 km to miles"),
    ("2019年的账单怎么查", "2020年的账单怎么查"),
    ("What is 3.5 squared?", "What is 3.25 squared?"),
    ("top 5 results from 2020", "top 5 results"  " from 2021"),
])
def test_different_figures_are_another_question(a, b):
    assert different_figures(a, b) and different_figures(b, a)


@pytest.mark.parametrize("a, b", [
    ("Count to 47.", "Please count up to 47"),
    ("8,300 people", "8300 people"),                    # a thousands separator
    ("cost 3.50 dollars", "cost 3.5 dollars"),          # a decimal's trailing zero
    ("１５号还款", "15号还款"),                           # full width
    ("How many legs does a spider have?", "Spiders have 8 legs?"),   # only one side states a figure
    ("What is the capital of France?", "Capital of France?"),
])
def test_the_same_figures_or_none_on_one_side_are_left_to_the_model(a, b):
    assert not different_figures(a, b)


def test_figures_are_normalised():
    assert figures("1,000 and 2.50 and ３") == {"1000", "2.5", "3"}


def test_the_second_stage_rules_such_a_pair_out_and_says_so_in_its_version():
    ce = shared_cross_encoder()
    assert "figures" in ce.version.split("+")
    pair = ("Count to 47. Question number 47.", "Count to 96. Question number 96.")   # served at a 5% bound once
    assert ce.score(*pair) == RULED_OUT
    assert ce.logit(*pair) > 0                                       # what the model alone says: "same"
    pair = ("Count to 47.", "Please count up to 47")
    assert ce.score(*pair) == ce.logit(*pair)
