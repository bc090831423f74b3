"""Protocol 1.9 (issue 55): vLLM's request extensions on the native generate message.

- the decoder takes and refuses chat_template_kwargs, add_generation_prompt,
  continue_final_message, skip_special_tokens, spaces_between_special_tokens and min_tokens,
  naming the field; generate_msg refuses a priority or timeout_ms outside the decoder's ranges
  (a huge int used to fail in msgpack) and sends the extensions only when they differ from the
  defaults; the clients take them as keywords and judge them before anything is sent;
- continue_final_message renders as transformers' apply_chat_template does (the real SmolLM2
  template, and a trimming one), chat_template_kwargs reach the template and never replace what
  the server sets;
- skip_special_tokens=false spells special tokens out, on a real server too;
- min_tokens: on a real server greedy output that would end early goes on to min_tokens (the
  sampler's checks: tests/test_min_tokens.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import msgpack
import numpy as np
import pytest
import zmq

from ringleader.device.text.chat_template import ChatTemplate, ChatTemplateError
from ringleader.device.text.tokenizer import ByteTokenizer, IncrementalDetokenizer
from ringleader.hostctl.serving.tokenization import Tokenization
from ringleader.ipc import protocol as P
from ringleader.ipc.backend import ModelInfo
from ringleader.ipc.client import Client
from ringleader.ipc.request_extensions import RESERVED_TEMPLATE_KWARGS, ExtensionError
from ringleader.ipc.sampling_params import SamplingError, SamplingParams

LIMITS = P.Limits(vocab_size=1000, max_context=512, max_tokens_cap=256)
CHAT = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Bytes merge"}]


def _decode(**fields):
    msg = {"op": "generate", "id": "r", **fields}
    if not {"prompt", "prompt_ids", "messages"} & set(fields):
        msg["messages"] = CHAT
    return P.decode_request(msgpack.packb(msg, use_bin_type=True), LIMITS)


def _refused(field: str, **fields) -> str:
    with pytest.raises(P.BadRequest) as err:
        _decode(**fields)
    assert err.value.field == field and err.value.message.startswith(field + ": "), err.value.message
    return err.value.message


# ---------------------------------------------------------------- the decoder


def test_the_revision_is_at_least_1_9_and_the_server_knows_the_new_fields():
    assert P.PROTOCOL_VERSION == 1 and P.PROTOCOL_REVISION >= 9
    for name in (
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "min_tokens",
    ):
        assert name in P.GENERATE_FIELDS


def test_the_decoder_takes_each_extension():
    r = _decode(
        chat_template_kwargs={"enable_thinking": False, "tags": ["a", 1, 2.5, None], "x": {"y": True}},
        add_generation_prompt=False,
        continue_final_message=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        min_tokens=4,
        max_tokens=8,
    )
    assert r.chat_template_kwargs == {"enable_thinking": False, "tags": ["a", 1, 2.5, None], "x": {"y": True}}
    assert (r.add_generation_prompt, r.continue_final_message) == (False, True)
    assert (r.skip_special_tokens, r.spaces_between_special_tokens) == (False, False)
    assert r.sampling.min_tokens == 4
    default = _decode()
    assert default.chat_template_kwargs is None and default.add_generation_prompt
    assert not default.continue_final_message and default.skip_special_tokens
    assert default.spaces_between_special_tokens and default.sampling.min_tokens == 0
    # nil counts as absent; the decoding options go with any prompt
    assert _decode(chat_template_kwargs=None, min_tokens=None) == default
    plain = _decode(prompt_ids=[1, 2], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert not plain.skip_special_tokens and not plain.spaces_between_special_tokens


@pytest.mark.parametrize(
    "field, fields",
    [
        ("chat_template_kwargs", dict(chat_template_kwargs=[1])),
        ("chat_template_kwargs", dict(chat_template_kwargs={f"k{i}": i for i in range(65)})),
        ("chat_template_kwargs", dict(chat_template_kwargs={"x" * 65: 1})),
        ("chat_template_kwargs", dict(chat_template_kwargs={"big": "x" * (64 * 1024)})),
        ("chat_template_kwargs.deep", dict(chat_template_kwargs={"deep": [[[[[[[[[1]]]]]]]]]})),
        ("chat_template_kwargs.f", dict(chat_template_kwargs={"f": float("nan")})),
        ("chat_template_kwargs.b", dict(chat_template_kwargs={"b": b"bytes"})),
        ("chat_template_kwargs.bos_token", dict(chat_template_kwargs={"bos_token": "<x>"})),
        ("chat_template_kwargs.messages", dict(chat_template_kwargs={"messages": []})),
        (
            "chat_template_kwargs.add_generation_prompt",
            dict(chat_template_kwargs={"add_generation_prompt": 0}),
        ),
        ("chat_template_kwargs", dict(prompt="hi", chat_template_kwargs={"enable_thinking": True})),
        ("add_generation_prompt", dict(add_generation_prompt=1)),
        ("add_generation_prompt", dict(prompt="hi", add_generation_prompt=False)),
        ("continue_final_message", dict(continue_final_message="yes", add_generation_prompt=False)),
        ("continue_final_message", dict(prompt_ids=[1], continue_final_message=True)),
        ("continue_final_message", dict(continue_final_message=True)),  # add_generation_prompt true
        ("continue_final_message", dict(continue_final_message=True, add_generation_prompt=True)),
        (
            "continue_final_message",
            dict(messages=CHAT[:1], continue_final_message=True, add_generation_prompt=False),
        ),
        ("skip_special_tokens", dict(skip_special_tokens=0)),
        ("spaces_between_special_tokens", dict(spaces_between_special_tokens="no")),
        ("min_tokens", dict(min_tokens=-1)),
        ("min_tokens", dict(min_tokens=1.5)),
        ("min_tokens", dict(min_tokens=True)),
        ("min_tokens", dict(min_tokens=2**31)),
        ("min_tokens", dict(min_tokens=9, max_tokens=8)),
    ],
)
def test_the_decoder_refuses_a_bad_extension_naming_it(field, fields):
    message = _refused(field, **fields)
    if field.startswith("chat_template_kwargs.") and field.split(".")[1] in RESERVED_TEMPLATE_KWARGS:
        assert "set by the server" in message
    if fields.get("continue_final_message") is True and fields.get("add_generation_prompt", True):
        assert (
            "add_generation_prompt" if "prompt_ids" not in fields else "only goes with messages"
        ) in message
    if "messages" in fields:
        assert "assistant" in message


def test_the_extensions_round_trip_and_a_default_request_sends_none():
    req = P.GenerateRequest(
        "r",
        None,
        None,
        SamplingParams(max_tokens=8, min_tokens=3),
        messages=CHAT,
        chat_template_kwargs={"enable_thinking": True},
        add_generation_prompt=False,
        continue_final_message=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    msg = P.generate_msg(req)
    assert msg["min_tokens"] == 3 and msg["chat_template_kwargs"] == {"enable_thinking": True}
    assert P.decode_request(P.encode_request(req), LIMITS) == req
    plain = P.generate_msg(P.GenerateRequest("r", None, [1, 2], SamplingParams(), messages=None))
    assert plain == {"op": "generate", "id": "r", "prompt_ids": [1, 2], "priority": 0}
    # the encoder judges them as the decoder does: nothing a server would refuse goes out
    with pytest.raises(ExtensionError, match="^continue_final_message: "):
        P.generate_msg(dataclasses.replace(req, add_generation_prompt=True))
    with pytest.raises(ExtensionError, match="^skip_special_tokens: "):
        P.generate_msg(dataclasses.replace(req, skip_special_tokens="no"))


@pytest.mark.parametrize(
    "field, value, words",
    [
        (
            "priority",
            10**30,
            "priority: must be an int in [-1000, 1000], got 1000000000000000000000000000000",
        ),
        ("priority", -(10**30), "priority: must be an int in [-1000, 1000]"),
        ("priority", 1001, "priority: must be an int in [-1000, 1000], got 1001"),
        ("priority", True, "priority: must be an int in [-1000, 1000], got True"),
        ("priority", "1", "priority: must be an int in [-1000, 1000], got '1'"),
        (
            "timeout_ms",
            10**30,
            "timeout_ms: must be an int in [1, 86400000], got 1000000000000000000000000000000",
        ),
        ("timeout_ms", 0, "timeout_ms: must be an int in [1, 86400000], got 0"),
        ("timeout_ms", 2.5, "timeout_ms: must be an int in [1, 86400000], got 2.5"),
    ],
)
def test_priority_and_timeout_ms_out_of_range_are_value_errors_naming_them(field, value, words):
    req = P.GenerateRequest("r", None, [1], SamplingParams(), **{field: value})
    with pytest.raises(ValueError) as err:
        P.generate_msg(req)
    assert str(err.value).startswith(words)
    assert not isinstance(err.value, OverflowError)
    with Client("tcp://127.0.0.1:9", timeout=1) as client, pytest.raises(ValueError) as err:
        client.generate(prompt_ids=[1], **{field: value})
    assert str(err.value).startswith(words) and not client._core.streams
    # numpy ints in range still go out as ints
    assert (
        P.generate_msg(P.GenerateRequest("r", None, [1], SamplingParams(), priority=np.int64(5)))["priority"]
        == 5
    )


# ---------------------------------------------------------------- the clients


class _Capture:
    """A ROUTER (on its own thread) that keeps every generate frame a client sends and answers
    each with a done, and each hello as a 1.9 server does."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.frames: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, frame = self.sock.recv_multipart()
            msg = msgpack.unpackb(frame)
            if msg["op"] == "generate":
                self.frames.append(frame)
                reply = P.done_msg(msg["id"], "stop", 1, 0)
            elif msg["op"] == "hello":
                reply = P.hello_reply_msg(False)
            elif msg["op"] == "ping":
                reply = P.pong_msg()
            else:
                continue
            self.sock.send_multipart([identity, P.encode(reply)])

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)


EXTENSIONS = dict(
    chat_template_kwargs={"enable_thinking": False},
    add_generation_prompt=False,
    continue_final_message=True,
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
)


def test_both_clients_send_the_extensions_as_generate_msg_writes_them():
    import asyncio

    from ringleader.ipc.client import AsyncClient

    server = _Capture()
    try:
        with Client(server.address, timeout=20) as client:
            client.complete(messages=CHAT, max_tokens=4, min_tokens=2, request_id=1, **EXTENSIONS)
            client.complete(messages=CHAT, max_tokens=4, request_id=2)

        async def run():
            async with AsyncClient(server.address, timeout=20) as client:
                await client.complete(messages=CHAT, max_tokens=4, min_tokens=2, request_id=3, **EXTENSIONS)

        asyncio.run(run())
        frames = server.frames
    finally:
        server.close()
    sampling = SamplingParams(max_tokens=4, min_tokens=2)
    for rid, frame in ((1, frames[0]), (3, frames[2])):
        want = P.GenerateRequest(rid, None, None, sampling, messages=CHAT, **EXTENSIONS)
        assert frame == P.encode(P.generate_msg(want))
    # the defaults send nothing new: an older server reads the frame as before
    assert frames[1] == P.encode(
        P.generate_msg(P.GenerateRequest(2, None, None, SamplingParams(max_tokens=4), messages=CHAT))
    )
    assert not {"add_generation_prompt", "skip_special_tokens", "min_tokens"} & set(
        msgpack.unpackb(frames[1])
    )


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("continue_final_message", dict(messages=CHAT, continue_final_message=True)),
        (
            "continue_final_message",
            dict(messages=CHAT[:1], continue_final_message=True, add_generation_prompt=False),
        ),
        ("chat_template_kwargs", dict(prompt="hi", chat_template_kwargs={"a": 1})),
        ("chat_template_kwargs.eos_token", dict(messages=CHAT, chat_template_kwargs={"eos_token": "x"})),
        ("add_generation_prompt", dict(prompt="hi", add_generation_prompt=False)),
        ("skip_special_tokens", dict(prompt="hi", skip_special_tokens=None)),
        ("min_tokens", dict(prompt="hi", max_tokens=2, min_tokens=3)),
    ],
)
def test_the_client_refuses_a_bad_extension_before_sending(field, kwargs):
    with Client("tcp://127.0.0.1:9", timeout=1) as client, pytest.raises(ValueError) as err:
        client.generate(**kwargs)
    assert str(err.value).startswith(field + ": ") and not client._core.streams
    assert isinstance(err.value, (ExtensionError, SamplingError))


def test_the_client_keywords_are_the_gateways():
    params = inspect.signature(Client.generate).parameters
    for name, default in P.GenerateRequest.__dataclass_fields__.items():
        if name in EXTENSIONS:
            assert params[name].default == default.default, name


# ---------------------------------------------------------------- rendering

SMOL_CHATS = [
    CHAT,
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Trailing space \n"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "List two colors."},
        {"role": "assistant", "content": "Red and"},
    ],
]
SMOL_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    from ringleader.device.model.presets import tokenizer_for

    return tokenizer_for(str(smollm2_gguf))


@pytest.fixture(scope="module")
def smol_hf(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.mark.parametrize("chat", SMOL_CHATS, ids=["haiku", "empty", "trailing", "system"])
def test_continue_final_message_leaves_the_final_message_open_on_smollm2(smol, chat):
    """The expected text derived from SmolLM2's template (ChatML with a default system turn):
    the conversation up to the final message's content, with no end of turn after it (the next
    test compares with transformers itself where it is installed)."""
    got = smol.render_chat(chat, add_generation_prompt=False, continue_final_message=True)
    head = "" if chat[0]["role"] == "system" else SMOL_SYSTEM
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat[:-1])
    assert got == head + turns + "<|im_start|>assistant\n" + chat[-1]["content"]
    ids = smol.encode_chat(chat, add_generation_prompt=False, continue_final_message=True)
    assert smol.decode(ids, skip_special_tokens=False) == got
    closed = smol.render_chat(chat, add_generation_prompt=False)
    assert closed == got + "<|im_end|>\n"  # without it the turn is closed


@pytest.mark.parametrize("chat", SMOL_CHATS, ids=["haiku", "empty", "trailing", "system"])
def test_continue_final_message_equals_transformers_apply_chat_template(smol, smol_hf, chat):
    want = smol_hf.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert smol.render_chat(chat, add_generation_prompt=False, continue_final_message=True) == want
    ids = smol_hf.apply_chat_template(
        chat, tokenize=True, add_generation_prompt=False, continue_final_message=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert smol.encode_chat(chat, add_generation_prompt=False, continue_final_message=True) == list(ids)


TRIMMING = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
THINKING = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% if enable_thinking %}<think>{% else %}<think></think>"
    "{% endif %}{% endif %}{% if style is defined %}({{ style.name }}, {{ style.tags | join(',') }}){% endif %}"
)


def _reference():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def test_continue_final_message_of_a_trimming_template_matches_transformers():
    chat = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "Well,  \n"}]
    got = ChatTemplate(TRIMMING).render(
        chat, add_generation_prompt=False, continue_final_message=True, bos_token="<s>"
    )
    assert got == "<s><|user|>hi<|end|><|assistant|>Well,"  # the trimmed tag's space: rstripped
    ref = _reference()
    want = ref.apply_chat_template(
        chat, chat_template=TRIMMING, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert got == want


def test_continue_final_message_refusals_name_the_field():
    tmpl = ChatTemplate(THINKING)
    with pytest.raises(ChatTemplateError) as err:
        tmpl.render(CHAT, add_generation_prompt=True, continue_final_message=True)
    assert err.value.field == "continue_final_message"
    with pytest.raises(ChatTemplateError) as err:  # a template that drops the messages' content
        ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}").render(
            CHAT, add_generation_prompt=False, continue_final_message=True
        )
    assert err.value.field == "continue_final_message"
    with pytest.raises(ChatTemplateError) as err:  # content read, but not written out
        ChatTemplate("{% for m in messages %}{{ m.content | length }}{% endfor %}").render(
            CHAT, add_generation_prompt=False, continue_final_message=True
        )
    assert err.value.field == "continue_final_message" and "does not appear" in str(err.value)


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them():
    tmpl = ChatTemplate(THINKING)
    chat = CHAT[:1]
    kwargs = {"enable_thinking": True, "style": {"name": "terse", "tags": ["a", "b"]}}
    got = tmpl.render(chat, template_kwargs=kwargs)
    assert got == "[user] Write a haiku.\n[assistant] <think>(terse, a,b)"
    assert (
        tmpl.render(chat, template_kwargs={"enable_thinking": False})
        == "[user] Write a haiku.\n[assistant] <think></think>"
    )
    assert tmpl.render(chat) == "[user] Write a haiku.\n[assistant] <think></think>"
    want = _reference().apply_chat_template(
        chat, chat_template=THINKING, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert got == want
    for reserved in ("messages", "bos_token", "eos_token", "add_generation_prompt"):
        with pytest.raises(ChatTemplateError) as err:
            tmpl.render(chat, template_kwargs={reserved: "x"}, bos_token="<s>")
        assert err.value.field == f"chat_template_kwargs.{reserved}"


def test_tokenization_renders_with_the_requests_options_and_names_the_field():
    tok = ByteTokenizer()
    tok.chat_template = ChatTemplate(THINKING)
    info = ModelInfo("m", 264, 512, (257,), tokenizer=tok, encode_chat=tok.encode_chat)
    tk = Tokenization(info, LIMITS)
    r = _decode(chat_template_kwargs={"enable_thinking": True}, max_tokens=4)
    assert tk.prompt(r).ids == tok.encode(
        "[user] Write a haiku.\n[assistant] Bytes merge\n[assistant] <think>"
    )
    r = _decode(add_generation_prompt=False, continue_final_message=True, max_tokens=4)
    assert tk.prompt(r).ids == tok.encode("[user] Write a haiku.\n[assistant] Bytes merge")
    r = _decode(add_generation_prompt=False, max_tokens=4)
    assert tk.prompt(r).ids == tok.encode("[user] Write a haiku.\n[assistant] Bytes merge\n")
    tok.chat_template = ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(P.BadRequest) as err:
        tk.prompt(_decode(add_generation_prompt=False, continue_final_message=True, max_tokens=4))
    assert err.value.field == "continue_final_message"


# ---------------------------------------------------------------- detokenizing


def test_skip_special_tokens_false_keeps_special_tokens_in_the_stream(smol, smol_hf):
    ids = smol.encode(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! 日本<|im_end|>",
        add_special_tokens=False,
    )
    for skip in (True, False):
        for spaces in (True, False):
            det = IncrementalDetokenizer(smol, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            text = "".join(det.push(i) for i in ids) + det.flush()
            # transformers' GGUF (tokenizers-backed) tokenizer ignores spaces_between_special_tokens too
            assert text == smol.decode(ids, skip_special_tokens=skip)
            assert text == smol_hf.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            assert ("<|im_end|>" in text) is (not skip)


def test_the_detokenizer_is_made_with_the_requests_options():
    made = []

    def factory(**options):
        made.append(options)
        return object()

    tk = Tokenization(ModelInfo("m", 264, 512, (257,), new_detokenizer=factory), LIMITS)
    tk.new_detokenizer(_decode(prompt_ids=[1]))
    tk.new_detokenizer(_decode(prompt_ids=[1], skip_special_tokens=False))
    tk.new_detokenizer(_decode(prompt_ids=[1], spaces_between_special_tokens=False))
    assert made == [
        {},
        {"skip_special_tokens": False, "spaces_between_special_tokens": True},
        {"skip_special_tokens": True, "spaces_between_special_tokens": False},
    ]


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def smol_server(smollm2_gguf):
    from ringleader.device.backends.cpu import CpuBackend
    from tests.conftest import running_server

    with running_server(
        str(smollm2_gguf), backend_cls=CpuBackend, n_slots=4, max_ctx=512, token_budget=32
    ) as bg:
        yield bg


QUESTION = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]


def test_min_tokens_makes_greedy_output_go_on_past_its_eos(smol_server, smol):
    with Client(smol_server.address, timeout=300) as client:
        short = client.complete(messages=QUESTION, max_tokens=64)
        n = len(short.token_ids)
        assert short.done.finish_reason == "stop" and short.token_ids[-1] in smol.eos_token_ids
        assert n <= 40, short.text  # the model answers in a sentence, then its EOS
        long = client.complete(messages=QUESTION, max_tokens=64, min_tokens=n + 8)
        seeded = client.complete(messages=QUESTION, max_tokens=64, min_tokens=n + 8, temperature=1.0, seed=3)
    assert len(long.token_ids) >= n + 8
    assert not set(long.token_ids[: n + 8]) & set(smol.eos_token_ids)
    # the mask changes nothing but the end ids: the same greedy tokens up to the EOS it kept out
    assert (
        long.token_ids[: n - 1] == short.token_ids[: n - 1] and long.token_ids[n - 1] != short.token_ids[-1]
    )
    assert len(seeded.token_ids) >= n + 8 and not set(seeded.token_ids[: n + 8]) & set(smol.eos_token_ids)


def test_skip_special_tokens_false_spells_the_eos_out_on_a_server(smol_server, smol):
    with Client(smol_server.address, timeout=300) as client:
        plain = client.complete(messages=QUESTION, max_tokens=32)
        spelled = client.complete(messages=QUESTION, max_tokens=32, skip_special_tokens=False)
        spaced = client.complete(
            messages=QUESTION, max_tokens=32, skip_special_tokens=False, spaces_between_special_tokens=False
        )
    assert spelled.token_ids == plain.token_ids and spelled.token_ids[-1] in smol.eos_token_ids
    assert "<|im_end|>" not in plain.text and spelled.text == plain.text + "<|im_end|>"
    assert spelled.text == smol.decode(spelled.token_ids, skip_special_tokens=False)
    assert spaced.text == spelled.text  # no effect with this tokenizer (as transformers' fast ones)


def test_a_server_continues_the_final_message_and_refuses_by_name(smol_server, smol):
    from tests.conftest import RawPeer

    chat = [QUESTION[0], {"role": "assistant", "content": "The sky is"}]
    with Client(smol_server.address, timeout=300) as client:
        cont = client.complete(
            messages=chat, max_tokens=8, add_generation_prompt=False, continue_final_message=True
        )
    assert cont.done.prompt_tokens == len(
        smol.encode_chat(chat, add_generation_prompt=False, continue_final_message=True)
    )
    assert cont.done.finish_reason in ("stop", "length") and cont.token_ids
    peer = RawPeer(smol_server.address)  # what the clients refuse before sending, sent by hand
    try:
        refused = {
            "chat_template_kwargs.raise_exception": dict(
                messages=chat, chat_template_kwargs={"raise_exception": 1}
            ),
            "continue_final_message": dict(
                messages=QUESTION, add_generation_prompt=False, continue_final_message=True
            ),
            "add_generation_prompt": dict(prompt="hi", add_generation_prompt=False),
            "min_tokens": dict(prompt="hi", max_tokens=2, min_tokens=3),
        }
        for i, (field, fields) in enumerate(refused.items()):
            peer.send({"op": "generate", "id": i, **fields})
            done = peer.recv_until(lambda m: m.get("op") == "done")[-1]
            assert done["error"]["code"] == "bad_request", done
            assert done["error"]["message"].startswith(field + ": "), done
        peer.send({"op": "generate", "id": 9, "messages": chat, "max_tokens": 2})
        assert peer.recv_until(lambda m: m.get("op") == "done")[-1]["finish_reason"] in ("stop", "length")
    finally:
        peer.close()
