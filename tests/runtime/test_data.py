"""Token data: the byte tokenizer, prepare (deterministic, split by document, atomic), token file validation,
batches as a pure function of (seed, step), evaluation batches, the default corpus and the prepare command."""

import argparse
import json
import shutil

import numpy as np
import pytest
import torch

from megatrain.cli.data import add_parser as add_prepare_parser
from megatrain.runtime import corpus
from megatrain.runtime.corpus import cached_default_corpus, default_corpus_files, prepare
from megatrain.runtime.data import (
    DOC_END,
    Batcher,
    DataError,
    TokenFile,
    decode,
    encode,
    eval_batches,
    sidecar_path,
)


@pytest.fixture
def texts(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    docs = {f"doc{i:02d}.txt": f"document {i}: " + "the quick brown fox. " * (i + 1) for i in range(12)}
    docs["sub/ünïcode.txt"] = "naïve café, 東京 — ok\n" * 3
    for name, text in docs.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder, docs


def write_raw(path, tokens, dtype="uint16", **meta):
    np.asarray(tokens, dtype=dtype).tofile(path)
    sidecar_path(path).write_text(json.dumps({"dtype": dtype, "n_tokens": len(tokens), **meta}))
    return path


def test_encode_decode_round_trip():
    text = "hello, wörld — 東京\n\ttabs"
    tokens = encode(text)
    assert tokens.dtype == np.uint16 and len(tokens) == len(text.encode())
    assert decode(tokens) == text
    assert decode(torch.from_numpy(tokens.astype(np.int64))) == text
    assert decode(np.array([0xE6, 0x9D])) == "\ufffd"  # a cut multi-byte character is replaced, not an error
    with pytest.raises(ValueError, match="byte tokens"):
        decode([300])


def test_prepare_is_deterministic_and_splits_by_document(tmp_path, texts):
    folder, docs = texts
    a = prepare([folder], tmp_path / "a", val_fraction=0.3, seed=7)
    b = prepare(sorted(folder.rglob("*.txt"), reverse=True), tmp_path / "b", val_fraction=0.3, seed=7)
    for pa, pb in zip(a, b):  # same bytes, whatever the input order
        assert pa.read_bytes() == pb.read_bytes()
        assert json.loads(sidecar_path(pa).read_text())["sha256"] == json.loads(sidecar_path(pb).read_text())["sha256"]
    train, val = (TokenFile.open(p, vocab_size=256) for p in a)
    # every document lands whole in exactly one split, each ended by DOC_END
    pieces = {side: decode(f.tokens).split(chr(DOC_END))[:-1] for side, f in (("train", train), ("val", val))}
    assert sorted(pieces["train"] + pieces["val"]) == sorted(docs.values())
    assert pieces["train"] and pieces["val"]
    assert train.meta["n_documents"] + val.meta["n_documents"] == len(docs)
    assert train.meta["tokenizer"] == "bytes" and train.meta["vocab_size"] == 256 and train.dtype == "uint16"
    train.verify()
    other = prepare([folder], tmp_path / "c", val_fraction=0.3, seed=8)
    assert other[1].read_bytes() != a[1].read_bytes()  # the seed changes the split


def test_prepare_never_leaves_a_split_empty(tmp_path, texts):
    folder, docs = texts
    train, val = (TokenFile.open(p) for p in prepare([folder], tmp_path / "out", val_fraction=0.001))
    assert val.meta["n_documents"] == 1 and train.meta["n_documents"] == len(docs) - 1
    train, val = (TokenFile.open(p) for p in prepare([folder], tmp_path / "none", val_fraction=0.0))
    assert val.n_tokens == 0 and train.meta["n_documents"] == len(docs)


def test_prepare_one_document_holds_out_its_tail(tmp_path):
    text = "".join(f"line {i}\n" for i in range(100))
    (tmp_path / "one.txt").write_text(text)
    train, val = (TokenFile.open(p) for p in prepare([tmp_path / "one.txt"], tmp_path / "out", val_fraction=0.1))
    head, tail = decode(train.tokens)[:-1], decode(val.tokens)[:-1]
    assert head + tail == text and tail.startswith("line ") and 0.05 < len(tail) / len(text) < 0.15


def test_prepare_is_atomic(tmp_path, texts, monkeypatch):
    folder, _ = texts
    out = tmp_path / "out"
    first = prepare([folder], out)
    before = first[0].read_bytes()

    def broken_documents():
        yield b"partial"
        raise KeyboardInterrupt  # interrupted mid-write

    with pytest.raises(KeyboardInterrupt):
        corpus.write_token_file(out / "train.bin", broken_documents(), "test")
    assert first[0].read_bytes() == before  # the old file is intact, no temporary left behind
    assert TokenFile.open(first[0]).n_tokens * 2 == len(before)
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "train.bin.json", "val.bin", "val.bin.json"]


def test_a_prepare_stopped_between_its_splits_leaves_the_earlier_pair_whole(tmp_path, texts, monkeypatch):
    """Both splits are written aside and moved in together: a prepare stopped after its train file (by a
    signal, here an interrupt while it writes val) leaves the earlier train/val pair byte for byte, and the
    hidden folder of one killed outright is removed by the next prepare."""
    folder, _ = texts
    out = tmp_path / "out"
    first = prepare([folder], out, val_fraction=0.3)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = corpus.write_token_file

    def stop_at_val(path, *a, **kw):
        if path.name == "val.bin":
            raise KeyboardInterrupt
        return real(path, *a, **kw)

    other = tmp_path / "other.txt"
    other.write_text("another corpus entirely. " * 50)
    monkeypatch.setattr(corpus, "write_token_file", stop_at_val)
    with pytest.raises(KeyboardInterrupt):
        prepare([other], out, val_fraction=0.3)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / ".prepare-999999999").mkdir()  # what a SIGKILLed prepare leaves (no such pid)
    prepare([other], out, val_fraction=0.3)
    assert sorted(p.name for p in out.iterdir()) == sorted(before)
    assert first[0].read_bytes() != before["train.bin"]  # replaced, now from other.txt


def test_prepare_input_errors(tmp_path):
    with pytest.raises(DataError, match="missing.txt: input not found"):
        prepare([tmp_path / "missing.txt"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no input files"):
        prepare([tmp_path / "empty"], tmp_path / "out")
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(DataError, match="val-fraction"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", val_fraction=1.0)
    with pytest.raises(DataError, match="not a folder"):
        prepare([tmp_path / "a.txt"], tmp_path / "a.txt")


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("missing", "token file not found; run `megatrain prepare"),
        ("no_sidecar", "sidecar tokens.bin.json is missing"),
        ("bad_json", "not valid JSON"),
        ("bad_dtype", "unknown dtype 'int8'"),
        ("partial_token", "is not a whole number of uint16 tokens"),
        ("count_mismatch", "holds 4 tokens but its sidecar says 5"),
        ("vocab", "holds token id 300 but the model's vocab_size is 256"),
    ],
)
def test_token_file_validation(tmp_path, case, match):
    path = tmp_path / "tokens.bin"
    if case != "missing":
        write_raw(path, [1, 2, 3, 300 if case == "vocab" else 4])
    side = sidecar_path(path)
    if case == "no_sidecar":
        side.unlink()
    elif case == "bad_json":
        side.write_text("{not json")
    elif case == "bad_dtype":
        side.write_text(json.dumps({"dtype": "int8", "n_tokens": 4}))
    elif case == "partial_token":
        with open(path, "ab") as f:
            f.write(b"\x01")
    elif case == "count_mismatch":
        side.write_text(json.dumps({"dtype": "uint16", "n_tokens": 5}))
    with pytest.raises(DataError, match=match) as info:
        TokenFile.open(path, vocab_size=256)
    message = str(info.value)
    assert "\n" not in message and (str(path) in message or str(side) in message)
    assert isinstance(info.value, ValueError)


def test_token_file_uint32_and_vocab_check(tmp_path):
    path = write_raw(tmp_path / "big.bin", [5, 70_000, 9], dtype="uint32")
    tf = TokenFile.open(path, vocab_size=100_000)
    assert tf.max_token() == 70_000 and tf.tokens.dtype == np.uint32 and len(tf) == 3
    with pytest.raises(DataError, match="70000"):
        TokenFile.open(path, vocab_size=65_536)


def test_verify_detects_changed_bytes(tmp_path, texts):
    folder, _ = texts
    train, _ = prepare([folder], tmp_path / "out")
    data = bytearray(train.read_bytes())
    data[0] ^= 1
    train.write_bytes(bytes(data))
    with pytest.raises(DataError, match="do not match the sha256"):
        TokenFile.open(train).verify()


@pytest.fixture
def token_file(tmp_path):
    return TokenFile.open(write_raw(tmp_path / "t.bin", np.arange(10_000) % 251), vocab_size=256)


def test_batches_are_a_pure_function_of_seed_and_step(token_file):
    batcher = Batcher(token_file, micro_batch=4, seq_len=32, n_micro_batches=3, seed=5)
    forward = [batcher.batch(s) for s in range(6)]
    backward = [Batcher(token_file, 4, 32, 3, seed=5).batch(s) for s in reversed(range(6))][::-1]
    for fa, fb in zip(forward, backward):
        assert len(fa) == 3
        for (xa, ya), (xb, yb) in zip(fa, fb):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(forward[0][0][0], forward[1][0][0])  # steps differ
    assert not torch.equal(Batcher(token_file, 4, 32, 3, seed=6).batch(0)[0][0], forward[0][0][0])  # seeds too


def test_targets_are_tokens_shifted_by_one(token_file):
    for x, y in Batcher(token_file, 2, 16, 2, seed=0).batch(3):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(y, (x + 1) % 251)  # the file counts up mod 251
        assert x.is_contiguous() and y.is_contiguous()


def test_windows_reach_both_ends(tmp_path):
    tf = TokenFile.open(write_raw(tmp_path / "t.bin", np.arange(12)))
    starts = {int(x[0, 0]) for step in range(300) for x, _ in Batcher(tf, 1, 10, 1, seed=0).batch(step)}
    assert starts == {0, 1}  # 12 tokens hold exactly two windows of 10 + 1


def test_batcher_state_and_resume_check(token_file):
    batcher = Batcher(token_file, 4, 32, 3, seed=5)
    state = batcher.state(17)
    assert state["seed"] == 5 and state["step"] == 17 and json.loads(json.dumps(state)) == state
    batcher.check_state(state)
    with pytest.raises(DataError, match="seed 5 vs 6"):
        Batcher(token_file, 4, 32, 3, seed=6).check_state(state)


def test_batch_size_errors(token_file):
    with pytest.raises(DataError, match="fewer than seq_len \\+ 1 = 10001"):
        Batcher(token_file, 1, 10_000, 1)
    with pytest.raises(DataError, match="micro_batch must be a positive integer"):
        Batcher(token_file, 0, 8, 1)
    with pytest.raises(DataError, match="seed"):
        Batcher(token_file, 1, 8, 1, seed=-1)


def test_eval_batches_are_fixed_and_evenly_spaced(token_file):
    batches = eval_batches(token_file, micro_batch=2, seq_len=99, n_batches=5)
    assert len(batches) == 5 and all(x.shape == (2, 99) for x, _ in batches)
    starts = [int(x[i, 0]) for x, _ in batches for i in range(2)]
    assert starts[0] == 0 and int(batches[-1][1][-1, -1]) == int(token_file.tokens[-1])
    again = eval_batches(token_file, 2, 99, 5)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))


def test_default_corpus_files_are_deterministic_and_capped():
    files = default_corpus_files()
    assert files and files == default_corpus_files()
    assert sum(p.stat().st_size for p in files) <= corpus.DEFAULT_CORPUS_CAP_BYTES
    assert all(p.suffix == ".py" for p in files)
    assert not any(part in ("test", "tests", "site-packages") for p in files for part in p.parts[-4:-1])
    small = default_corpus_files(cap_bytes=200_000)
    assert small == files[: len(small)]


def test_cached_default_corpus_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    train, val = cached_default_corpus()
    assert train.parent.parent == tmp_path / "cache" and train.parent.name.startswith("corpus-")
    tf = TokenFile.open(train, vocab_size=256)
    assert tf.n_tokens > 1_000_000 and TokenFile.open(val).n_tokens > 10_000
    mtime = train.stat().st_mtime_ns
    assert cached_default_corpus() == (train, val) and train.stat().st_mtime_ns == mtime  # reused
    sidecar_path(val).unlink()  # a copy left incomplete: rebuilt whole in a private folder, renamed over it
    assert cached_default_corpus() == (train, val) and TokenFile.open(val).n_tokens > 10_000
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [train.parent.name]  # no private folder left
    x, y = Batcher(tf, 2, 128, 1, seed=0).batch(0)[0]
    assert len(decode(x[0])) > 0
    good = train.read_bytes()
    spoiled = bytearray(good)
    spoiled[1000:1010] = b"\xff" * 10  # same size, bytes the sidecar's sha256 no longer matches
    train.write_bytes(bytes(spoiled))
    assert cached_default_corpus() == (train, val) and train.read_bytes() == good  # rebuilt, not blamed on --data
    shutil.rmtree(train.parent)
    train.parent.write_text("a file where the corpus folder goes")
    assert cached_default_corpus() == (train, val) and train.read_bytes() == good


def test_a_cache_that_cannot_be_written_is_one_line_naming_megatrain_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MEGATRAIN_CACHE", str(blocker / "cache"))
    with pytest.raises(ValueError, match=r"cannot write the default corpus in megatrain's cache .*set "
                                         r"MEGATRAIN_CACHE to a writable folder"):
        cached_default_corpus()


def test_ranks_sharing_a_cache_never_see_half_a_default_corpus(tmp_path, monkeypatch):
    """Two processes (the ranks of a world) building the default corpus at once: each returns a whole copy
    (both token files with their sidecars), whichever rename came first."""
    import threading

    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    got, errors = [], []

    def build():
        try:
            got.append(cached_default_corpus())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got[0] == got[1]
    assert all(TokenFile.open(p).n_tokens > 0 for p in got[0])
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [got[0][0].parent.name]


def test_prepare_command(tmp_path, texts, capsys):
    folder, _ = texts
    parser = argparse.ArgumentParser(prog="megatrain")
    add_prepare_parser(parser.add_subparsers())
    args = parser.parse_args(["prepare", str(folder), "--out", str(tmp_path / "out"), "--val-fraction", "0.2"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "train: " in out and "val: " in out and "tokens" in out
    assert (tmp_path / "out" / "train.bin").exists() and (tmp_path / "out" / "val.bin.json").exists()
    default = parser.parse_args(["prepare", "--out", str(tmp_path / "d")])
    assert default.inputs == [] and default.seed == 0 and default.val_fraction == 0.05
