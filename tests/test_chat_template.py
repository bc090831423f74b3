"""Chat templates: rendering as transformers renders, message validation, template errors,
HFTokenizer.from_dir finding a checkpoint's template, and `serve --chat-template` replacing it
(its one-line refusals, and a tiny-preset server rendering with it). No model file needed."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys

import pytest

from ringleader.device.backends.common import with_chat_template
from ringleader.device.engine_config import EngineConfig
from ringleader.device.text.chat_template import (
    MAX_MESSAGES,
    ChatTemplate,
    ChatTemplateError,
    load_template_override,
    validate_messages,
)
from ringleader.device.text.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from ringleader.ipc.backend import ModelInfo

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
    with pytest.raises(ChatTemplateError, match=r"^not a valid Jinja template: unexpected '}' \(line 1\)$"):
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


# --- serve --chat-template: an override of the model's template ----------------------------

OVERRIDE = (
    "{{ bos_token }}{% for m in messages %}<<{{ m.role }}: {{ m.content }}>>{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def test_override_is_a_file_or_the_template_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(OVERRIDE, encoding="utf-8")
    assert load_template_override(str(path)).source == OVERRIDE
    assert load_template_override(OVERRIDE).source == OVERRIDE  # no such file, and it holds {{
    assert EngineConfig(chat_template=path).chat_template == str(path)  # a Path is taken as its str


@pytest.mark.parametrize(
    ("arg", "error"),
    [
        ("{missing}/t.jinja", "--chat-template {missing}/t.jinja: no such file"),
        ("chatml", "--chat-template chatml: no such file"),  # neither a file nor template text
        ("{dir}", "--chat-template {dir}: is a directory, not a template file"),
        ("{empty}", "--chat-template {empty}: the file is empty"),
        ("{binary}", "--chat-template {binary}: not a text file (not UTF-8)"),
        ("{broken}", "--chat-template {broken}: not a valid Jinja template: unexpected '}}' (line 2)"),
        (
            "{{{{ messages[0].content ",
            "--chat-template (inline template): not a valid Jinja template: "
            "unexpected end of template, expected 'end of print statement' (line 1)",
        ),
    ],
    ids=["missing", "plain-name", "directory", "empty", "binary", "broken-file", "broken-inline"],
)
def test_a_bad_override_is_one_line_naming_the_fault(tmp_path, arg, error):
    places = {
        "missing": tmp_path / "nowhere",
        "dir": tmp_path,
        "empty": tmp_path / "empty.jinja",
        "binary": tmp_path / "bin.jinja",
        "broken": tmp_path / "broken.jinja",
    }
    places["empty"].write_text("  \n", encoding="utf-8")
    places["binary"].write_bytes(b"\xff\xfe{{ x }}")
    places["broken"].write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}", encoding="utf-8")
    arg, error = arg.format(**places), error.format(**places)
    with pytest.raises(ChatTemplateError) as err:
        load_template_override(arg)
    assert str(err.value) == error
    with pytest.raises(ValueError, match="^" + re.escape(error) + "$"):  # checked where the config is made
        EngineConfig(chat_template=arg)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_override_is_named(tmp_path):
    path = tmp_path / "secret.jinja"
    path.write_text(OVERRIDE, encoding="utf-8")
    path.chmod(0)
    with pytest.raises(
        ValueError, match=f"^--chat-template {re.escape(str(path))}: cannot read it: Permission denied$"
    ):
        EngineConfig(chat_template=str(path))


def test_serve_refuses_a_bad_override_in_one_line_before_loading_anything(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ messages[0].content ", encoding="utf-8")
    for arg, error in [
        (str(tmp_path / "nope.jinja"), f"--chat-template {tmp_path / 'nope.jinja'}: no such file"),
        (
            str(broken),
            f"--chat-template {broken}: not a valid Jinja template: "
            "unexpected end of template, expected 'end of print statement' (line 1)",
        ),
    ]:
        # a preset that would take minutes to build: the refusal comes before it
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "ringleader.hostctl.cli",
                "serve",
                "--model",
                "llama-8b",
                "--chat-template",
                arg,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and r.stderr == f"ringleader: cannot start: {error}\n"


def test_the_byte_tokenizer_renders_an_override_after_bos():
    tok = ByteTokenizer()
    tok.chat_template = ChatTemplate(OVERRIDE)
    assert tok.encode_chat(MSGS) == [ByteTokenizer.BOS, *b"<<user: hello there>>ASSISTANT:"]


def test_an_override_replaces_the_checkpoint_template_with_its_bos_and_eos(tmp_path):
    tk = _write_tokenizer_dir(
        tmp_path, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    )
    info = ModelInfo(
        "m", vocab_size=300, max_context=64, eos_token_ids=(), tokenizer=HFTokenizer.from_dir(tmp_path)
    )
    info = with_chat_template(info, OVERRIDE)
    text = "<|im_start|><<user: hello there>><|im_end|>ASSISTANT:"
    assert info.encode_chat(MSGS) == tk.encode(text, add_special_tokens=False).ids
    assert info.tokenizer.decode(info.encode_chat(MSGS), skip_special_tokens=False) == text


def test_an_override_for_a_model_without_a_tokenizer_is_not_used(caplog):
    info = ModelInfo("ids-only", vocab_size=300, max_context=64, eos_token_ids=())
    with caplog.at_level("WARNING", logger="ringleader.chat"):
        assert with_chat_template(info, OVERRIDE) is info
    assert "--chat-template not used: ids-only has no tokenizer" in caplog.text


def test_a_server_renders_chats_with_the_override(tmp_path):
    """A tiny-preset server opened with chat_template (as `serve --chat-template` opens it): its
    chats are the override's bytes after BOS, with and without a system turn."""
    from ringleader.device.backends import open_backend
    from ringleader.ipc.client import Client
    from tests.conftest import running_server

    path = tmp_path / "override.jinja"
    path.write_text(OVERRIDE, encoding="utf-8")
    chats = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}],
    ]
    with running_server(
        backend_cls=lambda model, **kw: open_backend(model, device="cpu", **kw), chat_template=str(path)
    ) as server:
        with Client(server.address, timeout=60) as client:
            assert client.stats()["model_info"]["chat_template"] is True
            for chat in chats:
                done = client.complete(messages=chat, max_tokens=2, ignore_eos=True).done
                rendered = ChatTemplate(OVERRIDE).render(chat)
                assert done.finish_reason == "length"
                assert done.prompt_tokens == 1 + len(rendered.encode("utf-8"))
    with running_server(backend_cls=lambda model, **kw: open_backend(model, device="cpu", **kw)) as server:
        with Client(server.address, timeout=60) as client:  # without the override: no template
            done = client.complete(messages=chats[0], max_tokens=2).done
            assert done.error_code == "bad_request" and "no chat template" in done.error_message
