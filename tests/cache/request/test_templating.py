"""PII detection and templating: personal values become placeholders only when that is provably a copy."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.cache.request.pii import find_entities, has_pii
from strata.cache.request.templating import fill_answer, template_answer, template_request


@pytest.mark.parametrize("text, kind, value", [
    ("write to jane.doe@example.com", "email", "jane.doe@example.com"),
    ("call +1 415-555-0134 now", "phone", "+1 415-555-0134"),
    ("我的手机号是13912345678", "phone", "13912345678"),
    ("身份证11010519491231002X", "id_number", "11010519491231002X"),
    ("SSN 123-45-6789", "id_number", "123-45-6789"),
    ("card 4111 1111 1111 1111", "bank_card", "4111 1111 1111 1111"),
    ("where is order #A7731920", "order_number", "A7731920"),
    ("我的订单号是 DD20240501", "order_number", "DD20240501"),
    ("ship to 742 Evergreen Terrace Drive", "address", "742 Evergreen Terrace Drive"),
    ("My name is Robert Miller.", "name", "Robert Miller"),
    ("我叫王小明", "name", "王小明"),
    ("meet on May 3, 2024", "date", "May 3, 2024"),
    ("it costs $30.50", "amount", "$30.50"),
    ("fly to Shanghai", "city", "Shanghai"),
])
def test_find_entities(text, kind, value):
    assert (kind, value) in [(e.kind, e.value) for e in find_entities(text)]


@pytest.mark.parametrize("text", [
    "Mount Everest is 8,848 meters tall", "Python 3.11.7 came out in 2023", "1234 5678 9012 3456 is not a card",
    "Explain the order of operations", "我是学生",
])
def test_no_false_pii(text):
    assert not has_pii(text)


def test_template_round_trip_fills_the_next_request():
    first = template_request("Write a thank-you note to bob@example.com for the meeting on May 3")
    stored = template_answer("Dear bob@example.com, thanks for meeting on May 3!", first.values)
    assert stored is not None and "bob@example.com" not in stored and "May 3" not in stored
    second = template_request("Write a thank-you note to amy@example.org for the meeting on June 9")
    assert second.text == first.text
    assert fill_answer(stored, second.values) == "Dear amy@example.org, thanks for meeting on June 9!"


@pytest.mark.parametrize("first, answer, second, filled", [
    ("Tom", "Hello Tom! Tomorrow is a new day, Tom.", "Ann", "Hello Ann! Tomorrow is a new day, Ann."),
    ("Sam", "Dear Sam, Sample the cake with Sam's friend.", "Bob", "Dear Bob, Sample the cake with Bob's friend."),
])
def test_a_value_is_templated_only_where_it_is_a_whole_word(first, answer, second, filled):
    """A name that begins a longer word ("Tom" in "Tomorrow") stays literal there: refilled, it read "Annorrow"."""
    stored = template_answer(answer, template_request(f"My name is {first}. Please greet me.").values)
    assert fill_answer(stored, template_request(f"My name is {second}. Please greet me.").values) == filled


def test_a_value_found_only_inside_longer_words_is_not_templated():
    assert template_answer("Tomorrow will be sunny.", template_request("My name is Tom. Greet me.").values) is None


def test_a_chinese_name_is_templated_beside_other_characters():
    values = template_request("我叫张三，请问候我").values
    assert fill_answer(template_answer("张三你好！", values), template_request("我叫李四，请问候我").values) == "李四你好！"


@pytest.mark.parametrize("answer", [
    "Thanks for the meeting!",                                   # a request value is missing: answer may depend on it
    "Dear bob@example.com, your refund of $30 is on its way",     # an amount the request did not carry
    "Dear bob@example.com, also cc carol@example.com",            # someone else's PII
    "Dear bob@example.com \u27e6EMAIL_9\u27e7",                   # placeholder look-alike
])
def test_unsafe_answers_are_not_templated(answer):
    assert template_answer(answer, template_request("Write a note to bob@example.com").values) is None


@pytest.mark.parametrize("text, about", [
    ("My name is Alice. Is my name usually given to girls?", True),
    ("My name is Alice. How many letters does my name have?", True),
    ("My name is Alice. What letter does my name start with?", True),
    ("Is bob@example.com a valid address?", True),
    ("My email is bob@example.com. Is it a Gmail address?", True),        # a pronoun points back at the value
    ("My name is Bob. Is it a palindrome?", True),
    ("My name is Anna. Write it backwards.", True),
    ("It is my birthday, my name is Tom. Greet me.", False),               # "it" before the value is not about it
    ("我叫王小明，我的名字有什么寓意？", True),
    ("My order A7731920 has not arrived. Where is my order?", True),
    ("My name is Alice. Recommend a book for me.", False),
    ("Write a thank-you note to bob@example.com for the meeting on May 3", False),
    ("My order number is A7731920. Please write a complaint letter.", False),
    ("我的手机号是13912345678，帮我写个签名", False),
])
def test_a_request_about_its_personal_value_is_told_from_one_that_carries_it(text, about):
    templated = template_request(text)
    assert templated.personal and templated.about_value == about


@pytest.mark.parametrize("answer", ["Yes, Alice is a traditionally female name.", "Alice has 5 letters.",
                                    "Alice means 'noble' in Old German."])
def test_an_answer_that_states_a_property_of_the_value_is_not_templated(answer):
    assert template_answer(answer, template_request("My name is Alice. Tell me about it.").values) is None
    assert template_answer("Alice, I would recommend Dune.", template_request("My name is Alice.").values) is not None


def test_a_chinese_question_word_is_not_taken_for_a_name():
    assert not has_pii("我的名字是什么意思？") and ("name", "王小明") in [
        (e.kind, e.value) for e in find_entities("我叫王小明")]


def test_non_personal_requests_stay_literal_and_fill_needs_every_value():
    assert template_request("Tell me about Paris on May 3").values == {}
    assert fill_answer("Hi \u27e6EMAIL_1\u27e7", {}) is None
    assert fill_answer("no placeholders", {}) == "no placeholders"


_user = st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=12)


@given(a=_user, b=_user, domain=st.sampled_from(["example.com", "mail.cn", "corp.io"]))
def test_template_then_fill_round_trips_for_any_address(a, b, domain):
    first, second = f"{a}@{domain}", f"{b}x@{domain}"
    stored = template_answer(f"Hello {first}, welcome!", template_request(f"Greet {first}").values)
    assert stored == "Hello \u27e6EMAIL_1\u27e7, welcome!"
    assert fill_answer(stored, template_request(f"Greet {first}").values) == f"Hello {first}, welcome!"
    assert fill_answer(stored, template_request(f"Greet {second}").values) == f"Hello {second}, welcome!"
