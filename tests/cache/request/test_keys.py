"""Key normalization and composition: same question -> same key, anything that changes the answer -> another key."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strata.cache.request.keys import NotCacheable, build_key, sampling_key
from strata.cache.request.normalize import normalize_text
from strata.cache.request.request import CacheRequest


def req(text="What is the capital of France?", *, tenant="default", model="m@1", system=None, history=(), **sampling):
    messages = ([{"role": "system", "content": system}] if system else []) + list(history) + \
        [{"role": "user", "content": text}]
    return CacheRequest(tenant, model, messages, sampling or {"temperature": 0})


def test_normalize_whitespace_newlines_and_cjk_punctuation():
    assert normalize_text("  a \t b\u3000c  ") == "a b c"
    assert normalize_text("a\r\nb\rc") == "a\nb\nc"
    assert normalize_text("\n \n  x = 1\n    y = 2  \n\n") == "  x = 1\n    y = 2"     # indentation is kept
    # The old rules merged these (NFKC, per-line stripping, blank-line runs): each pair can want different answers.
    assert normalize_text("ＡＢＣ１２３，ｈｅｌｌｏ") == "ＡＢＣ１２３，ｈｅｌｌｏ"
    assert normalize_text("a\n\n\n\n b") == "a\n\n\n\n b"
    assert normalize_text("怎么重置密码？！") == "怎么重置密码?!"                       # an input method's width
    assert normalize_text("Why does print（1）fail？") == "Why does print（1）fail？"
    assert normalize_text("What does print('a  b')  print?") == "What does print('a  b') print?"
    assert normalize_text("Paris", casefold=True) == "paris"
    assert normalize_text("Paris") == "Paris"
    with pytest.raises(ValueError):
        normalize_text(None)


@given(st.text(), st.booleans())
def test_normalize_is_idempotent(text, casefold):
    once = normalize_text(text, casefold=casefold)
    assert normalize_text(once, casefold=casefold) == once


# Characters that NFKC folds onto ASCII letters and digits but that a question can mean literally (x² vs x2).
_DIGIT_TWINS = {str(d): [chr(0xFF10 + d), "⁰¹²³⁴⁵⁶⁷⁸⁹"[d], "₀₁₂₃₄₅₆₇₈₉"[d]] for d in range(10)}
_LETTER_TWINS = {c: [chr(ord(c) + 0xFEE0)] for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
_TWINS = _DIGIT_TWINS | _LETTER_TWINS
_WORD = st.text(st.sampled_from(sorted(_TWINS) + list("?!.,-+=()")), min_size=1, max_size=8)


@given(st.lists(_WORD, min_size=1, max_size=6), st.data())
def test_compatibility_forms_never_share_a_key(words, data):
    text = " ".join(words)
    at = data.draw(st.sampled_from([i for i, c in enumerate(text) if c in _TWINS]) if any(c in _TWINS for c in text)
                   else st.nothing())
    twin = data.draw(st.sampled_from(_TWINS[text[at]]))
    assert build_key(req(text)).exact != build_key(req(text[:at] + twin + text[at + 1:])).exact


_LINE = st.text(st.characters(blacklist_categories=("Cs", "Zl", "Zp"), blacklist_characters="\r\n\x0b\x0c\x1c\x1d\x1e\x85"),
                max_size=20).map(str.strip).filter(bool)


@given(st.lists(_LINE, min_size=2, max_size=5), st.data())
def test_indentation_inside_a_multi_line_prompt_is_never_touched(lines, data):
    indents = data.draw(st.lists(st.sampled_from(["", " ", "  ", "    ", "\t"]), min_size=len(lines), max_size=len(lines)))
    i = data.draw(st.integers(0, len(lines) - 1))
    other = list(indents)
    other[i] = data.draw(st.sampled_from([x for x in ["", " ", "  ", "    ", "\t", "\t "] if x != indents[i]]))

    def program(ind):
        return "\n".join(p + line for p, line in zip(ind, lines, strict=True))

    assert build_key(req(program(indents))).exact != build_key(req(program(other))).exact
    assert normalize_text(program(indents)) == program(indents).rstrip()


_PROSE_WORD = st.text(st.characters(whitelist_categories=("L", "N"), whitelist_characters="?!.,-"), min_size=1, max_size=10)
_GAP = st.text(st.sampled_from([" ", "\t", "\u3000", "\u00a0"]), min_size=1, max_size=3)


@given(st.lists(_PROSE_WORD, min_size=1, max_size=8), st.data())
def test_whitespace_only_prose_differences_share_a_key(words, data):
    gaps = data.draw(st.lists(_GAP, min_size=len(words) - 1, max_size=len(words) - 1))
    outer = data.draw(st.tuples(st.sampled_from(["", " ", "\n", "\t\u3000", " \r\n "]), st.sampled_from(["", " ", "\n", "\r\n\n"])))
    spaced = outer[0] + words[0] + "".join(g + w for g, w in zip(gaps, words[1:], strict=True)) + outer[1]
    assert build_key(req(spaced)).exact == build_key(req(" ".join(words))).exact


def test_same_question_typed_differently_shares_key():
    a = build_key(req("What is the capital of France?"))
    b = build_key(req("  What is the capital\tof France? \n"))        # extra and odd spaces, a trailing newline
    assert a.exact == b.exact
    # A full-width "？" after Latin text used to fold too; it now keeps its width (it may be what is asked about),
    # and the semantic layer serves that variant.
    assert build_key(req("What is the capital of France？")).exact != a.exact
    assert build_key(req("巴黎是哪个国家的首都？")).exact == build_key(req("巴黎是哪个国家的首都?")).exact
    assert build_key(req("what is the capital of france?"), casefold=True).exact == \
        build_key(req("What Is The Capital Of France?"), casefold=True).exact
    assert build_key(req("what is the capital of france?")).exact != a.exact   # no folding by default


def test_full_width_personal_data_is_still_templated():
    key = build_key(req("My email is ｂｏｂ＠ｅｘａｍｐｌｅ．ｃｏｍ, write a greeting"))
    assert key.personal and "ｂｏｂ" not in key.text and key.values == {"\u27e6EMAIL_1\u27e7": "ｂｏｂ＠ｅｘａｍｐｌｅ．ｃｏｍ"}


def test_everything_that_changes_the_answer_changes_the_key():
    base = build_key(req()).exact
    variants = [
        req(tenant="other"), req(model="m@2"), req(system="Answer in French."),
        req(history=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
        req(temperature=0, max_tokens=10), req(temperature=0.7, top_p=0.5, seed=1), req(temperature=0, stop=["\n"]),
        req(temperature=0, tools=[{"type": "function", "function": {"name": "f"}}]),
        req(temperature=0, response_format={"type": "json_object"}),
        req("What is the capital of Spain?"),
    ]
    keys = {build_key(v).exact for v in variants}
    assert base not in keys and len(keys) == len(variants)


def test_sampling_is_sorted_and_canonical():
    assert sampling_key({"top_p": 1, "temperature": 0}) == sampling_key({"temperature": 0.0, "top_p": 1.0})
    assert sampling_key({"stop": "x"}) == sampling_key({"stop": ["x"]})
    assert sampling_key({"stream": True, "user": "u1", "seed": None}) == sampling_key({})
    with pytest.raises(ValueError, match="not JSON"):
        sampling_key({"temperature": object()})


def test_sampled_seeds_past_two_to_the_53_keep_their_own_keys():
    """A float holds every integer only up to 2**53; seeds go to 2**64 - 1, and one key for neighbouring seeds served
    one seed's sample for another's (audit 12)."""
    seeds = [2 ** 63, 2 ** 63 + 1, 2 ** 63 + 1000, 2 ** 64 - 1, 2 ** 53 + 1]
    assert len({sampling_key({"temperature": 0.9, "seed": s}) for s in seeds}) == len(seeds)
    assert sampling_key({"temperature": 0.9, "seed": 2.0 ** 60}) == sampling_key({"temperature": 0.9, "seed": 2 ** 60})
    assert sampling_key({"temperature": 0.9, "seed": 7}) == sampling_key({"temperature": 0.9, "seed": 7.0})
    assert "10000000000" in sampling_key({"temperature": 0.9, "seed": 10 ** 400})     # no OverflowError either


def test_greedy_keys_ignore_what_greedy_decoding_never_reads():
    """seed, top_p and top_k split greedy answers for nothing, and so did 0 against 1e-6 (lost hits, audit 7)."""
    greedy = sampling_key({"temperature": 0})
    assert sampling_key({"temperature": 1e-6, "seed": 7, "top_p": 0.5, "top_k": 40}) == greedy
    sampled = [sampling_key({"temperature": 0.7, **extra}) for extra in ({}, {"seed": 7}, {"top_p": 0.5}, {"top_k": 40})]
    assert len(set(sampled)) == 4 and greedy not in sampled


def test_partition_layout_and_personal_templating():
    key = build_key(req("My email is bob@example.com, write a greeting"))
    tenant, model, *hashes = key.partition.split("|")
    assert (tenant, model, len(hashes)) == ("default", "m@1", 3)
    assert key.personal and "bob@example.com" not in key.text
    other = build_key(req("My email is amy@example.org, write a greeting"))
    assert other.exact == key.exact and other.flight != key.flight   # one entry, two separate computations


def test_a_verbatim_completion_prompt_folds_nothing_and_is_never_templated():
    """A completion prompt is text the model continues: a trailing space or newline, CR LF, a tab or a second space
    is context the next token depends on (audit: 'def add(a, b):' was served for the prompt with a newline)."""
    def verbatim(text):
        return build_key(CacheRequest("t", "m", [{"role": "user", "content": text}], {"temperature": 0},
                                      verbatim=True))
    texts = ["def add(a, b):", "def add(a, b):\n", "def add(a, b): ", "\n\ndef add(a, b):", "def  add(a, b):",
             "def\tadd(a, b):", "a\r\nb", "a\nb"]
    assert len({verbatim(t).exact for t in texts}) == len(texts)
    assert len({build_key(req(t)).exact for t in texts}) < len(texts)            # a chat question folds them
    folded = build_key(CacheRequest("t", "m", [{"role": "user", "content": "The capital of FRANCE is"}],
                                    {"temperature": 0}, verbatim=True), casefold=True)
    assert folded.exact != build_key(CacheRequest("t", "m", [{"role": "user", "content": "the capital of france is"}],
                                                  {"temperature": 0}, verbatim=True), casefold=True).exact
    personal = verbatim("Dear bob@example.com,")
    assert not personal.personal and personal.text == "Dear bob@example.com,"
    with pytest.raises(NotCacheable, match="empty-query"):
        verbatim(" \n")
    with pytest.raises(ValueError, match="verbatim"):
        CacheRequest("t", "m", [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], verbatim=True)


@pytest.mark.parametrize("bad", [
    dict(tenant=""), dict(tenant="a|b"), dict(model=""), dict(messages=[]), dict(messages=[{"role": "x", "content": "a"}]),
    dict(messages=[{"role": "user", "content": 3}]), dict(sampling=[]), dict(mode="fast"),
])
def test_bad_requests_raise_value_error(bad):
    fields = dict(tenant="t", model="m", messages=[{"role": "user", "content": "hi"}], sampling={})
    with pytest.raises(ValueError):
        CacheRequest(**(fields | bad))


def test_uncacheable_shapes():
    with pytest.raises(NotCacheable, match="not-a-user-turn"):
        build_key(CacheRequest("t", "m", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]))
    with pytest.raises(NotCacheable, match="non-text-content"):
        build_key(CacheRequest("t", "m", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]))
    with pytest.raises(NotCacheable, match="empty-query"):
        build_key(CacheRequest("t", "m", [{"role": "user", "content": "   "}]))
    parts = CacheRequest("t", "m", [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert build_key(parts).query == "hi"


def test_typed_placeholder_brackets_are_never_keyed_as_another_users_templated_request():
    """Audit 12: "My name is ⟦NAME_1⟧. Write ..." keyed literally as exactly what "My name is Alice. Write ..."
    templates to, so its answer (written by whoever typed it) was served to Alice as an exact hit."""
    planted = "My name is \u27e6NAME_1\u27e7. Write a two-line poem about the sea for me."
    victim = build_key(CacheRequest("t", "m", [{"role": "user", "content": planted.replace("\u27e6NAME_1\u27e7",
                                                                                            "Alice")}]))
    assert victim.personal and victim.text == planted
    for text in (planted, "Explain the \u27e7 bracket", "What does \u27e6x\u27e7 mean in maths?"):
        with pytest.raises(NotCacheable, match="placeholder-text"):
            build_key(CacheRequest("t", "m", [{"role": "user", "content": text}]))


def test_system_messages_are_keyed_where_they_stand_and_even_when_empty():
    """An empty system message replaces a chat template's default one, and one moved after a turn renders elsewhere:
    both are other prompts, so other keys (they shared one, and the first answer was served for both)."""
    question = {"role": "user", "content": "What is your name?"}
    turns = [{"role": "user", "content": "Say hi in French."}, {"role": "assistant", "content": "Salut !"}]
    system = {"role": "system", "content": "Answer in French."}
    keys = [build_key(CacheRequest("t", "m@1", messages, {"temperature": 0})).exact for messages in (
        [question], [{"role": "system", "content": ""}, question], [system, *turns, question],
        [*turns, system, question])]
    assert len(set(keys)) == 4

