"""Chat templates: rendering as transformers renders, message validation, template errors, and
HFTokenizer.from_dir finding a checkpoint's template. No model file needed."""

from __future__ import annotations

import datetime
import json

import pytest

from device.chat_template import MAX_MESSAGES, ChatTemplate, ChatTemplateError, validate_messages
from device.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

pytest.importorskip("jinja2")

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-3 style: bos_token, trim, whitespace control, a namespace, loop controls and tojson
LLAMA3ISH = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- set ns.system = message['content'] | trim %}
        {%- continue %}
    {%- endif %}
    {%- if loop.index0 == 1 and ns.system %}
        {{- '<|start_header_id|>system<|end_header_id|>\n\n' + ns.system + '<|eot_id|>' }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- if message.get('name') %}{{ {'name': message['name'], 'tag': '<b>&'} | tojson }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Mistral style: refuses a conversation whose roles do not alternate
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What is 2+2?\n"},
        {"role": "assistant", "content": "4", "name": "calc"},
        {"role": "user", "content": 'héllo 日本 🎉 <tag> & "quotes"'},
    ],
]


def _hf_reference_tokenizer():
    """A transformers tokenizer (any vocabulary will do: only rendering is compared)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize(
    "source", [CHATML, LLAMA3ISH, ALTERNATING], ids=["chatml", "llama3ish", "alternating"]
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(source, add_generation_prompt):
    ref = _hf_reference_tokenizer()
    tmpl = ChatTemplate(source)
    convs = CONVERSATIONS if source != ALTERNATING else [CONVERSATIONS[0], CONVERSATIONS[1][1:3]]
    for msgs in convs:
        expected = ref.apply_chat_template(
            msgs, chat_template=source, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = tmpl.render(
            msgs, add_generation_prompt=add_generation_prompt, bos_token="<s>", eos_token="</s>"
        )
        assert got == expected
    if source == LLAMA3ISH:  # tojson does not HTML-escape, bos_token is written
        out = tmpl.render(CONVERSATIONS[1], bos_token="<s>")
        assert out.startswith("<s><|start_header_id|>system") and '"tag": "<b>&"' in out


def test_raise_exception_becomes_chat_template_error():
    ref = _hf_reference_tokenizer()
    import jinja2

    bad = [{"role": "assistant", "content": "hi"}]
    with pytest.raises(jinja2.TemplateError) as hf_err:
        ref.apply_chat_template(bad, chat_template=ALTERNATING, tokenize=False)
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate(ALTERNATING).render(bad, bos_token="<s>", eos_token="</s>")
    assert (
        str(err.value)
        == str(hf_err.value)
        == "Conversation roles must alternate user/assistant/user/assistant/..."
    )
    assert isinstance(err.value, ValueError)
    with pytest.raises(ChatTemplateError, match="^Only user and assistant roles are supported!$"):
        ChatTemplate(ALTERNATING).render([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])


def test_template_failures_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("   ")
    # sandbox: no reaching into Python internals
    with pytest.raises(ChatTemplateError, match="failed to render: SecurityError"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns }}").render([{"role": "user", "content": "x"}])
    # a Python error inside an expression
    with pytest.raises(ChatTemplateError, match="failed to render: TypeError"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])


def test_globals_and_undefined_tokens():
    msgs = [{"role": "user", "content": "x"}]
    year = ChatTemplate("{{ strftime_now('%Y') }}").render(msgs)
    assert year in {str(datetime.date.today().year), str(datetime.date.today().year + 1)}
    # bos_token not given: undefined renders as nothing (as in transformers without a bos token)
    assert ChatTemplate("[{{ bos_token }}]{{ messages | length }}").render(msgs) == "[]1"
    assert ChatTemplate("{{ tools is none }}").render(msgs) == "True"
    loop = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert ChatTemplate(loop).render(msgs * 3) == "x"
    # transformers' {% generation %} block (assistant masks) renders its body
    gen = "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    assert ChatTemplate(gen).render(msgs * 2) == "<x><x>"


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], r"^messages: must be a non-empty list$"),
        ("hi", r"^messages: must be a non-empty list$"),
        (None, r"^messages: must be a non-empty list$"),
        (
            [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1),
            rf"^messages: at most {MAX_MESSAGES} messages",
        ),
        (["hi"], r"^messages\[0\]: must be an object"),
        (
            [{"role": "user", "content": "a"}, {"role": 3, "content": "b"}],
            r"^messages\[1\]\.role: must be a str$",
        ),
        ([{"role": "", "content": "b"}], r"^messages\[0\]\.role: must be a str$"),
        ([{"role": "user", "content": None}], r"^messages\[0\]\.content: must be a str$"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            r"^messages\[0\]\.content: must be a str$",
        ),
        ([{"content": "x"}], r"^messages\[0\]\.role: missing$"),
        ([{"role": "user"}], r"^messages\[0\]\.content: missing$"),
        ([{"role": "user", "content": "x", "name": 5}], r"^messages\[0\]\.name: must be a str$"),
        (
            [{"role": "user", "content": "x"}, {"role": "user", "content": "x", "tool_calls": []}],
            r"^messages\[1\]\.tool_calls: unknown key \(only role, content, name are allowed\)$",
        ),
    ],
)
def test_validate_messages_names_the_field(messages, error):
    with pytest.raises(ChatTemplateError, match=error):
        validate_messages(messages)
    with pytest.raises(ChatTemplateError, match=error):
        ChatTemplate(CHATML).render(messages)


def test_validate_messages_accepts():
    validate_messages([{"role": "user", "content": ""}])
    validate_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": "bob"}])
    validate_messages([{"role": "user", "content": "x"}] * MAX_MESSAGES)


# --- HFTokenizer.from_dir finds the template -------------------------------------------------


def _write_tokenizer_dir(path, tokenizer_config: dict | None = None, jinja: str | None = None):
    pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(["user assistant system hello there", "you are helpful"] * 3, trainer=trainer)
    tk.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ["<|im_start|>", "<|im_end|>"]]
    )
    tk.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return tk


MSGS = [{"role": "user", "content": "hello there"}]


def test_from_dir_reads_template_string(tmp_path):
    tk = _write_tokenizer_dir(
        tmp_path, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    )
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.chat_template is not None and tok.chat_template.source == CHATML
    assert tok.eos_token_ids == [tk.token_to_id("<|im_end|>")]
    text = tok.chat_template.render(MSGS)
    ids = tok.encode_chat(MSGS)
    assert ids == tk.encode(text, add_special_tokens=False).ids
    assert ids.count(tk.token_to_id("<|im_start|>")) == 3  # specials in the rendered text are single tokens
    assert tok.decode(ids, skip_special_tokens=False) == text
    # load_tokenizer sees the template too
    assert load_tokenizer(tmp_path).encode_chat(MSGS) == ids


def test_from_dir_reads_template_list_default(tmp_path):
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": CHATML}]
    _write_tokenizer_dir(tmp_path, {"chat_template": templates})
    assert HFTokenizer.from_dir(tmp_path).chat_template.source == CHATML
    _write_tokenizer_dir(tmp_path, {"chat_template": [{"name": "tool_use", "template": "TOOLS"}]})
    assert HFTokenizer.from_dir(tmp_path).chat_template is None


def test_from_dir_reads_chat_template_jinja(tmp_path):
    # the .jinja file wins over tokenizer_config.json's entry, as in transformers
    _write_tokenizer_dir(tmp_path, {"chat_template": "IGNORED"}, jinja=LLAMA3ISH)
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.chat_template.source == LLAMA3ISH
    (tmp_path / "tokenizer_config.json").unlink()  # no config: the .jinja file alone
    assert HFTokenizer.from_dir(tmp_path).chat_template.source == LLAMA3ISH


def test_a_template_that_does_not_compile_leaves_the_model_without_chat(tmp_path, caplog):
    _write_tokenizer_dir(tmp_path, {"chat_template": "{% for m in messages %}{{ m.content }"})
    with caplog.at_level("WARNING", logger="ringleader.chat"):
        tok = HFTokenizer.from_dir(tmp_path)
    assert tok.chat_template is None and tok.encode("hello")  # prompts still work
    assert "chat template not loaded" in caplog.text and str(tmp_path) in caplog.text


def test_no_template_raises(tmp_path):
    _write_tokenizer_dir(tmp_path, {"bos_token": "<|im_start|>"})
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.encode_chat(MSGS)
    byte_tok = ByteTokenizer()
    assert byte_tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        byte_tok.encode_chat(MSGS)
    # the messages are checked by the template, so bad messages with a template name the field
    tmpl_tok = HFTokenizer(tok._tok, chat_template=ChatTemplate(CHATML))
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content"):
        tmpl_tok.encode_chat([{"role": "user", "content": 1}])
