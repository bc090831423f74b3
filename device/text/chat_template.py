"""Chat templates: the Jinja programs that turn a list of messages into a model's prompt text.

A template comes with the checkpoint (tokenizer_config.json, chat_template.jinja, or a GGUF's
`tokenizer.chat_template`), or replaces the checkpoint's (`serve --chat-template`,
load_template_override), and is untrusted code, so it runs in Jinja's immutable sandbox, set up
the way transformers' apply_chat_template sets it up (trim_blocks, lstrip_blocks, loop controls,
{% generation %} blocks, a `tojson` that does not HTML-escape, and the `raise_exception` / `strftime_now` globals), so that a
template renders here exactly as it does there.

jinja2 is imported only when a template is compiled: ringleader imports without it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ringleader.ipc.request_extensions import ExtensionError, check_template_kwargs

log = logging.getLogger("ringleader.chat")

MAX_MESSAGES = 1024
MESSAGE_KEYS = ("role", "content", "name")
# a --chat-template argument that is no file but holds one of these is the template text itself
INLINE_TEMPLATE_MARKS = ("{%", "{{")
# transformers' mark of the end of the final message (continue_final_message): appended to its
# content, found in the rendered text, and the text cut there
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat request that cannot be rendered: bad messages, no template, or a template that fails
    (its own `raise_exception` message, or a Jinja error).  `field`: the request's field at fault
    (`messages` unless another one is, such as continue_final_message or chat_template_kwargs)."""

    def __init__(self, message: str, field: str = "messages"):
        super().__init__(message)
        self.field = field


def validate_messages(messages: Any) -> None:
    """Raises ChatTemplateError naming the first thing wrong with `messages`.

    Accepted: a non-empty list of at most MAX_MESSAGES dicts, each with a str `role` and a str
    `content`, and optionally a str `name`; no other keys (tool calls, content parts and the like
    are not supported, and are refused rather than silently dropped).
    """
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages: must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise ChatTemplateError(f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"{where}: must be an object with role and content")
        extra = [k for k in msg if k not in MESSAGE_KEYS]
        if extra:
            raise ChatTemplateError(
                f"{where}.{extra[0]}: unknown key (only {', '.join(MESSAGE_KEYS)} are allowed)"
            )
        for key in ("role", "content"):
            if key not in msg:
                raise ChatTemplateError(f"{where}.{key}: missing")
        if not isinstance(msg["role"], str) or not msg["role"]:
            raise ChatTemplateError(f"{where}.role: must be a str")
        if not isinstance(msg["content"], str):
            raise ChatTemplateError(f"{where}.content: must be a str")
        if "name" in msg and not isinstance(msg["name"], str):
            raise ChatTemplateError(f"{where}.name: must be a str")


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '); templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _build_env():
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("chat templates need the `jinja2` package: pip install jinja2") from e

    class TemplateRaised(jinja2.exceptions.TemplateError):
        """What the template's raise_exception(message) raises: message is the template's."""

    def raise_exception(message):
        raise TemplateRaised(message)

    class Namespace(jinja2.utils.Namespace):
        # like transformers: no underscore-prefixed attributes on a namespace (CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} (transformers marks assistant text with it for
        training masks): renders its body unchanged."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = Namespace
    return env, TemplateRaised


class ChatTemplate:
    """A chat template compiled once from its Jinja source.

    render(messages) validates the messages (validate_messages) and renders them with the
    variables transformers passes (messages, add_generation_prompt, bos_token / eos_token when
    known, tools=None, documents=None, and the caller's template_kwargs beside them), leaving the
    final message open with continue_final_message as transformers' apply_chat_template does.
    Any failure is a ChatTemplateError: the template's own raise_exception message verbatim, or
    "chat template ...: <jinja error>".
    """

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("chat template: empty source")
        self.source = source
        env, self._raised = _build_env()
        import jinja2

        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            # str(e) spans lines (the location, the source line); an error here is one line
            detail = " ".join((e.message or "syntax error").split()).rstrip(".")
            raise ChatTemplateError(f"not a valid Jinja template: {detail} (line {e.lineno})") from e
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"not a valid Jinja template: {e}") from e

    def __repr__(self) -> str:
        return f"ChatTemplate({self.source[:40]!r}{'...' if len(self.source) > 40 else ''})"

    def render(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        bos_token: str | None = None,
        eos_token: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of `messages`.  template_kwargs: extra variables (vLLM's
        chat_template_kwargs, e.g. enable_thinking), JSON values, none of them one set here
        (ringleader.ipc.request_extensions.RESERVED_TEMPLATE_KWARGS).  continue_final_message (not with add_generation_prompt):
        the text ends where the final message's content does, as transformers renders it (its
        content with a tag appended, the text cut at the tag; where the template trimmed the
        tag's space, trailing whitespace goes too), so the model continues that message."""
        validate_messages(messages)
        extra = _template_kwargs(template_kwargs)
        # plain copies: the template sees only str-valued dicts, never the caller's objects
        msgs = [{str(k): str(v) for k, v in m.items()} for m in messages]
        if continue_final_message:
            _check_continue(self.source, add_generation_prompt)
            final = msgs[-1]["content"]
            msgs[-1]["content"] = final + CONTINUE_TAG
        variables: dict[str, Any] = {
            **extra,
            "messages": msgs,
            "add_generation_prompt": bool(add_generation_prompt),
            "tools": None,
            "documents": None,
        }
        if bos_token is not None:
            variables["bos_token"] = bos_token
        if eos_token is not None:
            variables["eos_token"] = eos_token
        try:
            text = self._template.render(**variables)
        except self._raised as e:
            raise ChatTemplateError(e.message or "chat template raised an exception") from e
        except Exception as e:  # Jinja errors, and Python errors from template expressions
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
        return _cut_at_tag(text, final) if continue_final_message else text


def _template_kwargs(template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The extra variables, judged as the protocol judges chat_template_kwargs (ChatTemplateError
    naming the field for a reserved name or a value that is no JSON)."""
    try:
        return check_template_kwargs(template_kwargs) or {}
    except ExtensionError as e:
        raise ChatTemplateError(str(e), e.field) from None


def _check_continue(source: str, add_generation_prompt: bool) -> None:
    """transformers' refusals of continue_final_message: with add_generation_prompt, and for a
    template that never reads a message's content."""
    field = "continue_final_message"
    if add_generation_prompt:
        raise ChatTemplateError(
            f"{field}: cannot be true with add_generation_prompt true: the final message is "
            "continued, not answered",
            field,
        )
    if "content" not in source:
        raise ChatTemplateError(f'{field}: this chat template never writes a message\'s "content"', field)


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered text cut where the final message's content ends (its tag), as transformers'
    render_jinja_template cuts it."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the rendered chat (the "
            "chat template changes or drops it), so it cannot be continued",
            "continue_final_message",
        )
    at = text.rindex(CONTINUE_TAG.strip())
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]  # the template kept the tag's space: the message's own text is intact
    return text[:at].rstrip()  # it trimmed the message: trailing whitespace goes with it


def load_chat_template(source: str | None, where: str) -> ChatTemplate | None:
    """The model's template, or None (with a warning naming `where`) when there is none or it
    cannot be compiled here: the model still serves prompts, and chat requests are refused with
    a bad_request instead of the server refusing to start."""
    if not isinstance(source, str) or not source.strip():
        return None
    try:
        return ChatTemplate(source)
    except (ChatTemplateError, ImportError) as exc:
        log.warning("%s: chat template not loaded, chat requests will be refused: %s", where, exc)
        return None


def load_template_override(arg: str) -> ChatTemplate:
    """The template `serve --chat-template ARG` gives, compiled: the file ARG (Jinja source, as
    tokenizer_config.json's `chat_template` is written), or ARG itself when no file has that name
    and it holds Jinja markup ({% or {{), as vllm takes either.

    Raises ChatTemplateError (a ValueError) in one line naming ARG and the fault: no such file, a
    directory, unreadable, not UTF-8, empty, not a valid Jinja template, or no jinja2 installed.
    """
    if not os.path.exists(arg) and any(mark in arg for mark in INLINE_TEMPLATE_MARKS):
        where, source = "--chat-template (inline template)", arg
    else:
        where = f"--chat-template {arg}"
        source = _read_template_file(arg, where)
    try:
        return ChatTemplate(source)
    except ImportError:
        raise ChatTemplateError("--chat-template needs the jinja2 package: pip install jinja2") from None
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{where}: {e}") from e


def _read_template_file(path: str, where: str) -> str:
    if not os.path.exists(path):
        raise ChatTemplateError(f"{where}: no such file")
    if os.path.isdir(path):
        raise ChatTemplateError(f"{where}: is a directory, not a template file")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except UnicodeDecodeError:
        raise ChatTemplateError(f"{where}: not a text file (not UTF-8)") from None
    except OSError as e:
        raise ChatTemplateError(f"{where}: cannot read it: {e.strerror or e}") from None
    if not source.strip():
        raise ChatTemplateError(f"{where}: the file is empty")
    return source
