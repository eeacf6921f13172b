"""Prepacked bank snapshots: round trip, every key mismatch, corruption, and killed writes (CPU)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

import moestream
from moestream.warmstart import prepack
from moestream.warmstart.prepack import load_snapshot, save_snapshot, snapshot_key

PROMPTS = [torch.randint(2, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 23, 31)]


def fresh(folder, capacity=4, dtype="float32", **kw):
    return moestream.load(folder, device="cpu", dtype=dtype, capacity=capacity, **kw)


def bank_state(bank):
    """Everything a snapshot restores, as plain comparable values."""
    return {layer: (list(lb.owner), dict(lb.where), lb.slot_map.tolist(), lb.tensors["gate_up"].clone(), lb.tensors["down"].clone(),
                    bank.policy.freq[layer].tolist() if layer in bank.policy.freq else None,
                    bank.policy.last_use[layer].tolist() if layer in bank.policy.last_use else None,
                    sorted(bank.policy.pinned.get(layer, ())))
            for layer, lb in bank.layers.items()} | {"clock": bank.policy.clock}


def same_state(a, b) -> bool:
    if a.keys() != b.keys():
        return False
    for k, value in a.items():
        if k == "clock":
            if value != b[k]:
                return False
            continue
        (oa, wa, ma, ga, da, *pa), (ob, wb, mb, gb, db, *pb) = value, b[k]
        if (oa, wa, ma, pa) != (ob, wb, mb, pb) or not (torch.equal(ga, gb) and torch.equal(da, db)):
            return False
    return True


def counts(stats: dict) -> dict:
    """Statistics without the wall-clock fields."""
    return {k: counts(v) if isinstance(v, dict) else v for k, v in stats.items() if "_s" not in k}


@pytest.fixture(scope="module")
def ckpt(tiny_qwen3, tmp_path_factory):
    """A private copy of the tiny checkpoint (copy2 keeps sizes and mtimes), so tests may touch it."""
    return shutil.copytree(tiny_qwen3, tmp_path_factory.mktemp("prepack") / "ckpt")


@pytest.fixture(scope="module")
def warmed(ckpt, tmp_path_factory):
    """A capacity-4 bank warmed by generation, its snapshot, and the state it was saved in."""
    engine = fresh(ckpt)
    engine.generate(PROMPTS[1], max_tokens=24, ignore_eos=True)
    directory = tmp_path_factory.mktemp("snap")
    save_snapshot(engine.bank, directory, snapshot_key(engine.bank, ckpt))
    return engine, directory, bank_state(engine.bank)


@pytest.fixture
def snap(warmed, tmp_path):
    """A private copy of the valid snapshot, to damage."""
    return shutil.copytree(warmed[1], tmp_path / "snap")


def tensor_file(directory):
    (path,) = directory.glob("bank-*.safetensors")
    return path


def assert_refused(bank, directory, key, *words, **kw):
    before = bank_state(bank)
    ok, reason = load_snapshot(bank, directory, key, **kw)
    assert not ok
    assert "\n" not in reason
    for word in words:
        assert word in reason, reason
    assert same_state(before, bank_state(bank)), "a refused snapshot changed the bank"
    return reason


# ---- round trip ----------------------------------------------------------------------------
def test_round_trip_restores_the_bank_and_gives_the_same_tokens(ckpt, warmed, tmp_path):
    original, directory, saved = warmed
    engine = fresh(ckpt)
    engine.generate(PROMPTS[0], max_tokens=8, ignore_eos=True)   # a different bank to start from
    assert not same_state(saved, bank_state(engine.bank))
    ok, reason = load_snapshot(engine.bank, directory, snapshot_key(engine.bank, ckpt))
    assert ok, reason
    assert same_state(saved, bank_state(engine.bank))
    assert engine.bank.layers.keys() == original.bank.layers.keys() == {0, 2}

    # both banks now behave identically: same tokens, same hits and misses, same end state
    original.reset_stats()
    engine.reset_stats()
    prompt = PROMPTS[2]
    tokens = engine.generate(prompt, max_tokens=16, ignore_eos=True)
    assert tokens == original.generate(prompt, max_tokens=16, ignore_eos=True)
    assert counts(engine.stats()) == counts(original.stats())
    assert same_state(bank_state(engine.bank), bank_state(original.bank))
    reference = fresh(ckpt, capacity=None).generate(prompt, max_tokens=16, ignore_eos=True)   # fully resident
    assert engine.generate(prompt, max_tokens=16, ignore_eos=True) == reference


def test_pins_round_trip_and_pins_given_for_the_run_win(ckpt, tmp_path):
    pinned = {0: [5], 2: [6, 7]}
    engine = fresh(ckpt, pinned=pinned)
    engine.generate(PROMPTS[1], max_tokens=12, ignore_eos=True)
    save_snapshot(engine.bank, tmp_path, snapshot_key(engine.bank, ckpt))

    plain = fresh(ckpt)
    ok, reason = load_snapshot(plain.bank, tmp_path, snapshot_key(plain.bank, ckpt))
    assert ok, reason
    assert same_state(bank_state(engine.bank), bank_state(plain.bank))

    other = fresh(ckpt, pinned={2: [0]})
    ok, reason = load_snapshot(other.bank, tmp_path, snapshot_key(other.bank, ckpt))
    assert ok, reason
    assert other.bank.policy.pinned == {2: {0}}
    assert 0 in other.bank.layers[2].where
    for lb in other.bank.layers.values():   # the maps still agree after pin() installed expert 0
        assert all(lb.slot_map[e].item() == s for e, s in lb.where.items())
        assert lb.where == {e: s for s, e in enumerate(lb.owner) if e >= 0}


def test_bfloat16_round_trip(ckpt, tmp_path):
    engine = fresh(ckpt, dtype="bfloat16")
    engine.generate(PROMPTS[1], max_tokens=8, ignore_eos=True)
    save_snapshot(engine.bank, tmp_path, snapshot_key(engine.bank, ckpt))
    target = fresh(ckpt, dtype="bfloat16")
    ok, reason = load_snapshot(target.bank, tmp_path, snapshot_key(target.bank, ckpt))
    assert ok, reason
    assert same_state(bank_state(engine.bank), bank_state(target.bank))


def test_a_saved_file_is_plain_safetensors(warmed):
    from safetensors import safe_open

    directory = warmed[1]
    meta = json.loads((directory / "bank.json").read_text())
    with safe_open(str(directory / meta["file"]), framework="pt") as f:
        assert sorted(f.keys()) == sorted(f"layer.{l}.{p}" for l in (0, 2) for p in ("gate_up", "down", "slot_owner"))
        owner = f.get_tensor("layer.0.slot_owner")
        assert owner.dtype == torch.int32 and owner.shape == (4,)
    assert meta["policy"]["layers"]["0"]["freq"] is not None


# ---- key mismatches ------------------------------------------------------------------------
def test_no_snapshot(ckpt, tmp_path):
    bank = fresh(ckpt).bank
    assert_refused(bank, tmp_path / "nothing-here", snapshot_key(bank, ckpt), "no snapshot")


def test_other_checkpoint_folder(ckpt, warmed, tmp_path):
    copy = shutil.copytree(ckpt, tmp_path / "moved")   # same bytes and mtimes, other place
    bank = fresh(copy).bank
    assert_refused(bank, warmed[1], snapshot_key(bank, copy), "checkpoint.folder")


def test_touched_or_rewritten_shard(ckpt, tmp_path):
    copy = shutil.copytree(ckpt, tmp_path / "ckpt")
    bank = fresh(copy).bank
    save_snapshot(bank, tmp_path / "snap", snapshot_key(bank, copy))
    assert load_snapshot(bank, tmp_path / "snap", snapshot_key(bank, copy))[0]
    shard = next(copy.glob("*.safetensors"))
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert_refused(bank, tmp_path / "snap", snapshot_key(bank, copy), "checkpoint.files", shard.name)
    with open(shard, "ab") as f:   # a different size: re-downloaded or re-converted
        f.write(b"\0")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert_refused(bank, tmp_path / "snap", snapshot_key(bank, copy), "checkpoint.files", shard.name)


def test_other_capacity(ckpt, warmed):
    bank = fresh(ckpt, capacity=3).bank
    assert_refused(bank, warmed[1], snapshot_key(bank, ckpt), "capacity", "snapshot 4", "now 3")


def test_other_dtype(ckpt, warmed):
    bank = fresh(ckpt, dtype="bfloat16").bank
    assert_refused(bank, warmed[1], snapshot_key(bank, ckpt), "dtype", "bfloat16")


def test_other_engine_version(ckpt, warmed, monkeypatch):
    bank = fresh(ckpt).bank
    monkeypatch.setattr(moestream.version, "__version__", "99.0.0")
    assert_refused(bank, warmed[1], snapshot_key(bank, ckpt), "engine_version", "99.0.0")


def test_other_format_version(ckpt, warmed, monkeypatch):
    bank = fresh(ckpt).bank
    monkeypatch.setattr(prepack, "FORMAT_VERSION", prepack.FORMAT_VERSION + 1)
    assert_refused(bank, warmed[1], snapshot_key(bank, ckpt), "format")


# ---- corruption ----------------------------------------------------------------------------
@pytest.fixture
def target(ckpt):
    bank = fresh(ckpt).bank
    return bank, snapshot_key(bank, ckpt)


def test_truncated_tensor_file(target, snap):
    path = tensor_file(snap)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_refused(*target[:1], snap, target[1], "truncated")
    assert_refused(*target[:1], snap, target[1], "truncated", verify=False)
    meta = json.loads((snap / "bank.json").read_text())   # a JSON that agrees with the short file:
    meta["size"] = len(data) // 2                          # safetensors itself rejects it
    (snap / "bank.json").write_text(json.dumps(meta))
    assert_refused(*target[:1], snap, target[1], "unreadable", verify=False)
    path.write_bytes(data[:5])
    meta["size"] = 5
    (snap / "bank.json").write_text(json.dumps(meta))
    assert_refused(*target[:1], snap, target[1], "unreadable", verify=False)


def test_flipped_byte_fails_the_checksum(target, snap):
    path = tensor_file(snap)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(bytes(data))
    assert_refused(*target[:1], snap, target[1], "SHA-256")


BAD_FILE_NAME = json.dumps({"key": {}, "file": "../x", "size": 1, "sha256": "0", "policy": {}})


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", '{"key": {}}', BAD_FILE_NAME, "\udcff"])
def test_garbage_json(target, snap, text):
    (snap / "bank.json").write_text(text, errors="surrogateescape")
    assert_refused(*target[:1], snap, target[1], "unreadable")


def test_missing_tensor_file(target, snap):
    tensor_file(snap).unlink()
    assert_refused(*target[:1], snap, target[1], "missing")


def test_checksummed_but_inconsistent_contents(target, snap):
    """A file whose checksum matches but whose slot owners name one expert twice (a writer bug)."""
    bank, key = target
    path = tensor_file(snap)
    from safetensors.torch import load_file

    tensors = load_file(path)
    tensors["layer.2.slot_owner"] = torch.tensor([3, 3, -1, 1], dtype=torch.int32)
    save_file(tensors, path)
    meta = json.loads((snap / "bank.json").read_text())
    meta["size"], meta["sha256"] = path.stat().st_size, prepack._sha256_file(path)
    (snap / "bank.json").write_text(json.dumps(meta))
    assert_refused(bank, snap, key, "layer 2", "two slots")

    del tensors["layer.0.down"]
    save_file(tensors, path)
    meta["size"], meta["sha256"] = path.stat().st_size, prepack._sha256_file(path)
    (snap / "bank.json").write_text(json.dumps(meta))
    assert_refused(bank, snap, key, "layer.0.down", "missing")


# ---- killed writes -------------------------------------------------------------------------
def fail_on_call(monkeypatch, name, n):
    """Make os.<name> raise on its n-th call, as a kill at that point would stop the write."""
    real, calls = getattr(os, name), []

    def fake(*args, **kw):
        calls.append(args)
        if len(calls) == n:
            raise OSError(f"simulated crash in os.{name}")
        return real(*args, **kw)

    monkeypatch.setattr(os, name, fake)


def changed_bank(ckpt, directory):
    """A bank loaded from the snapshot, then moved on: saving it would replace the snapshot."""
    engine = fresh(ckpt)
    assert load_snapshot(engine.bank, directory, snapshot_key(engine.bank, ckpt))[0]
    engine.generate(PROMPTS[0], max_tokens=12, ignore_eos=True)
    engine.generate(PROMPTS[2], max_tokens=12, ignore_eos=True)
    return engine.bank


@pytest.mark.parametrize("crash", [("replace", 2), ("replace", 1), ("fsync", 1), ("fsync", 3)],
                         ids=["before-json-rename", "before-tensor-rename", "tensor-fsync", "json-fsync"])
def test_killed_write_keeps_the_previous_snapshot(ckpt, warmed, snap, monkeypatch, crash):
    saved = warmed[2]
    bank = changed_bank(ckpt, snap)
    assert not same_state(saved, bank_state(bank))
    fail_on_call(monkeypatch, *crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_snapshot(bank, snap, snapshot_key(bank, ckpt))
    monkeypatch.undo()
    assert not list(snap.glob(".bank-tmp-*"))   # the temporary was removed (a real kill leaves it; see below)

    target = fresh(ckpt)
    ok, reason = load_snapshot(target.bank, snap, snapshot_key(target.bank, ckpt))
    assert ok, reason   # bank.json still names the old tensor file, which is untouched
    assert same_state(saved, bank_state(target.bank))

    # the next save succeeds and sweeps orphans (a renamed tensor file, a killed writer's temporary)
    (snap / ".bank-tmp-killed").write_bytes(b"half")
    save_snapshot(bank, snap, snapshot_key(bank, ckpt))
    assert len(list(snap.glob("bank-*.safetensors"))) == 1 and not list(snap.glob(".bank-tmp-*"))
    ok, reason = load_snapshot(target.bank, snap, snapshot_key(target.bank, ckpt))
    assert ok, reason
    assert same_state(bank_state(bank), bank_state(target.bank))


def test_killed_first_write_leaves_nothing_that_loads(ckpt, warmed, tmp_path, monkeypatch):
    bank = warmed[0].bank
    fail_on_call(monkeypatch, "replace", 2)
    with pytest.raises(OSError):
        save_snapshot(bank, tmp_path, snapshot_key(bank, ckpt))
    monkeypatch.undo()
    assert list(tmp_path.glob("bank-*.safetensors"))   # the tensor file made it, the commit did not
    target = fresh(ckpt).bank
    assert_refused(target, tmp_path, snapshot_key(target, ckpt), "no snapshot")


def test_json_is_written_last(warmed, tmp_path, monkeypatch):
    """Order of the renames: the tensor file, then bank.json (the commit point)."""
    renamed = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(os.path.basename(b)), real(a, b))[1])
    engine, _, _ = warmed
    save_snapshot(engine.bank, tmp_path, {"any": "key"})
    assert len(renamed) == 2 and renamed[0].startswith("bank-") and renamed[1] == "bank.json"
    assert json.loads((tmp_path / "bank.json").read_text())["size"] == tensor_file(tmp_path).stat().st_size
