"""The contrast rule: the same words but one, a word and its opposite or a sibling of its class, is another question;
any other rewording, a spelling of the same word, or a swap of two words is left to the model."""
import pytest

from strata.cache.request.contrast import EN_CLASSES, contrasted, siblings
from strata.cache.request.cross_encoder import RULED_OUT, shared_cross_encoder


@pytest.mark.parametrize("a, b", [
    ("How do I sort a list in ascending order in Python?", "How do I sort a list in descending order in Python?"),
    ("如何降低血压", "如何升高血压"),
    ("左眼皮跳是什么预兆", "右眼皮跳是什么预兆"),            # 左眼 / 右眼 reach into the shared 眼
    ("星期一去银行办业务", "星期三去银行办业务"),            # 星期 is shared
    ("上个月的账单怎么查", "下个月的账单怎么查"),
    ("translate to Spanish: 'Good morning'", "translate to French: 'Good morning'"),
    ("Enable two-factor login", "Disable two-factor login"),
    ("怎么用python读取excel文件", "怎么用java读取excel文件"),  # English words inside Chinese text
    ("Convert 5 kilometers to miles", "Convert 5 feet to miles"),
    ("Give me three tips for better sleep.", "Give me five tips for better sleep."),   # number words
    ("纪念碑谷第四关怎么过", "纪念碑谷第十关怎么过"),
    ("Explain the causes of World War I", "Explain the consequences of World War I"),
    # audit (2026-12-08): served at 0.05, the Chinese ones at the default bound too
    ("为什么银行卡绑定不了支付宝", "为什么银行卡解绑不了支付宝"),
    ("信用卡的账单日是几号", "信用卡的还款日是几号"),
    ("怎么设置支付密码", "怎么修改支付密码"),
    ("Why do volcanoes erupt?", "How do volcanoes erupt?"),
    ("How to read a CSV file in pandas?", "How to write a CSV file in pandas?"),
    ("Which is bigger, Jupiter or Saturn?", "Which is smaller, Jupiter or Saturn?"),
    ("Are all mushrooms poisonous?", "Are any mushrooms poisonous?"),
    ("My dog keeps scratching his ears. Should I take him to the vet?",
     "My cat keeps scratching his ears. Should I take him to the vet?"),
])
def test_a_single_word_contrast_is_another_question(a, b):
    assert contrasted(a, b) and contrasted(b, a)


@pytest.mark.parametrize("a, b", [
    ("How far is 5 km?", "How far is 5 kilometers?"),          # one unit, two spellings
    ("What do leaves do in autumn?", "What do leaves do in fall?"),
    ("Should I eat before or after exercise?", "Should I eat after or before exercise?"),   # a swap, not a contrast
    ("How do I sort a list in descending order?", "How do I sort a list from largest to smallest?"),
    ("为什么花呗不能用", "花呗为什么不能用"),
    ("What is the capital of France?", "What is the capital of France?"),
    ("What is the capital of France?", "Tell me France's capital"),
    ("Give me three tips for better sleep.", "Give me 3 tips for better sleep."),    # the figures rule's call
    ("二手车怎么买", "两手车怎么买"),                                                  # 二|两: one number
    ("What is the length of a marathon?", "What is the distance of a marathon?"),    # one meaning here
    ("借呗逾期千万不要做什么", "借呗逾期万万不要做什么"),                              # 千万 / 万万: adverbs
    ("十分感谢你的帮助", "万分感谢你的帮助"),
    ("left", "left"),
    ("", "right"),
])
def test_rewordings_spellings_and_swaps_are_left_to_the_model(a, b):
    assert not contrasted(a, b)


def test_a_members_spellings_are_never_its_siblings():
    table = siblings(("km|kilometers miles", "hot cold"))
    assert table["km"] == ["miles"] and table["kilometers"] == ["miles"] and table["miles"] == ["km", "kilometers"]
    assert table["hot"] == ["cold"]
    shipped = siblings(EN_CLASSES)          # the training generator's replacements too: "5 km" never "5 kilometers"
    assert "kilometers" not in shipped["km"] and "metres" not in shipped["meters"] and "lb" not in shipped["pounds"]
    assert "miles" in shipped["km"]


def test_the_second_stage_rules_such_a_pair_out_and_says_so_in_its_version():
    """Audit (2026-12-08): at a 5% bound "sort ... in descending order" was served the answer to "... ascending
    order" (decision score 6.19) and "如何升高血压" the one to "如何降低血压" (5.90)."""
    ce = shared_cross_encoder()
    assert "contrast" in ce.version.split("+")
    pair = ("How do I sort a list in ascending order in Python?", "How do I sort a list in descending order in Python?")
    assert ce.logit(*pair) > 0                       # what the model alone says: "same"
    assert ce.score(*pair) == RULED_OUT
