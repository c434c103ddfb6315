"""``bench/ruler.py``: RULER-style prompts are deterministic, of the length asked for, hold their answers, and are
scored by string match; the longctx plan and its checks (no model: SmolLM2's tokenizer only)."""

from __future__ import annotations

import pytest

from kvshelf.bench import ruler
from kvshelf.bench.longctx import DEFAULT_PLAN, check_plan, plan_of
from kvshelf.kvstore.errors import KVShelfError


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvshelf.adapters.model import convert_bundled

    return AutoTokenizer.from_pretrained(str(convert_bundled("smollm2-135m")))


@pytest.fixture(scope="module")
def docs(corpus_path) -> list[ruler.Document]:
    return ruler.corpus_documents(corpus_path)


@pytest.mark.parametrize("task", ruler.TASKS)
def test_a_sample_is_deterministic_close_to_its_length_and_holds_its_answers(tokenizer, docs, task):
    sample = ruler.generate(task, tokenizer, docs, 1024, seed=3)
    again = ruler.generate(task, tokenizer, docs, 1024, seed=3)
    assert sample == again
    target = 1024 - ruler.NEW_TOKENS[task]
    assert target - 80 <= len(sample.ids) <= target, (len(sample.ids), target)
    assert 0 < sample.context_tokens < len(sample.ids)
    text = tokenizer.decode(sample.ids)
    context = tokenizer.decode(sample.ids[:sample.context_tokens])
    assert sample.answers and all(a in context for a in sample.answers), sample.answers
    if task.startswith("niah") or task == "qa":  # each value (or the gold title) is in the prompt once
        assert all(text.count(a) == 1 for a in sample.answers), [text.count(a) for a in sample.answers]
    if task == "vt":  # every variable is assigned once
        assert all(context.count(f"VAR {a} =") == 1 for a in sample.answers)
    assert ruler.score(tokenizer.decode(sample.ids[sample.context_tokens:]), sample.answers) < 1.0  # not given away


def test_another_seed_or_length_gives_another_sample(tokenizer, docs):
    a = ruler.generate("niah_multikey", tokenizer, docs, 1024, seed=0)
    assert ruler.generate("niah_multikey", tokenizer, docs, 1024, seed=1).answers != a.answers
    longer = ruler.generate("niah_multikey", tokenizer, docs, 2048, seed=0)
    assert 2048 - 12 - 80 <= len(longer.ids) <= 2048 - 12


def test_answer_counts_follow_the_task(tokenizer, docs):
    counts = {t: len(ruler.generate(t, tokenizer, docs, 1024, seed=0).answers) for t in ruler.TASKS}
    assert counts == {"niah_single": 1, "niah_multikey": 1, "niah_multivalue": 4, "niah_multiquery": 4, "vt": 5,
                      "cwe": 10, "fwe": 3, "qa": 1}


def test_cwe_and_fwe_answers_are_the_most_frequent_words(tokenizer, docs):
    import re
    from collections import Counter

    cwe = ruler.generate("cwe", tokenizer, docs, 1024, seed=0)
    listed = Counter(re.findall(r"^\d+\. (\w+)$", tokenizer.decode(cwe.ids[:cwe.context_tokens]), re.MULTILINE))
    top = [w for w, _ in listed.most_common(11)]
    assert set(top[:10]) == set(cwe.answers) and listed[top[9]] > listed[top[10]]
    fwe = ruler.generate("fwe", tokenizer, docs, 1024, seed=0)
    words = Counter(tokenizer.decode(fwe.ids[:fwe.context_tokens]).split(". ", 1)[-1].split())
    words.pop("....", None)
    ranked = [w for w, _ in words.most_common(4)]
    assert tuple(ranked[:3]) == fwe.answers and words[ranked[2]] > words[ranked[3]]


def test_score_is_the_fraction_of_answers_found_case_insensitively():
    assert ruler.score("The numbers are 1234567 and 7654321.", ("1234567", "7654321", "1111111", "2222222")) == 0.5
    assert ruler.score("they are: ABCDE, fghij", ("abcde", "FGHIJ")) == 1.0
    assert ruler.score("", ("x",)) == 0.0
    with pytest.raises(ruler.TaskError):
        ruler.score("anything", ())


def test_bad_requests_are_our_errors_before_any_work(tokenizer, docs):
    with pytest.raises(KVShelfError, match="unknown task"):
        ruler.generate("niah_triple", tokenizer, docs, 1024, seed=0)
    with pytest.raises(KVShelfError, match="leave"):
        ruler.generate("cwe", tokenizer, docs, 100, seed=0)
    with pytest.raises(KVShelfError, match="unknown tasks"):
        check_plan(plan_of(("vt", "passkey"), None), (0.25,), 1, None)
    with pytest.raises(KVShelfError, match="8,192"):
        check_plan(plan_of(("vt",), (16384,)), (0.25,), 1, None)
    with pytest.raises(KVShelfError, match="budgets"):
        check_plan(plan_of(None, (1024,)), (0.25, 1.5), 1, None)
    with pytest.raises(KVShelfError, match="unknown methods"):
        check_plan(plan_of(None, (1024,)), (0.25,), 1, ("snapkv", "quest"))


def test_the_default_plan_is_every_task_at_4k_and_needles_and_perplexity_at_8k():
    assert plan_of(None, None) == list(DEFAULT_PLAN)
    assert {t for t, n in DEFAULT_PLAN if n == 4096} == set(ruler.TASKS)
    assert {t for t, n in DEFAULT_PLAN if n == 8192} == {*ruler.NEEDLE_TASKS, "ppl"}
    assert plan_of(("vt", "qa"), (1024, 2048)) == [("vt", 1024), ("qa", 1024), ("vt", 2048), ("qa", 2048)]
