"""bench/lab/gpu_model_pieces.py: a model file carried in pieces over two device calls, checked whole."""

from __future__ import annotations

import json
import os

import pytest

from ringleader.bench.lab import gpu_model_pieces as gmp


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(3 * 2**20 + 17))
    return path


def test_split_stash_join_gives_the_file_back(model_file, tmp_path):
    assert gmp.main(["split", str(model_file), "--pieces", "2", "--out", str(tmp_path / "carry")]) == 0
    one, two = tmp_path / "carry/piece-1", tmp_path / "carry/piece-2"
    assert json.loads((one / gmp.MANIFEST).read_text())["pieces"] == 2
    assert (
        sum(p.stat().st_size for p in (*one.glob("*.part*"), *two.glob("*.part*")))
        == model_file.stat().st_size
    )
    stash = tmp_path / "stash"
    assert gmp.main(["stash", str(one), "--to", str(stash)]) == 0  # call 1
    assert gmp.main(["join", str(stash), str(two), "--out", str(tmp_path / "models")]) == 0  # call 2
    assert (tmp_path / "models/model.gguf").read_bytes() == model_file.read_bytes()


def test_join_names_a_missing_piece(model_file, tmp_path, capsys):
    gmp.split(model_file, 2, tmp_path / "carry")
    assert gmp.main(["join", str(tmp_path / "carry/piece-2"), "--out", str(tmp_path / "models")]) == 1
    assert "piece(s) [1] of 2 missing" in capsys.readouterr().err
    assert not (tmp_path / "models/model.gguf").exists()


def test_a_broken_part_is_refused_before_anything_is_written(model_file, tmp_path, capsys):
    one, two = gmp.split(model_file, 2, tmp_path / "carry")
    part = next(two.glob("*.part*"))
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    assert gmp.main(["stash", str(two), "--to", str(tmp_path / "stash")]) == 1
    assert "SHA-256 differs" in capsys.readouterr().err
    assert gmp.main(["join", str(one), str(two), "--out", str(tmp_path / "models")]) == 1
    assert not (tmp_path / "models/model.gguf").exists()
