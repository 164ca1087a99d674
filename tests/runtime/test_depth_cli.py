"""Depth mixing from the command line: inspect shows the state each unit carries, train takes --depth-mixing,
and depth-matrix prints DepthSSD's M at init and after training (rank at most N)."""

import json

import pytest

from megatrain.cli import main


@pytest.fixture()
def token_files(tmp_path):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path)


def test_inspect_shows_carry_and_rebuild_bytes(capsys):
    assert main(["inspect", "--model", "tiny", "--seq-len", "64", "--depth-mixing", "depthssd:8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["depth_mixing"] == "depthssd:8"
    block = next(u for u in got["units"] if u["name"] == "blocks.1")
    assert block["carry_in_bytes"] == 8 * 64 * 128 * 4  # N fp32 copies of (T, d)
    assert block["rebuild_bytes"] == 2 * 64 * 128 * 2  # two bf16 sub-layer inputs
    assert main(["inspect", "--model", "tiny", "--seq-len", "64", "--depth-mixing", "hc:4"]) == 0
    out = capsys.readouterr().out
    assert "depth mixing hc:4" in out and "carry in" in out and "64 KiB" in out  # 4 bf16 streams of (64, 128)


def test_depth_matrix_at_init_and_after_training(tmp_path, token_files, capsys):
    assert main(["depth-matrix", "--model", "tiny", "--depth-mixing", "depthssd:4", "--json"]) == 0
    init = json.loads(capsys.readouterr().out)
    assert init["semiseparable_rank"] == 4 and len(init["matrix"]) == 9  # h_1..h_8, h_out
    train, val = token_files
    ckpt = tmp_path / "ckpt"
    assert main(["train", "--model", "tiny", "--depth-mixing", "depthssd:2", "--device", "sim", "--gpu-mem",
                 "16MiB", "--seq-len", "64", "--micro-batch", "2", "--dtype", "fp32", "--steps", "3", "--lr", "3e-2",
                 "--data", str(train), "--val-data", str(val), "--checkpoint-every", "3", "--checkpoint-dir",
                 str(ckpt), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["depth-matrix", "--checkpoint", str(ckpt), "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["depth_mixing"] == "depthssd:2" and trained["semiseparable_rank"] <= 2
    assert main(["depth-matrix", "--model", "tiny", "--depth-mixing", "depthssd:2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["matrix"] != trained["matrix"]  # training moved it
    assert main(["depth-matrix", "--checkpoint", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "after step 3" in out and "h_out" in out and "shaded" in out


def test_depth_matrix_refuses_other_mixings(capsys):
    assert main(["depth-matrix", "--model", "tiny"]) == 2
    assert "depth-matrix shows DepthSSD's M" in capsys.readouterr().err
