"""Tokenizers, tasks and rewards: lengths, retrievable answers, reproducibility, and the errors users see."""

import itertools
import json
import re

import pytest

from conftest import checked_task
from longstraw_cli.rl.rewards import get_reward
from longstraw_cli.rl.tasks import Example, TaskConfig, get_task, make_task
from longstraw_cli.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

SYNTHETIC = ["passkey", "kv_retrieval", "variable_tracking", "char_choice"]
LENGTHS = [200, 1000, 5000]


class ChunkTokenizer:
    """Runs of letters split into chunks of three: concatenating texts merges tokens, unlike bytes."""

    def encode(self, text):
        return [0] * len(re.findall(r"[A-Za-z]{1,3}|[^A-Za-z]", text))


def _parse_answer(name, prompt):
    """Recover the answer from the prompt text alone, the way a perfect reader would."""
    if name == "passkey":
        assert len(set(re.findall(r"\d+", prompt))) == 1
        (passkey,) = re.findall(r"The passkey is (\d+)\.", prompt)
        return passkey
    if name == "kv_retrieval":
        records = re.findall(r"^([0-9a-f]{8}): ([0-9a-f]{8})$", prompt, flags=re.M)
        keys = [k for k, _ in records]
        assert len(keys) == len(set(keys)), "keys must be distinct"
        (key,) = re.findall(r"What is the value of key ([0-9a-f]{8})\?", prompt)
        return dict(records)[key]
    if name == "variable_tracking":
        values = {}
        for var, rhs in re.findall(r"VAR ([A-Z]+) = (\d+|VAR [A-Z]+)\.", prompt):
            values[var] = values[rhs[4:]] if rhs.startswith("VAR ") else rhs
        (asked,) = re.findall(r"Which variables equal (\d+)\?", prompt)
        return " ".join(sorted(v for v, x in values.items() if x == asked))
    if name == "char_choice":
        (alphabet,) = re.findall(r"Pick one of (\w+):$", prompt)
        assert "a" in alphabet
        return "a"
    raise AssertionError(name)


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    text = "héllo, 世界 \n\t🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (256, 257, 258, 259)
    # A response cut inside a multi-byte character decodes with a replacement character.
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"
    # ids the tokenizer lacks (a padded embedding table samples them) decode as the replacement character
    assert tok.decode([104, 259, 248_319, -1, 105]) == "h\ufffd\ufffd\ufffdi"


def test_load_tokenizer_missing_directory(tmp_path):
    missing = tmp_path / "no_such_tokenizer"
    with pytest.raises(ValueError, match="no_such_tokenizer") as e:
        load_tokenizer(str(missing))
    assert "'byte'" in str(e.value)


@pytest.mark.parametrize("name", SYNTHETIC)
@pytest.mark.parametrize("prompt_tokens", LENGTHS)
def test_synthetic_task_byte_tokenizer(name, prompt_tokens):
    tok = ByteTokenizer()
    # 200 bytes hold the question and one chain of two statements, not two chains of four.
    chains = dict(num_chains=1, chain_length=2) if prompt_tokens < 500 else dict(num_chains=2, chain_length=4)
    task = make_task(TaskConfig(name, prompt_tokens=prompt_tokens, seed=3, **chains), tok)
    exact = get_reward("exact")
    for i in range(3):
        ex = task.example(i)
        assert len(tok.encode(ex.prompt)) == prompt_tokens == ex.meta["prompt_tokens"]
        assert _parse_answer(name, ex.prompt) == ex.answer
        assert exact(f" {ex.answer}\n", ex) == 1.0
        assert exact(ex.answer + "0", ex) == 0.0
        assert get_reward(task.default_reward)(ex.answer, ex) == 1.0


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_task_subword_tokenizer(name):
    tok = ChunkTokenizer()
    for prompt_tokens in LENGTHS:
        ex = make_task(TaskConfig(name, prompt_tokens=prompt_tokens), tok).example(5)
        assert prompt_tokens - 4 <= len(tok.encode(ex.prompt)) <= prompt_tokens
        assert _parse_answer(name, ex.prompt) == ex.answer


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_task_reproducible(name):
    tok = ByteTokenizer()
    cfg = TaskConfig(name, prompt_tokens=1000, seed=7)
    drawn = list(itertools.islice(make_task(cfg, tok), 6))
    # Example 5 drawn cold equals example 5 drawn after 0..4: what resuming a run relies on.
    assert make_task(cfg, tok).example(5) == drawn[5]
    assert len({ex.prompt for ex in drawn}) == len(drawn)
    assert make_task(TaskConfig(name, prompt_tokens=1000, seed=8), tok).example(5).prompt != drawn[5].prompt


def test_variable_tracking_distractors_and_order():
    cfg = TaskConfig("variable_tracking", prompt_tokens=3000, num_chains=3, chain_length=5)
    ex = make_task(cfg, ByteTokenizer()).example(0)
    assert len(re.findall(r"VAR [A-Z]+ =", ex.prompt)) == 15
    assert len(ex.answer.split()) == 5
    unordered = get_reward("unordered_words")
    assert unordered(", ".join(reversed(ex.answer.split())), ex) == 1.0
    assert unordered(" ".join(ex.answer.split()[1:]), ex) == 0.0


def test_passkey_digits():
    ex = make_task(TaskConfig("passkey", prompt_tokens=300, passkey_digits=9), ByteTokenizer()).example(0)
    assert re.fullmatch(r"\d{9}", ex.answer)


def test_char_choice_rewards():
    task = make_task(TaskConfig("char_choice", prompt_tokens=64, alphabet="xyz", target="y"), ByteTokenizer())
    ex = task.example(0)
    assert ex.answer == "y" and ex.prompt.endswith("Pick one of xyz:")
    prefix, rate = get_reward(task.default_reward), get_reward("char_rate")
    assert prefix(" y", ex) == 1.0 and prefix("yes", ex) == 1.0 and prefix("x", ex) == 0.0
    assert rate("yxyx", ex) == 0.5 and rate("", ex) == 0.0


def test_bad_task_config():
    with pytest.raises(ValueError, match="too small"):
        make_task(TaskConfig("passkey", prompt_tokens=20), ByteTokenizer()).example(0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        TaskConfig("passkey", prompt_tokens=0)
    with pytest.raises(ValueError, match="target"):
        TaskConfig("char_choice", alphabet="abc", target="z")
    with pytest.raises(ValueError, match="index"):
        make_task(TaskConfig("passkey", prompt_tokens=200), ByteTokenizer()).example(-1)


def test_get_task_and_get_reward_list_choices():
    with pytest.raises(ValueError) as e:
        get_task("pasky")
    assert "'pasky'" in str(e.value) and all(name in str(e.value) for name in [*SYNTHETIC, "jsonl"])
    with pytest.raises(ValueError) as e:
        get_reward("exactly")
    assert "'exactly'" in str(e.value) and all(n in str(e.value) for n in ["exact", "contains", "prefix", "math"])


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_task(tmp_path):
    rows = [{"prompt": "2+2=", "answer": 4, "id": "a"}, {"prompt": "Capital of France?", "answer": "Paris"}]
    path = _write(tmp_path / "data.jsonl", [json.dumps(rows[0]), "", json.dumps(rows[1])])
    task = make_task(TaskConfig("jsonl", path=str(path)), ByteTokenizer())
    assert len(task) == 2
    first, second = list(task)
    assert first == Example("2+2=", "4", {"answer": 4, "id": "a"}, ground_truth=4, where=f"{path}:1")
    assert second == Example("Capital of France?", "Paris", {"answer": "Paris"}, ground_truth="Paris",
                             where=f"{path}:3")
    # Indices wrap around the file: example 2 starts the second epoch.
    assert task.example(2) == task.example(0)


def test_jsonl_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="missing.jsonl"):
        make_task(TaskConfig("jsonl", path=str(tmp_path / "missing.jsonl")), tok)
    with pytest.raises(ValueError, match="path"):
        make_task(TaskConfig("jsonl"), tok)
    good = json.dumps({"prompt": "p", "answer": "a"})
    cases = {
        "bad_json.jsonl": ([good, good, "{not json"], 3, "invalid JSON"),
        "no_answer.jsonl": ([good, json.dumps({"prompt": "p"})], 2, "'answer'"),
        "not_object.jsonl": (["[1, 2]"], 1, "JSON object"),
        "prompt_type.jsonl": ([good, "", json.dumps({"prompt": 3, "answer": "a"})], 3, "'prompt'"),
    }
    for name, (lines, lineno, what) in cases.items():
        path = _write(tmp_path / name, lines)
        with pytest.raises(ValueError, match=re.escape(f"{path}:{lineno}: ")) as e:
            checked_task(TaskConfig("jsonl", path=str(path)), tok)
        assert what in str(e.value)


def test_reward_from_module_spec(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_match(response, example):\n    return float(len(response) == len(example.answer))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward("my_rewards:length_match")
    assert fn("abc", Example("p", "xyz")) == 1.0
    with pytest.raises(ValueError, match="no_such_module_xyz:fn"):
        get_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="my_rewards:missing"):
        get_reward("my_rewards:missing")
    with pytest.raises(ValueError, match="package.module:function"):
        get_reward(":fn")


@pytest.mark.parametrize(
    "response, answer, expected",
    [("0.5", "1/2", 1.0), ("\\frac{1}{2}", "1/2", 1.0), ("so the answer is $\\boxed{\\frac12}$", "0.5", 1.0),
     ("0.25", "1/2", 0.0), ("no idea", "1/2", 0.0)],
)
def test_math_reward(response, answer, expected):
    pytest.importorskip("math_verify")
    assert get_reward("math")(response, Example("p", answer)) == expected


def test_string_rewards():
    ex = Example("p", "Paris")
    assert get_reward("contains")("It is Paris.", ex) == 1.0
    assert get_reward("contains")("It is Lyon.", ex) == 0.0
    assert get_reward("prefix")("  Paris, France", ex) == 1.0
    assert get_reward("exact")("Paris, France", ex) == 0.0
    assert get_reward("exact_line")("\nParis\nbecause ...", ex) == 1.0
    assert get_reward("exact_word")("Paris because", ex) == 1.0
    assert get_reward("contains")("anything", Example("p", "")) == 0.0


def test_hf_tokenizer_decodes_ids_beyond_its_vocabulary_as_replacement_characters():
    """Known ids decode together (a run at a time); each id past len(tokenizer) is U+FFFD."""

    class Letters:
        eos_token_id, pad_token_id, bos_token_id = 9, None, None

        def __len__(self):
            return 10

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids if not (skip_special_tokens and i == 9))

    tok = HFTokenizer(Letters())
    assert tok.decode([0, 1, 12, 2, 9, 151_000]) == "ab\ufffdc\ufffd"


def _module_imports(module: str) -> set[str]:
    """The longstraw_cli modules `module` imports when it loads (its top-level import statements)."""
    import ast
    import importlib.util

    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from package import module` names a module; `from module import name` the module itself
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("longstraw_cli.") and _is_module(n)}


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module: the module has no __path__ to search
        return False


@pytest.mark.parametrize("module", ["longstraw_cli.data", "longstraw_cli.rl.tasks", "longstraw_cli.rl.task_base"])
def test_task_modules_do_not_import_themselves_back(module):
    """The file tasks and the synthetic ones share their base (rl/task_base.py): no module of the three reaches
    itself again through the imports it makes when it loads."""
    seen, todo = set(), list(_module_imports(module))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += _module_imports(name)
    assert module not in seen
