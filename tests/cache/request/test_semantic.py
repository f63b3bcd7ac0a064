"""Semantic cache unit tests: hash embedder (no model), faiss index behaviour, tiers, partitions, the second stage."""
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from strata.cache.request.calibration import COSINE_WEIGHT, Tiers, TierTable, language_of
from strata.cache.request.embedders import HashEmbedder, load_embedder
from strata.cache.request.index import VectorIndex
from strata.cache.request.semantic import SemanticCache, SemanticMatch
from strata.server.bench.cache_quality import evaluate_pairs, run_bypass
from strata.server.tuning.pairs import Pair, load_pairs


def unit(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class FixedScorer:
    """Second-stage stand-in: the score is looked up by cached text; it counts what it reads."""

    def __init__(self, scores):
        self.scores, self.read = scores, []

    def score(self, cached, query):
        self.read.append(cached)
        return self.scores.get(cached, -10.0)


def test_hash_embedder_rows_are_unit_and_deterministic():
    emb = load_embedder("hash")
    x = emb.encode(["how do I sort a list", "如何对列表排序"])
    assert x.shape == (2, emb.dim) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(x, HashEmbedder().encode(["how do I sort a list", "如何对列表排序"]))


def test_unknown_embedder_and_bad_input_are_clear_errors():
    with pytest.raises(ValueError, match="unknown embedder"):
        load_embedder("word2vec")
    with pytest.raises(TypeError):
        HashEmbedder().encode("not a list")
    cache = SemanticCache(HashEmbedder(), Tiers(serve=0.9, similar=0.8))
    with pytest.raises(ValueError):
        cache.embed("   ")
    with pytest.raises(ValueError, match="dim"):
        cache.add("a", "q", "p", embedding=np.ones(3, np.float32))
    with pytest.raises(ValueError):
        Tiers(serve=0.8, similar=0.9)


@pytest.mark.parametrize("hnsw_min_size", [10_000, 50])
def test_index_search_remove_and_hnsw_switch(hnsw_min_size):
    rng = np.random.default_rng(0)
    x = unit(rng, 200, 32)
    index = VectorIndex(32, hnsw_min_size=hnsw_min_size)
    for i, v in enumerate(x):
        index.add(f"e{i}", v)
    assert index.is_hnsw == (hnsw_min_size <= 200)
    assert index.search(x[7], 1)[0][0] == "e7"
    assert index.remove("e7") and not index.remove("e7")
    assert "e7" not in [k for k, _ in index.search(x[7], 5)]
    for i in range(100):  # past the compaction point: ids must stay right after the rebuild
        index.remove(f"e{i}")
    assert len(index) == 100
    assert index.search(x[150], 1)[0][0] == "e150"
    assert all(k not in {f"e{i}" for i in range(100)} for k, _ in index.search(x[3], 20))


def test_lookup_tiers_and_partitions():
    cache = SemanticCache(HashEmbedder(), Tiers(serve=0.99, similar=0.5))
    cache.add("e1", "how do I sort a list in python", "tenantA")
    hit = cache.lookup("how do I sort a list in python", "tenantA")
    assert hit == SemanticMatch("e1", pytest.approx(1.0, abs=1e-5), "serve", "how do I sort a list in python")
    similar = cache.lookup("how do I sort a list in python quickly", "tenantA")
    assert similar is not None and similar.tier == "similar" and 0.5 <= similar.similarity < 0.99
    assert cache.lookup("how do I sort a list in python", "tenantB") is None
    assert cache.lookup("what is the weather in Paris tomorrow", "tenantA") is None


def test_second_stage_reads_the_closest_candidates_above_the_floor_and_the_best_score_wins():
    scorer = FixedScorer({"turn on two factor auth": 2.5, "enable two factor auth": -1.0, "two factor": 9.0})
    cache = SemanticCache(HashEmbedder(), Tiers(serve=4.0, similar=2.0, floor=0.3), scorer, top_k=5, rerank=2)
    cache.add("neg", "enable two factor auth", "p")
    cache.add("pos", "turn on two factor auth", "p")
    cache.add("far", "two factor", "p")
    hit = cache.lookup("enable two factor auth please", "p")
    assert hit.entry_id == "pos" and hit.tier == "similar"
    assert hit.score == pytest.approx(2.5 + COSINE_WEIGHT * hit.similarity)   # the logit, the cosine breaking ties
    assert len(scorer.read) == 2 and "two factor" not in scorer.read      # rerank=2: the third is never read
    scorer.scores["turn on two factor auth"] = 4.0
    assert cache.lookup("enable two factor auth please", "p").tier == "serve"
    scorer.scores.clear()
    assert cache.lookup("enable two factor auth please", "p") is None
    scorer.read.clear()
    cache.tiers = Tiers(serve=3.0, similar=1.0, floor=0.999)               # nothing above the floor: nothing read
    assert cache.lookup("enable two factor auth please", "p") is None and scorer.read == []


def test_a_language_nothing_certified_is_not_served():
    off = float("inf")
    table = TierTable(en=Tiers(serve=0.99, similar=0.5), zh=Tiers(serve=off, similar=off))
    cache = SemanticCache(HashEmbedder(), table)
    cache.add("en", "how do I sort a list", "p")
    cache.add("zh", "怎么重置密码", "p")
    assert cache.lookup("how do I sort a list", "p").entry_id == "en"
    assert cache.lookup("怎么重置密码", "p") is None and cache.min_similarity("怎么重置密码") == off


def test_a_question_in_another_language_never_answers():
    """A translation can sit as close as a paraphrase in a multilingual embedding, but its answer is in the other
    language: with or without the second stage, it is passed over (and not read), and a same-language candidate
    further down still may answer."""
    tiers = TierTable(en=Tiers(serve=0.9, similar=0.5), zh=Tiers(serve=0.9, similar=0.5))
    cache = SemanticCache(HashEmbedder(), tiers)
    french_capital = ("zh", 0.97, "法国的首都是什么？")
    assert cache.decide("What is the capital of France?", [french_capital]) is None
    hit = cache.decide("What is the capital of France?", [french_capital, ("en", 0.6, "capital city of France?")])
    assert hit.entry_id == "en" and hit.tier == "similar"
    assert cache.decide("法国的首都是哪里？", [("en", 0.97, "What is the capital of France?")]) is None
    assert cache.decide("iPhone 16 多少钱", [("en", 0.95, "iPhone 16 price")]) is None     # any ideograph: Chinese
    scorer = FixedScorer({"法国的首都是什么？": 9.0, "capital city of France?": 3.0})
    staged = SemanticCache(HashEmbedder(), TierTable(en=Tiers(serve=4.0, similar=2.0, floor=0.3),
                                                     zh=Tiers(serve=4.0, similar=2.0, floor=0.3)), scorer, rerank=1)
    hit = staged.decide("What is the capital of France?", [french_capital, ("en", 0.6, "capital city of France?")])
    assert hit.entry_id == "en" and scorer.read == ["capital city of France?"]   # the translation costs no read


def test_french_or_spanish_never_gets_an_english_answer_and_is_not_served_without_its_own_calibration():
    """Audit 15: the language rule only told CJK from the rest, so "Quelle est la capitale de la France ?" and
    "¿Cuál es la capital de Francia?" were served the cached English answer (semantic-similar, at 0.05)."""
    tiers = TierTable(en=Tiers(serve=0.9, similar=0.5), zh=Tiers(serve=0.9, similar=0.5))
    cache = SemanticCache(HashEmbedder(), tiers)
    english = [("en", 0.97, "What is the capital of France?")]
    for question in ("Quelle est la capitale de la France ?", "¿Cuál es la capital de Francia?",
                     "Was ist die Hauptstadt von Frankreich?", "Qual è la capitale della Francia?"):
        assert language_of(question) in ("fr", "es", "de", "it") and cache.decide(question, english) is None
        assert not cache.serves(question)                    # no French pairs calibrate a threshold
    assert cache.decide("What is the capital of France?", [("fr", 0.97, "Quelle est la capitale de la France ?")]) \
        is None
    for english_question in ("Define entropy", "ok", "Is quinoa gluten-free?", "How do I boil an egg?"):
        assert language_of(english_question) == "en"      # short English stays English (weak guesses are not enough)


def test_remove_replace_and_similar_ids():
    cache = SemanticCache(HashEmbedder(), Tiers(serve=0.99, similar=0.6))
    cache.add("a", "reset my password", "p1")
    cache.add("b", "reset my password", "p2")
    assert sorted(cache.similar_ids("reset my password", 0.99)) == ["a", "b"]
    assert cache.similar_ids("reset my password", 0.99, partition="p2") == ["b"]
    cache.add("a", "book a flight to Rome", "p1")  # same id, new text: replaces
    assert len(cache) == 2 and cache.lookup("reset my password", "p1") is None
    cache.remove("b")
    cache.remove("b")
    assert len(cache) == 1 and cache.similar_ids("reset my password", 0.5) == []


def test_embedding_is_computed_once():
    calls = []

    class Counting(HashEmbedder):
        def encode(self, texts):
            calls.append(texts)
            return super().encode(texts)

    cache = SemanticCache(Counting(), Tiers(serve=0.9, similar=0.8))
    a = cache.embed("same text")
    cache.add("x", "same text", "p")
    cache.lookup("same text", "p")
    assert len(calls) == 1 and not a.flags.writeable


def test_tier_table_routes_by_script():
    table = TierTable(en=Tiers(0.99, 0.97), zh=Tiers(0.9, 0.85))
    assert table.for_text("how do I reset my password") is table.en
    assert table.for_text("怎么重置密码") is table.zh and table.for_text("iPhone 16 多少钱") is table.zh


def test_load_pairs_formats_and_errors(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"cached": "怎么改昵称", "query": "昵称在哪里改", "same": true}\n', encoding="utf-8")
    assert load_pairs(jsonl) == [Pair("怎么改昵称", "昵称在哪里改", True, "zh", "p")]
    tsv = tmp_path / "p.tsv"
    tsv.write_text("id\tsentence1\tsentence2\tlabel\n1\ta b\tb a\t0\n", encoding="utf-8")
    assert load_pairs(tsv) == [Pair("a b", "b a", False, "en", "p")]
    bad = tmp_path / "p.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="unknown pairs format"):
        load_pairs(bad)
    with pytest.raises(FileNotFoundError):
        load_pairs(tmp_path / "missing.jsonl")
    (tmp_path / "q.jsonl").write_text('{"cached": "a"}\n')
    with pytest.raises(ValueError, match="lacks"):
        load_pairs(tmp_path / "q.jsonl")


def test_pairs_files_as_spreadsheets_write_them_load_and_broken_ones_name_file_and_line(tmp_path, caplog):
    """A byte-order mark is not part of the first column's name; undecodable bytes, bad JSON and questions that are
    not text are errors naming the file and the line; pairs with an empty side are left out, and a warning says so."""
    bom = tmp_path / "excel.csv"
    bom.write_text("sentence1,sentence2,label\nhow to sort,how do I sort,1\n,empty side,0\n", encoding="utf-8-sig")
    with caplog.at_level("WARNING"):
        assert load_pairs(bom) == [Pair("how to sort", "how do I sort", True, "en", "excel")]
    assert "1 of 2 pairs left out" in caplog.text
    for name, content, error in [
            ("latin1.csv", "sentence1,sentence2,label\ncaf\xe9,coffee,1\n".encode("latin-1"), "line 2: not UTF-8"),
            ("broken.jsonl", b'{"cached": "a", "query": "b", "same": true}\n\n{cached: "a"}\n', "line 3: not JSON"),
            ("numbers.jsonl", b'{"cached": 5, "query": "b", "same": true}\n', "line 1: both questions must be text"),
            ("empty.json", b"", "not JSON"),
            ("header_only.csv", b"sentence1,sentence2,label\n", "no pairs"),       # its columns are right
            ("nothing.csv", b"", "expected columns sentence1, sentence2, label")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=f"{name}: {error}"):
            load_pairs(tmp_path / name)


def test_quality_bench_scores_hits_misses_and_wrong_entries():
    pairs = [Pair("how do I sort a list in python", "how do I sort a list in python", True, "en", "t"),
             Pair("capital of france", "capital of france", False, "en", "t"),          # a hit on a negative
             Pair("weather in paris", "stock price of apple", True, "en", "t")]         # a miss
    result = evaluate_pairs(SemanticCache(HashEmbedder(), Tiers(serve=0.99, similar=0.9)), pairs)
    assert (result["hit_rate"], result["false_hit_rate"], result["precision"]) == (0.5, 1.0, 0.5)
    assert result["by_tier"]["serve"] == {"hits": 2, "correct_hits": 1, "precision": 0.5}
    assert result["by_lang"]["en"]["pairs"] == 3


def test_bypass_bench_serves_cacheable_and_bypasses_realtime(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text('{"query": "What is the capital of France?", "why": "control"}\n'
                    '{"query": "What time is it in Tokyo right now?", "why": "realtime"}\n')
    out = asyncio.run(run_bypass(path, SemanticCache(HashEmbedder(), Tiers(serve=0.99, similar=0.95))))
    assert out["by_why"] == {"control": {"queries": 1, "bypass_rate": 0.0}, "realtime": {"queries": 1, "bypass_rate": 1.0}}
    assert out["written"] == 1 and out["bypass_rate"] == 0.5


@pytest.mark.parametrize("text, says", [
    ('\ufeff{"query": "What is the capital of France?"}\n', None),                   # a BOM is fine
    ('{"query": "a"}\n{"query": \n', "line 2: not JSON"),
    ('"what is the query"\n', "line 1: expected an object with a 'query' string"),
    ('["query"]\n', "line 1: expected an object"),
])
def test_a_bypass_file_with_a_bad_line_names_it(tmp_path, text, says):
    """Audit 16: a BOM, a bad line or a JSON string holding the word "query" was a bare JSON error or a TypeError."""
    path = tmp_path / "b.jsonl"
    path.write_text(text, encoding="utf-8")
    run = run_bypass(path, SemanticCache(HashEmbedder(), Tiers(serve=0.99, similar=0.95)))
    if says is None:
        assert asyncio.run(run)["by_why"]
        return
    with pytest.raises(ValueError, match=f"b.jsonl: {says}"):
        asyncio.run(run)


@pytest.mark.parametrize("name,query,paraphrase,negative", [
    ("e5-small", "如何绑定银行卡", "银行卡怎么绑定到账户上", "如何解绑银行卡"),
    ("use-multilingual", "how do I reset my password", "how can I change my password", "how do I reset my API key"),
    ("minilm", "how do I reset my password", "how can I change my password", "how do I reset my API key"),
])
def test_real_embedder_ranks_paraphrase_above_hard_negative(name, query, paraphrase, negative):
    cache = SemanticCache.create(name, second_stage=False)
    cache.add("neg", negative, "p")
    cache.add("pos", paraphrase, "p")
    (best, s1, _), (_, s2, _) = cache.candidates(query, "p")
    assert best == "pos" and s1 > s2 and cache.embedder.dim == len(cache.embed(query))


def test_from_config_builds_the_configured_layer():
    from strata.cache.request.config import RequestCacheConfig

    cache = SemanticCache.from_config(RequestCacheConfig(embedder="e5-small", second_stage=False, semantic_top_k=3,
                                                         semantic_max_error=0.1))
    assert cache.embedder.name == "e5-small" and cache.scorer is None and cache.top_k == 3
    assert cache.calibration["max_error"] == 0.1 and not cache.calibration["second_stage"]
    with pytest.raises(ValueError):
        RequestCacheConfig(semantic_top_k=0)
    with pytest.raises(ValueError):
        RequestCacheConfig(semantic_max_error=0.0)


class SlowEmbedder(HashEmbedder):
    """Hash vectors that take a while, counting how many encode() calls overlap."""

    def __init__(self, concurrent: bool, calls: int):
        super().__init__()
        self.concurrent = concurrent
        self.active = self.most = 0
        self.lock = threading.Lock()
        self.all_in = threading.Barrier(calls)

    def encode(self, texts):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            self.all_in.wait(timeout=0.5)   # returns once every call is inside encode() at the same time
        except threading.BrokenBarrierError:
            pass
        with self.lock:
            self.active -= 1
        return super().encode(texts)


@pytest.mark.parametrize("concurrent", [True, False])
def test_only_a_concurrent_embedder_embeds_requests_side_by_side(concurrent):
    """A one-core-per-call embedder (e5-small on ONNX Runtime) runs requests in parallel; others one at a time."""
    embedder = SlowEmbedder(concurrent, calls=4)
    cache = SemanticCache(embedder, Tiers(serve=0.9, similar=0.8))
    with ThreadPoolExecutor(4) as pool:
        vectors = list(pool.map(cache.embed, [f"question number {i}" for i in range(4)]))
    assert embedder.most == (4 if concurrent else 1)
    np.testing.assert_array_equal(vectors[2], HashEmbedder().encode(["question number 2"])[0])
    assert load_embedder("e5-small").concurrent is True
