"""Cacheability policy: bypass classes (EN + ZH), TTL classes, the temperature rule, request cache flags."""
import json

import pytest

from strata.cache.request.keys import build_key
from strata.cache.request.policy import Policy
from strata.cache.request.request import CacheRequest
from strata.server.bench.data_files import packaged


def decide(policy, text, sampling=None, **flags):
    r = CacheRequest("t", "m", [{"role": "user", "content": text}],
                     {"temperature": 0} if sampling is None else sampling, **flags)
    return policy.decide(r, build_key(r))


@pytest.fixture(scope="module")
def policy():
    return Policy.load()


@pytest.mark.parametrize("text, reason", [
    ("What's the weather in Paris today?", "realtime"), ("北京今天天气怎么样", "realtime"),
    ("What is Tesla's stock price?", "realtime"), ("Who is the current president of France?", "realtime"), ("比特币现在多少钱", "realtime"),
    ("Transfer $200 to Alice", "money"), ("帮我转账给妈妈", "money"),
    ("Is it legal to park here overnight?", "legal"), ("开车打电话违法吗", "legal"),
    ("How do I reset my password?", "security"), ("我的验证码是多少", "security"),
])
def test_bypass_classes(policy, text, reason):
    d = decide(policy, text)
    assert d.bypass and not d.write and d.reason == reason


def test_full_width_questions_are_classified_like_half_width_ones(policy):
    """Keys keep the width now (ｘ２ is not x2), so the rules read an NFKC view: a question typed with an input
    method must not slip past a bypass class."""
    rows = [json.loads(line) for line in packaged("bypass_queries.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["why"] != "pii" and any("!" <= c <= "~" for c in r["query"])]
    assert len(rows) >= 30
    for r in rows:
        wide = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in r["query"])
        narrow = decide(policy, r["query"])
        assert narrow.bypass and decide(policy, wide).reason == narrow.reason, r


@pytest.mark.parametrize("text, ttl_class, ttl_s", [
    ("What is the status of the build?", "status", 300),
    ("Explain how TCP congestion control works", "conceptual", 30 * 86400),
    ("为什么天空是蓝色的", "conceptual", 30 * 86400),
    ("What is the capital of Australia?", "factual", 7 * 86400),
    ("澳大利亚的首都是哪里", "factual", 7 * 86400),
    ("Write a haiku about autumn", "default", 3600),
    ("Write a haiku about rain", "default", 3600),
])
def test_ttl_classes(policy, text, ttl_class, ttl_s):
    d = decide(policy, text)
    assert (d.lookup_exact, d.lookup_semantic, d.write) == (True, True, True)
    assert (d.ttl_class, d.ttl_s, d.reason) == (ttl_class, ttl_s, ttl_class)


def test_bypass_looks_at_the_whole_conversation(policy):
    r = CacheRequest("t", "m", [{"role": "user", "content": "What's the weather in London today?"},
                                {"role": "assistant", "content": "Sunny."},
                                {"role": "user", "content": "And in Paris?"}], {"temperature": 0})
    assert policy.decide(r, build_key(r)).reason == "realtime"


def test_an_assistant_turn_can_make_the_question_real_time(policy):
    """Audit 12: the rules read the user turns only, so "Yes please" after an offer to look up the weather was cached
    for an hour. The system prompt stays unread by design: it partitions the cache, and a deployment whose prompt
    makes every answer time-dependent turns the cache off (docs/request-cache-interfaces.md)."""
    def reason(earlier: dict) -> str:
        r = CacheRequest("t", "m", [earlier, {"role": "user", "content": "Yes please"}], {"temperature": 0})
        return policy.decide(r, build_key(r)).reason

    assert reason({"role": "assistant", "content": "Shall I check the current weather and today's forecast?"}) \
        == "realtime"
    assert reason({"role": "assistant", "content": "Shall I explain how binary search works?"}) != "realtime"
    assert reason({"role": "system", "content": "Always mention today's date."}) != "realtime"


def test_temperature_rules():
    seeded = Policy.load()
    d = decide(seeded, "Write a haiku", {"temperature": 0.7})
    assert d.bypass and d.reason == "sampling"
    d = decide(seeded, "Write a haiku", {"temperature": 0.7, "seed": 1})
    assert (d.lookup_exact, d.lookup_semantic, d.write_semantic) == (True, False, False)
    assert decide(seeded, "Write a haiku", {}).reason == "sampling"       # absent temperature = 1.0 by default
    assert not decide(Policy.load(default_temperature=0.0), "Write a haiku", {}).bypass
    assert decide(Policy.load(temperature_rule="bypass"), "Write", {"temperature": 0.5, "seed": 1}).bypass
    d = decide(Policy.load(temperature_rule="exact"), "Write", {"temperature": 0.5})
    assert d.lookup_exact and not d.lookup_semantic
    assert decide(seeded, "Write", {"temperature": 0, "n": 2}).reason == "n>1"
    with pytest.raises(ValueError, match="temperature"):
        decide(seeded, "Write", {"temperature": "hot"})


def test_temperatures_the_engine_decodes_greedily_are_cached_as_greedy(policy):
    from strata.cache.request.policy import GREEDY_BELOW
    from strata.server.engine.sampling_params import MIN_TEMPERATURE

    assert GREEDY_BELOW == MIN_TEMPERATURE
    assert not decide(policy, "Write a haiku", {"temperature": 1e-45}).bypass
    assert decide(policy, "Write a haiku", {"temperature": MIN_TEMPERATURE}).reason == "sampling"


def test_request_flags(policy):
    assert decide(policy, "Write a haiku", no_store=True).reason == "no-store"
    assert decide(policy, "Write a haiku", mode="off").reason == "mode-off"
    d = decide(policy, "Write a haiku", no_cache=True)
    assert d.bypass and d.write and d.reason == "no-cache"
    d = decide(policy, "Write a haiku", mode="refresh")
    assert d.bypass and d.write and d.reason == "refresh"
    d = decide(policy, "Write a haiku", mode="exact-only")
    assert d.lookup_exact and not d.lookup_semantic
    d = decide(policy, "Once upon a time", verbatim=True)     # a completion prompt: continuation, not a question
    assert d.lookup_exact and d.write and not d.lookup_semantic and not d.write_semantic


@pytest.mark.parametrize("text", [
    "What is the temperature in London?", "Is it sunny outside?", "Quel temps fait-il maintenant ?",
    "¿Qué tiempo hace ahora en Madrid?", "Wie ist das Wetter jetzt in Berlin?", "Qual é a previsão do tempo hoje?",
    "Che tempo fa oggi a Roma?", "Combien coûte un bitcoin ?",
])
def test_real_time_questions_of_other_wordings_and_languages_bypass(policy, text):
    assert decide(policy, text).reason == "realtime"


@pytest.mark.parametrize("text, reason", [
    ("What's the date?", "realtime"), ("What day of the week is it?", "realtime"), ("What year is it?", "realtime"),
    ("How many days until Christmas?", "realtime"), ("Who is the president of the United States?", "realtime"),
    ("What is the USD to EUR conversion?", "realtime"), ("Any news on the election?", "realtime"),
    ("What's trending on Twitter?", "realtime"), ("Move 200 euros from savings to checking", "money"),
    ("Reset my pw please", "security"), ("What's the WiFi code?", "security"),
    ("Is it lawful to record a phone call?", "legal"), ("Do I need a permit to build a fence?", "legal"),
    ("Can my employer fire me for being sick?", "legal"),
    ("How many yen is a dollar worth?", "realtime"), ("Convert 100 dollars to euros", "realtime"),
    ("What's gold trading at?", "realtime"), ("Who's the president of France?", "realtime"),
    ("Recommend a restaurant near me", "realtime"), ("Wie spät ist es?", "realtime"), ("¿Qué hora es?", "realtime"),
    ("I forgot my passwd", "security"), ("Can I get sued for this?", "legal"),
    ("Is it against the law to record a call?", "legal"), ("What should I invest my savings in?", "money"),
    # audit 12: cached for 7 days or an hour before
    ("Which day of the week is it?", "realtime"), ("What is the EUR USD rate?", "realtime"),
    ("What's the time in Tokyo?", "realtime"), ("How cold is it in Berlin?", "realtime"),
    ("How hot is it in Paris?", "realtime"), ("Quelle heure est-il ?", "realtime"), ("Che ore sono?", "realtime"),
])
def test_phrasings_an_audit_found_cached_now_bypass(policy, text, reason):
    assert decide(policy, text).reason == reason


@pytest.mark.parametrize("text", ["How do I move 3 columns to the left in Excel?", "Who was the first president of the US?",
                                  "What is a news aggregator?", "Explain the MIT license", "What does a landlord do?",
                                  "What is the time complexity of merge sort?", "What is the time signature of a waltz?"])
def test_their_neighbours_that_do_not_depend_on_time_or_person_stay_cacheable(policy, text):
    assert not decide(policy, text).bypass


def test_a_question_about_a_personal_value_bypasses(policy):
    assert decide(policy, "My name is Alice. How many letters does my name have?").reason == "personal-value"
    assert not decide(policy, "My name is Alice. Recommend a book for me.").bypass


@pytest.mark.parametrize("text", ["Какая сегодня погода?", "今日の天気は？", "오늘 날씨 어때?", "ما هو سعر الذهب",
                                  "Bugün hava nasıl?", "Hôm nay thời tiết thế nào?"])     # Latin letters of others
def test_languages_the_rules_cannot_read_bypass(policy, text):
    d = decide(policy, text)
    assert d.bypass and not d.write and d.reason == "unvetted-language"


@pytest.mark.parametrize("text, reason", [
    ("現在比特幣的價格是多少？", "realtime"), ("美元兌台幣匯率是多少？", "realtime"), ("我忘記密碼了，怎麼辦？", "security"),
    ("我的驗證碼是什麼？", "security"), ("請把五千元轉帳到我媽媽的帳戶", "money"), ("這樣做違法嗎？需要找律師嗎？", "legal"),
    ("请把五千元转帐到我的帐户", "money"),
])
def test_traditional_chinese_is_read_as_its_simplified_twin(policy, text, reason):
    """The rules are written in Simplified characters; Traditional text (and the 帐 variant of 账) was cached."""
    assert decide(policy, text).reason == reason


@pytest.mark.parametrize("text", ["Café au lait recipe", "Explain naïve Bayes", "什么是机器学习", "Say hi 😀",
                                  "What is the boiling temperature of water?", "Who painted the ceiling in Zürich's Großmünster?",
                                  "Convert this recipe to metric units", "How do I invest time in learning Rust?"])
def test_latin_and_chinese_text_is_still_read_by_the_rules(policy, text):
    assert not decide(policy, text).bypass


def test_custom_rules_file(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"bypass": {"pets": ["\\bcat\\b", "猫"]}, "default": {"name": "d", "ttl_s": 60}}))
    p = Policy.load(path)
    assert decide(p, "Is my cat hungry").reason == "pets"
    assert decide(p, "Weather today?").ttl_s == 60
    assert decide(p, "Is my CAT hungry").reason == "pets"
    assert not decide(p, "Моя кошка голодна?").bypass            # no "scripts": every script is read
    path.write_text(json.dumps({"bypass": {"pets": ["\\bcat\\b"]}, "scripts": ["latin", "cyrillic"]}))
    assert not decide(Policy.load(path), "Моя кошка голодна?").bypass
    assert decide(Policy.load(path), "ネコ").reason == "unvetted-language"
    for bad in ({"bypass": {}}, {"bypass": {"x": ["("]}}, {"bypass": {"x": ["a"]}, "ttl_classes": [{"name": "s"}]},
                {"bypass": {"x": ["Cat"]}}, {"bypass": {"x": ["a"]}, "scripts": "LATIN"}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            Policy.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        Policy.load(path)
    with pytest.raises(ValueError, match="unknown ttl_class"):
        p.ttl_of("weekly")
