"""Verifiable tasks: generated answers checked by an independent computation, determinism in
(config, seed, index), the held-out split, users' JSONL with malformed rows named, identity for
resume, and the task tokenizer."""

from __future__ import annotations

import ast
import json
import operator
import re

import pytest

from llm_jax.config import ModelConfig
from llm_jax.data import harmony
from llm_jax.data.hf_tokenizer import HFTokenizer
from llm_jax.data.tasks import (
    TaskConfig,
    conversation,
    held_out,
    make_task,
    write_task_tokenizer,
)
from llm_jax.training.run_config import default_run_config, validate_run_config

OPS = {ast.Add: operator.add, ast.Sub: operator.sub}


def evaluate(expression: str) -> int:
    """The value of a `+` / `-` expression of integers, from Python's own parser."""
    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)  # a partial result below zero
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected {ast.dump(node)} in {expression!r}")
    return walk(ast.parse(expression, mode="eval").body)


def examples(task, split, n):
    return [task.example(split, i) for i in range(n)]


# --------------------------------------------------------------------------- generators

def test_arithmetic_answers_are_the_value_of_the_prompt_expression():
    task = make_task({"name": "arithmetic", "min_terms": 2, "max_terms": 4, "min_operand": 3,
                      "max_operand": 30, "eval_size": 50})
    seen_terms = set()
    for ex in examples(task, "train", 300) + examples(task, "eval", 50):
        expression = re.fullmatch(r"What is (.*)\?", ex.prompt).group(1)
        assert int(ex.answer) == evaluate(expression), ex
        numbers = [int(t) for t in re.findall(r"\d+", expression)]
        assert 2 <= len(numbers) <= 4 and all(3 <= v <= 30 for v in numbers)
        seen_terms.add(len(numbers))
    assert seen_terms == {2, 3, 4}


def test_arithmetic_with_one_operator_writes_only_that_operator():
    task = make_task({"name": "arithmetic", "operators": "+", "max_terms": 3})
    for ex in examples(task, "train", 100):
        assert "-" not in ex.prompt and int(ex.answer) >= 0


def test_arithmetic_show_work_reasoning_steps_are_each_correct_and_end_at_the_answer():
    task = make_task({"name": "arithmetic", "min_terms": 3, "max_terms": 4, "show_work": True})
    for ex in examples(task, "train", 50):
        steps = task.reasoning(ex).split(", ")
        assert len(steps) == len(re.findall(r"\d+", ex.prompt)) - 1
        for step in steps:
            left, right = step.split(" = ")
            assert evaluate(left) == int(right)
        assert steps[-1].split(" = ")[1] == ex.answer
        reply = conversation(task, ex)["messages"][1]
        assert reply == {"role": "assistant", "content": ex.answer,
                         "reasoning_content": task.reasoning(ex)}
    plain = make_task({"name": "arithmetic"})
    assert "reasoning_content" not in conversation(plain, plain.example("train", 0))["messages"][1]


def test_sort_answers_are_the_prompt_items_sorted():
    task = make_task({"name": "sort", "min_terms": 2, "max_terms": 6, "max_operand": 99})
    for ex in examples(task, "train", 200) + examples(task, "eval", 20):
        items = [int(v) for v in ex.prompt.removeprefix("Sort: ").split()]
        assert 2 <= len(items) <= 6
        assert [int(v) for v in ex.answer.split()] == sorted(items)
        assert task.solution(ex) == ex.answer


@pytest.mark.parametrize("name", ["arithmetic", "sort"])
def test_examples_are_fixed_by_config_seed_and_index(name):
    a, b = make_task({"name": name, "max_terms": 3}), make_task({"name": name, "max_terms": 3})
    assert examples(a, "train", 40) == examples(b, "train", 40)
    assert examples(a, "eval", 40) == examples(b, "eval", 40)
    assert a.example("train", 1234) == b.example("train", 1234)  # no state between calls
    other = make_task({"name": name, "max_terms": 3, "seed": 1})
    assert [e.prompt for e in examples(other, "train", 40)] != \
        [e.prompt for e in examples(a, "train", 40)]


@pytest.mark.parametrize("name", ["arithmetic", "sort"])
def test_train_never_draws_a_held_out_problem_and_eval_problems_are_distinct(name):
    task = make_task({"name": name, "eval_size": 100, "eval_fraction": 0.2})
    train = {e.prompt for e in examples(task, "train", 2000)}
    held = [e.prompt for e in examples(task, "eval", 100)]
    assert task.size("eval") == 100 and task.size("train") is None
    assert len(set(held)) == 100
    assert not train & set(held)
    assert all(held_out(p, 0.2) for p in held) and not any(held_out(p, 0.2) for p in train)
    # the split is the prompt's, not the seed's: another seed holds out the same problems
    reseeded = make_task({"name": name, "eval_size": 100, "eval_fraction": 0.2, "seed": 7})
    assert not {e.prompt for e in examples(reseeded, "train", 2000)} & set(held)


def test_a_problem_space_too_small_for_the_eval_split_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match="task.max_operand=2.*task.eval_size=10"):
        make_task({"name": "arithmetic", "max_operand": 2, "eval_size": 10})


def test_eval_index_past_the_split_and_an_unknown_split_are_refused():
    task = make_task({"name": "sort", "eval_size": 5})
    with pytest.raises(IndexError, match="holds 5"):
        task.example("eval", 5)
    with pytest.raises(ValueError, match="split='test'"):
        task.example("test", 0)


@pytest.mark.parametrize("change", [
    {"seed": 1}, {"eval_fraction": 0.2}, {"eval_size": 10}, {"max_operand": 40},
    {"min_operand": 1}, {"min_terms": 1}, {"max_terms": 3}, {"operators": "+"},
    {"show_work": True}, {"name": "sort"}])
def test_identity_changes_with_every_setting_that_changes_the_examples(change):
    base = {"name": "arithmetic", "eval_size": 20}
    assert make_task(base).identity() == make_task(dict(base)).identity()
    assert make_task({**base, **change}).identity() != make_task(base).identity()
    json.dumps(make_task(base).identity())  # saved with the run's state


# --------------------------------------------------------------------------- users' JSONL

def write_lines(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n"
                            for ln in lines))
    return path


def rows(n, **extra):
    return [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), **extra} for i in range(n)]


def jsonl_task(pattern, **options):
    return make_task({"name": "jsonl", "files": str(pattern), **options})


def test_jsonl_rows_give_prompts_answers_and_their_other_fields(tmp_path):
    write_lines(tmp_path / "a.jsonl", [{"q": "2+2?", "a": 4, "level": 1},
                                       {"q": "Half of 1?", "a": "1/2", "tags": ["x"]}])
    task = jsonl_task(tmp_path / "*.jsonl", prompt_key="q", answer_key="a", eval_fraction=0.0)
    got = {task.example("train", i).id: task.example("train", i) for i in range(2)}
    first = got[f"{tmp_path / 'a.jsonl'}:1"]
    assert (first.prompt, first.answer, dict(first.fields)) == ("2+2?", "4", {"level": 1})
    second = got[f"{tmp_path / 'a.jsonl'}:2"]
    assert (second.answer, dict(second.fields)) == ("1/2", {"tags": ["x"]})
    assert task.size("train") == 2 and task.size("eval") == 0


def test_jsonl_malformed_rows_are_skipped_and_named_by_file_and_line(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [
        *rows(3), "{not json", '["a list"]', {"prompt": "no answer"},
        {"prompt": "", "answer": "1"}, {"prompt": "p", "answer": None},
        {"prompt": "p", "answer": float("nan")}, "", *rows(2)])
    task = jsonl_task(path, eval_fraction=0.0)
    assert task.size("train") == 5
    assert task.bad_lines == 6
    assert [w.split(": ")[0] for w in task.bad_examples] == [f"{path}:{n}" for n in range(4, 9)]
    assert "'answer' (task.answer_key)" in task.bad_examples[2]
    with pytest.raises(ValueError, match=re.escape(f"{path}:4") + ".*task.on_bad_line"):
        jsonl_task(path, on_bad_line="stop")


def test_jsonl_empty_file_and_no_match_and_no_valid_row_are_refused_by_name(tmp_path):
    write_lines(tmp_path / "good.jsonl", rows(3))
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "empty.jsonl")) + ".*empty"):
        jsonl_task(tmp_path / "*.jsonl")
    with pytest.raises(ValueError, match="matches no file"):
        jsonl_task(tmp_path / "none*.jsonl")
    write_lines(tmp_path / "bad.jsonl", ["{", "[]"])
    with pytest.raises(ValueError, match="no valid row.*2 malformed"):
        jsonl_task(tmp_path / "bad.jsonl")


def test_jsonl_split_is_by_prompt_hash_disjoint_and_covers_every_row(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", rows(200))
    task = jsonl_task(path, eval_fraction=0.25, eval_size=0)
    train = {task.example("train", i).prompt for i in range(task.size("train"))}
    held = {task.example("eval", i).prompt for i in range(task.size("eval"))}
    assert not train & held and len(train | held) == 200
    assert held == {r["prompt"] for r in rows(200) if held_out(r["prompt"], 0.25)}
    assert 20 < len(held) < 80
    capped = jsonl_task(path, eval_fraction=0.25, eval_size=10)
    assert capped.size("eval") == 10 and capped.size("train") == task.size("train")


def test_jsonl_holds_out_at_least_one_row_and_never_all(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", rows(2))
    task = jsonl_task(path, eval_fraction=0.01)
    assert task.size("eval") == 1 and task.size("train") == 1
    one = write_lines(tmp_path / "one.jsonl", rows(1))
    if held_out(rows(1)[0]["prompt"], 0.999):
        with pytest.raises(ValueError, match="holds out all 1 rows"):
            jsonl_task(one, eval_fraction=0.999)


def test_jsonl_train_visits_every_row_once_per_epoch_in_a_new_order(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", rows(30))
    task = jsonl_task(path, eval_fraction=0.0)
    epochs = [[task.example("train", e * 30 + i).prompt for i in range(30)] for e in range(3)]
    assert all(sorted(ep) == sorted(r["prompt"] for r in rows(30)) for ep in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs == [[jsonl_task(path, eval_fraction=0.0).example("train", e * 30 + i).prompt
                       for i in range(30)] for e in range(3)]


def test_jsonl_identity_changes_with_the_file_contents_and_keys(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", rows(5))
    before = jsonl_task(path).identity()
    assert jsonl_task(path).identity() == before
    assert jsonl_task(path, seed=1).identity() != before
    write_lines(path, rows(5, note="changed"))
    assert jsonl_task(path).identity() != before


# --------------------------------------------------------------------------- the config

@pytest.mark.parametrize("field,value,match", [
    ("name", "countdown", "task.name='countdown'"),
    ("operators", "*", "task.operators='\\*'"),
    ("max_terms", 1, "task.max_terms=1"),
    ("max_operand", -1, "task.max_operand=-1"),
    ("eval_fraction", 1.0, "task.eval_fraction=1.0"),
    ("files", "x.jsonl", "task.files='x.jsonl'"),
    ("on_bad_line", "ignore", "task.on_bad_line='ignore'"),
    ("bogus", 1, "task.bogus"),
])
def test_run_config_refuses_a_bad_task_field_by_name(field, value, match):
    cfg = default_run_config("t", ModelConfig())
    cfg.task.name = "arithmetic"
    if field == "bogus":
        cfg.task.unlock()
    cfg.task[field] = value
    with pytest.raises(ValueError, match=match):
        validate_run_config(cfg)


def test_run_config_refuses_jsonl_without_files_and_takes_a_valid_task():
    cfg = default_run_config("t", ModelConfig())
    validate_run_config(cfg)  # no task
    cfg.task.name = "jsonl"
    with pytest.raises(ValueError, match="task.files=''"):
        validate_run_config(cfg)
    cfg.task.name, cfg.task.max_operand, cfg.task.show_work = "arithmetic", 99, True
    validate_run_config(cfg)
    assert TaskConfig.from_section(cfg.task).max_operand == 99


# --------------------------------------------------------------------------- the tokenizer

def test_task_tokenizer_is_deterministic_speaks_harmony_and_keeps_digits_apart(tmp_path):
    task = make_task({"name": "arithmetic", "show_work": True, "max_terms": 3})
    a = write_task_tokenizer(task, tmp_path / "a", vocab_size=512)
    b = write_task_tokenizer(task, tmp_path / "b", vocab_size=512)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tok = HFTokenizer(a)
    assert tok.harmony is not None and tok.vocab_size <= 512
    ex = task.example("eval", 0)
    text = tok.render(conversation(task, ex)["messages"], add_generation_prompt=False)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    digits = [tok.decode([i]) for i in ids if any(c.isdigit() for c in tok.decode([i]))]
    assert digits and all(len(d) == 1 for d in digits)
    prompt = tok.encode(tok.render(conversation(task, ex)["messages"][:1],
                                   add_generation_prompt=True))
    assert len(prompt) < 48  # the repeated system text is a few tokens
    reply = ids[len(prompt):]
    messages = harmony.parse(tok.harmony, reply, tok.decode)
    assert harmony.final_text(messages) == ex.answer


def test_task_tokenizer_refuses_a_vocabulary_below_bytes_and_specials(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=200.*at least 263"):
        write_task_tokenizer(make_task({"name": "sort"}), tmp_path, vocab_size=200)
