"""The name a server gives its model (stats' `model`, the gateway's /v1/models, the `ringleader:
serving` line): a preset's name, a GGUF file's stem (tests/test_gguf_checkpoint.py, and the real
file in tests/test_real_model.py), a checkpoint directory's name; never the path."""

from __future__ import annotations

import json

import pytest

from ringleader.device.weights.checkpoint import load_config
from ringleader.ipc.client import Client
from tests.conftest import running_server

pytest.importorskip("transformers")

from ringleader.bench.lab.parity import make_hf_checkpoint


def test_a_checkpoint_directory_is_served_by_its_name(tmp_path):
    ckpt = make_hf_checkpoint(tmp_path / "models" / "my-llama")
    with running_server(str(ckpt), n_slots=2, max_ctx=64, token_budget=16) as server:
        assert server.server.backend.model.name == "my-llama"
        with Client(server.address, timeout=60) as client:
            assert client.stats()["model"] == "my-llama"


def test_a_directory_given_relatively_is_named_too(tmp_path, monkeypatch):
    ckpt = tmp_path / "my-llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        json.dumps({"model_type": "llama", "_name_or_path": "/elsewhere/trained", "vocab_size": 96,
                    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4}),
        encoding="utf-8",
    )  # fmt: skip
    monkeypatch.chdir(ckpt)
    assert load_config(".").name == load_config("./").name == "my-llama"
    assert load_config(str(ckpt) + "/").name == "my-llama"
    monkeypatch.chdir(tmp_path)
    assert load_config("my-llama").name == "my-llama"


def test_a_symlinked_directory_keeps_the_name_it_was_given(tmp_path):
    ckpt = tmp_path / "snapshots" / "0123abcd"  # as a hub cache lays a checkpoint out
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(
        json.dumps({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4}),
        encoding="utf-8",
    )  # fmt: skip
    (tmp_path / "smol").symlink_to(ckpt)
    assert load_config(tmp_path / "smol").name == "smol"


def test_a_preset_keeps_its_name(tiny_server):
    with Client(tiny_server.address, timeout=60) as client:
        assert client.stats()["model"] == "tiny"
