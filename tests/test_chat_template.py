"""Chat templates: the token ids equal transformers' own (golden recorded by
benchmarks/hf_chat_template_ids.py), the lookup order, content parts, the template globals, and
one clear error for every way a template or a conversation can be wrong."""
import hashlib
import json
import logging
import shutil
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tinyvllm.checkpoint import chat_template as ct
from tinyvllm.checkpoint.tokenizer import Tokenizer
from tinyvllm.errors import InvalidRequestError, ModelLoadError

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "hf_chat_template_ids.json").read_text("utf-8"))
TEMPLATES = {"llama-3.2-instruct": ct.LLAMA32_INSTRUCT_FILE.read_text("utf-8"),
             "smollm2-chatml": GOLDEN["smollm2_chatml_text"]}
BOS = 128000
USER = [{"role": "user", "content": "Hi"}]


def model_dir(tmp_path, tiny_model_dir, name="m", template=None, **tokenizer_config):
    """The tiny model's tokenizer files; `template` as chat_template.jinja, keyword arguments
    merged into tokenizer_config.json."""
    d = tmp_path / name
    d.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", d)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, **tokenizer_config}))
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d


def test_golden_templates_are_the_ones_recorded():
    for name, text in TEMPLATES.items():
        assert hashlib.sha256(text.encode()).hexdigest() == GOLDEN["templates"][name]["sha256"], name


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir, tmp_path_factory):
    """One tokenizer per golden template (loading the 9 MB tokenizer.json takes a while)."""
    tmp = tmp_path_factory.mktemp("golden")
    return {name: Tokenizer.from_pretrained(model_dir(tmp, tiny_model_dir, name, template=text))
            for name, text in TEMPLATES.items()}


@pytest.mark.parametrize("case", GOLDEN["chats"], ids=lambda c: f"{c['template']}-{len(c['messages'])}msg")
def test_chat_ids_equal_transformers(case, tokenizers):
    tok = tokenizers[case["template"]]
    ids = tok.encode_chat(case["messages"], case["add_generation_prompt"], **GOLDEN["template_kwargs"])
    assert ids == case["ids"]
    # Llama 3.2's template writes the BOS itself and nothing adds a second; ChatML has none
    assert ids.count(BOS) == (1 if case["template"] == "llama-3.2-instruct" else 0)


@pytest.mark.parametrize("case", GOLDEN["raw"], ids=lambda c: repr(c["text"]))
def test_raw_prompt_ids_equal_transformers(case, tokenizers):
    assert tokenizers["llama-3.2-instruct"].encode(case["text"]) == case["ids"]


def test_make_model_writes_the_llama_3_2_template(tiny_model_dir):
    assert (tiny_model_dir / "chat_template.jinja").read_text() == TEMPLATES["llama-3.2-instruct"]
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    assert tok.chat_template.source.endswith("chat_template.jinja")
    text = tok.apply_chat_template(USER, date_string="1 Jan 2025")
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 1 Jan 2025\n\n<|eot_id|>")
    assert text.endswith("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_strftime_now_gives_todays_date(tiny_model_dir):
    before = datetime.now()
    text = Tokenizer.from_pretrained(tiny_model_dir).apply_chat_template(USER)
    dates = {(before + timedelta(seconds=s)).strftime("%d %b %Y") for s in (0, 5)}
    assert any(f"Today Date: {d}\n" in text for d in dates)


def test_lookup_order(tiny_model_dir, tmp_path):
    listed = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "LISTED"}]
    cases = [(model_dir(tmp_path, tiny_model_dir, "a", template="JINJA", chat_template="CONFIG"), "JINJA"),
             (model_dir(tmp_path, tiny_model_dir, "b", chat_template="CONFIG"), "CONFIG"),
             (model_dir(tmp_path, tiny_model_dir, "c", chat_template=listed), "LISTED")]
    for d, expected in cases:
        assert Tokenizer.from_pretrained(d).apply_chat_template(USER) == expected
    explicit_file = tmp_path / "mine.jinja"
    explicit_file.write_text("FILE {{ messages[0]['content'] }}")
    d = cases[0][0]
    assert Tokenizer.from_pretrained(d, chat_template=explicit_file).apply_chat_template(USER) == "FILE Hi"
    assert Tokenizer.from_pretrained(d, chat_template=str(explicit_file)).apply_chat_template(USER) == "FILE Hi"
    assert Tokenizer.from_pretrained(d, chat_template="TEXT {{ 1 + 1 }}").apply_chat_template(USER) == "TEXT 2"
    # per call, over the loaded one
    tok = Tokenizer.from_pretrained(d)
    assert tok.apply_chat_template(USER, chat_template="{{ messages | length }}") == "1"
    assert tok.apply_chat_template(USER) == "JINJA"


def test_template_list_without_default_and_bad_types(tiny_model_dir, tmp_path):
    d = model_dir(tmp_path, tiny_model_dir, "a", chat_template=[{"name": "rag", "template": "x"}])
    with pytest.raises(ModelLoadError, match="none named 'default'"):
        Tokenizer.from_pretrained(d)
    with pytest.raises(ModelLoadError, match="must be a string or a list"):
        Tokenizer.from_pretrained(model_dir(tmp_path, tiny_model_dir, "b", chat_template=42))
    with pytest.raises(ModelLoadError, match="cannot read chat template file"):
        Tokenizer.from_pretrained(d, chat_template=tmp_path / "missing.jinja")


def test_fallback_only_without_any_template_and_warned_once(tiny_model_dir, tmp_path, caplog):
    d = model_dir(tmp_path, tiny_model_dir)
    with caplog.at_level(logging.WARNING, logger="tinyvllm"):
        tok = Tokenizer.from_pretrained(d)
        Tokenizer.from_pretrained(d)
    assert sum("no chat template" in r.message for r in caplog.records) == 1
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(messages) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tok.encode_chat(messages).count(BOS) == 1


def test_no_template_and_no_llama3_vocabulary_is_refused(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers
    backend = Backend(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("hi") == [1]                 # no post-processor: nothing is added
    with pytest.raises(InvalidRequestError, match="no chat template.*--chat-template"):
        tok.encode_chat(USER)


def render(template, messages, **kwargs):
    return ct.ChatTemplate(template, "test", {"bos_token": "<s>", "eos_token": "</s>"}).render(messages, **kwargs)


def test_content_parts_are_joined_for_string_templates():
    chatml = TEMPLATES["smollm2-chatml"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert render(chatml, parts) == render(chatml, [{"role": "user", "content": "one\ntwo"}])
    assert render("{{ messages[0]['content'] }}|", [{"role": "assistant", "content": None}]) == "|"


def test_content_parts_are_kept_for_templates_that_loop_over_them():
    loops = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    aliased = "{% for m in messages %}{% set c = m.content %}{% for p in c %}[{{ p.text }}]{% endfor %}{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(loops, parts) == render(aliased, parts) == "[a][b]"


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "'image_url' is not supported"),
    ([{"role": "user", "content": 5}], "must be a string or a list"),
    ([{"content": "no role"}], "message 0 must be a dict with a string 'role'"),
    ([{"role": "user", "content": "a"}, "hello"], "message 1"),
    ([], "non-empty list"),
])
def test_bad_messages_are_request_errors(messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        render(TEMPLATES["smollm2-chatml"], messages)


def test_raise_exception_is_a_request_error_with_the_templates_message():
    strict = ("{% if messages[0]['role'] != 'user' %}"
              "{{ raise_exception('Conversations must start with user') }}{% endif %}ok")
    assert render(strict, USER) == "ok"
    with pytest.raises(InvalidRequestError, match="refused the conversation: Conversations must start with user"):
        render(strict, [{"role": "assistant", "content": "x"}])


def test_template_errors_are_one_clear_error():
    with pytest.raises(ModelLoadError, match="test: chat template syntax error at line 2"):
        ct.ChatTemplate("ok\n{% for m in messages %}", "test")
    with pytest.raises(ModelLoadError, match="empty"):
        ct.ChatTemplate("  ", "test")
    with pytest.raises(InvalidRequestError, match="failed on this conversation: UndefinedError"):
        render("{{ messages[0]['nope'] + 'x' }}", USER)      # a missing field used, not just printed
    with pytest.raises(InvalidRequestError, match="failed on this conversation: SecurityError"):
        render("{{ ''.__class__.__mro__ }}", USER)           # the sandbox holds


def test_globals_filters_and_variables():
    msg = [{"role": "user", "content": "héllo \"q\" <b>"}]
    assert render("{{ messages[0] | tojson }}", msg) == json.dumps(msg[0], ensure_ascii=False)
    assert render("{{ {'b': [1, 2]} | tojson(indent=2) }}", msg) == json.dumps({"b": [1, 2]}, indent=2)
    assert render("{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ documents }}|{{ add_generation_prompt }}",
                  msg, add_generation_prompt=False) == "<s>|</s>|None|None|False"
    assert render("{{ bos_token }}{{ x }}", msg, x=3, bos_token="B") == "B3"   # kwargs win
    assert render("{% for m in messages %}{% generation %}<{{ m.role }}>{% endgeneration %}{% break %}{% endfor %}",
                  msg) == "<user>"
    # trim_blocks and lstrip_blocks, as transformers compiles templates
    assert render("{% if true %}\n    a\n  {% endif %}\nb", msg) == "    a\nb"


def test_special_tokens_come_from_tokenizer_config(tiny_model_dir, tmp_path):
    d = model_dir(tmp_path, tiny_model_dir, template="{{ bos_token }}|{{ eos_token }}|{{ pad_token }}",
                  eos_token={"content": "<|eot_id|>", "special": True})
    assert Tokenizer.from_pretrained(d).apply_chat_template(USER) == \
        "<|begin_of_text|>|<|eot_id|>|<|finetune_right_pad_id|>"
