"""Prepacked bank: a snapshot of a warmed bank, so that a restart skips the per-expert reads.

A snapshot is a directory with two files:

  bank-<sha256 prefix>.safetensors   per MoE layer `layer.L.slot_owner` (int32 (S,), slot → expert,
                                     -1 free) and `layer.L.<name>` for every tensor of the bank's expert
                                     format (dense: gate_up (S, 2I, H) and down (S, H, I))
  bank.json                          the key (what must match to reuse it, the expert format and its
                                     layout included), the tensor file's name, size and SHA-256, and
                                     the residency policy's statistics and pins

Commit protocol: the tensor file is written under a temporary name, fsync'd and renamed to a
name that contains its checksum; only then is bank.json written the same way and renamed over
the old one. bank.json is the single commit point: a write killed at any moment leaves either
the previous snapshot (its JSON still names its own, untouched tensor file) or nothing that
loads, never a JSON that points at a half-written tensor file. Stale tensor files and
temporaries are removed by the next save, under a lock so two savers never delete each other's
files.

The tensor file is written by a small streaming safetensors writer (one tensor in host memory at
a time) rather than `safetensors.torch.save_file`, which needs the whole
bank in host RAM at once: on CUDA the bank can be tens of GB.

Cost of loading: the checksum is verified by reading the file once before anything in the bank is
touched; it is a SHA-256 over per-64-MiB-block SHA-256s computed on every core, since one serial
SHA-256 (1-2 GB/s) would spend 10-20 s on a 20 GB bank (`verify=False` skips it and still
catches truncation through the size and the safetensors header). The tensors are then read through safetensors' mmap, mostly from the page
cache the hash just filled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from moestream.checkpoint.safetensors_writer import ST_NAMES, write_safetensors
from moestream.experts.bank import ExpertBank
from moestream.experts.store import read_workers
from moestream.fileio import write_atomic
from moestream import version

# 2: block digest (parallel SHA-256 of 64 MiB blocks) instead of one serial SHA-256
# 3: slot tensors named by the expert format; the key holds the format's layout
FORMAT_VERSION = 3
JSON_NAME = "bank.json"
TMP_PREFIX = ".bank-tmp-"   # temporaries of a save; the next save sweeps what a killed writer left
_DIGEST_BLOCK = 64 << 20
Key = dict


# ---- the key -------------------------------------------------------------------------------
def _checkpoint_identity(folder: Path) -> dict:
    """Resolved folder plus (size, mtime_ns) of every weight shard and the config: cheap, no hashing.

    A re-download, re-conversion or edit changes size or mtime; a copy elsewhere changes the path.
    """
    folder = folder.resolve()
    if folder.is_file():   # a GGUF: its file(s)
        from moestream.checkpoint.gguf_file import split_files

        return {"folder": str(folder), "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns]
                                                 for p in split_files(folder)}}
    names = sorted(p.name for p in folder.glob("*.safetensors"))
    names += [n for n in ("config.json", "model.safetensors.index.json") if (folder / n).exists()]
    files = {}
    for name in names:
        st = (folder / name).stat()
        files[name] = [st.st_size, st.st_mtime_ns]
    return {"folder": str(folder), "files": files}


def snapshot_key(bank: ExpertBank, checkpoint_folder: str | Path | None = None) -> Key:
    """Everything a snapshot must agree on to be reused; JSON-ready (lists, ints, strings only).

    The device is deliberately absent: a snapshot taken on one device loads on another.
    """
    store = bank.store
    folder = Path(checkpoint_folder) if checkpoint_folder is not None else Path(store.index.folder)
    return {
        "format": FORMAT_VERSION,   # compared first: the other fields may mean something else in another format
        "engine_version": version.__version__,
        "arch": store.spec.name,
        "checkpoint": _checkpoint_identity(folder),
        "num_experts": bank.num_experts,
        "capacity": bank.capacity,
        "moe_layers": sorted(bank.layers),
        "dtype": str(bank.dtype).removeprefix("torch."),
        "expert_formats": {str(layer): fmt.describe(store.shape) for layer, fmt in sorted(bank.formats.items())},
    }


_MISSING = object()


def _difference(old, new, path: str) -> str | None:
    """A one-line description of the first field where two keys differ, or None when equal."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in list(old) + [k for k in new if k not in old]:
            found = _difference(old.get(k, _MISSING), new.get(k, _MISSING), f"{path}.{k}" if path else str(k))
            if found:
                return found
        return None
    if old == new:
        return None
    return f"{path} differs (snapshot {_show(old)}, now {_show(new)})"


def _show(value) -> str:
    return "absent" if value is _MISSING else json.dumps(value)[:120]


# ---- writing -------------------------------------------------------------------------------
@contextlib.contextmanager
def _save_lock(directory: Path) -> Iterator[None]:
    """One saver per directory at a time; the OS drops the lock when a saver dies."""
    try:
        import fcntl
    except ImportError:   # not POSIX: no lock, savers are assumed not to race
        yield
        return
    with open(directory / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tensors(bank: ExpertBank) -> dict[str, torch.Tensor]:
    """Name → tensor (views, nothing copied); slot owners first so every later offset stays 4-aligned."""
    out = {f"layer.{layer}.slot_owner": torch.tensor(bank.layers[layer].owner, dtype=torch.int32)
           for layer in sorted(bank.layers)}
    for layer in sorted(bank.layers):
        for name, t in bank.layers[layer].tensors.items():
            out[f"layer.{layer}.{name}"] = t
    return out


def _write_safetensors(bank: ExpertBank, f: BinaryIO) -> str:
    """Stream the bank into an open file in safetensors layout; return the digest of what was written."""
    tensors = _tensors(bank)
    write_safetensors(f, [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()], tensors.__getitem__,
                      {"format": "moestream-bank", "format_version": str(FORMAT_VERSION)})
    return _chunked_sha256(f.fileno(), f.tell())   # re-read from the page cache, in parallel


def _chunked_sha256(fd: int, size: int) -> str:
    """SHA-256 of the SHA-256s of each 64 MiB block, the blocks hashed in parallel threads.

    One serial SHA-256 runs at ~1.5 GB/s, which would dominate a warm start of a multi-GB bank;
    hashlib releases the GIL, so blocks hash on every core. Any changed byte changes the digest.
    """
    def block(i: int) -> bytes:
        offset = i * _DIGEST_BLOCK
        data = os.pread(fd, min(_DIGEST_BLOCK, size - offset), offset)
        return hashlib.sha256(data).digest()

    blocks = -(-size // _DIGEST_BLOCK)
    with ThreadPoolExecutor(read_workers()) as pool:
        digests = list(pool.map(block, range(blocks)))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def save_snapshot(bank: ExpertBank, directory: str | Path, key: Key) -> Path:
    """Save the bank's slots, slot owners and policy state; return the path of bank.json.

    Call it between requests (nothing in flight): the slots are read as they are now.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bank.synchronize()   # copies on the bank's copy stream must have landed
    with _save_lock(directory):
        tensor_path, sha = write_atomic(lambda sha: directory / f"bank-{sha[:16]}.safetensors",
                                        lambda f: _write_safetensors(bank, f), directory=directory, prefix=TMP_PREFIX)
        meta = {"key": key, "file": tensor_path.name, "size": tensor_path.stat().st_size, "sha256": sha,
                "policy": bank.policy.state(sorted(bank.layers))}
        text = json.dumps(meta, indent=1).encode()
        json_path, _ = write_atomic(directory / JSON_NAME, lambda f: f.write(text), prefix=TMP_PREFIX)   # the commit point
        for stale in list(directory.glob("bank-*.safetensors")) + list(directory.glob(TMP_PREFIX + "*")):
            if stale.name != tensor_path.name:
                with contextlib.suppress(OSError):
                    stale.unlink()
    return json_path


# ---- loading -------------------------------------------------------------------------------
def _sha256_file(path: Path) -> str:
    """The snapshot's block digest (see _chunked_sha256): reads the file once, a block per thread."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _chunked_sha256(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _read_meta(directory: Path) -> tuple[dict | None, str]:
    """bank.json as a dict with the fields load needs, or None and why not."""
    path = directory / JSON_NAME
    if not path.exists():
        return None, f"no snapshot in {directory}"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:   # UnicodeDecodeError is a ValueError
        return None, f"{path} is unreadable ({exc})"
    if not isinstance(meta, dict):
        return None, f"{path} is unreadable (not a JSON object)"
    for field, kind in (("key", dict), ("file", str), ("size", int), ("sha256", str), ("policy", dict)):
        if not isinstance(meta.get(field), kind):
            return None, f"{path} is unreadable (field {field!r} is missing or not a {kind.__name__})"
    if Path(meta["file"]).name != meta["file"]:
        return None, f"{path} is unreadable (field 'file' is not a plain file name)"
    return meta, ""


def _check_layer(owner: np.ndarray, num_experts: int, capacity: int) -> str | None:
    if owner.shape != (capacity,):
        return f"slot_owner has shape {list(owner.shape)}, expected [{capacity}]"
    held = owner[owner >= 0]
    if (owner < -1).any() or (owner >= num_experts).any():
        return "slot_owner holds an expert id out of range"
    if len(np.unique(held)) != len(held):
        return "slot_owner names one expert in two slots"
    return None


def _check_policy(meta: dict, bank: ExpertBank) -> str | None:
    layers = meta["policy"].get("layers")
    if not isinstance(layers, dict) or not isinstance(meta["policy"].get("clock", 0), (int, float)):
        return "policy state is malformed"
    E = bank.num_experts
    for layer in bank.layers:
        state = layers.get(str(layer))
        if not isinstance(state, dict):
            return f"policy state of layer {layer} is missing"
        freq, last = state.get("freq"), state.get("last_use")
        if (freq is None) != (last is None) or any(v is not None and (not isinstance(v, list) or len(v) != E)
                                                    for v in (freq, last)):
            return f"policy statistics of layer {layer} are malformed"
        pins = state.get("pinned", [])
        if not isinstance(pins, list) or not all(isinstance(e, int) and 0 <= e < E for e in pins):
            return f"pinned set of layer {layer} is malformed"
    return None


def load_snapshot(bank: ExpertBank, directory: str | Path, key: Key, verify: bool = True) -> tuple[bool, str]:
    """Fill `bank` from the snapshot in `directory` when it matches `key`; return (ok, reason).

    Call it between requests (at start-up, or with nothing in flight). Every check runs before
    the bank is touched, so on (False, reason) the bank is as it was and the caller builds it as
    usual (only an I/O error during the final copy, from a file changed after it was checked, can
    leave some layers new and others old, each one whole and consistent). Never raises for a
    missing, stale or damaged snapshot.
    Slot tensors and the slot map are copied into the bank's existing tensors (their addresses,
    which CUDA graphs may have captured, do not change); owner and where are updated in place.
    Pins the bank already holds (given for this run) replace the snapshot's: any of those
    experts not in the snapshot are loaded from the store afterwards.
    """
    directory = Path(directory)
    meta, reason = _read_meta(directory)
    if meta is None:
        return False, reason
    stored, now = meta["key"], json.loads(json.dumps(key))
    diff = _difference({"format": stored.get("format", _MISSING)}, {"format": now.get("format")}, "") \
        or _difference(stored, now, "")
    if diff:
        return False, f"snapshot key mismatch: {diff}"
    path = directory / meta["file"]
    try:
        size = path.stat().st_size
    except OSError as exc:
        return False, f"tensor file {path.name} is missing ({exc.strerror})"
    if size != meta["size"]:
        return False, f"tensor file {path.name} has {size} bytes, bank.json says {meta['size']} (truncated or replaced)"
    if verify:
        try:
            sha = _sha256_file(path)
        except OSError as exc:
            return False, f"tensor file {path.name} cannot be read ({exc})"
        if sha != meta["sha256"]:
            return False, f"tensor file {path.name} fails its SHA-256 check (corrupt)"
    bad = _check_policy(meta, bank)
    if bad:
        return False, bad
    S, E = bank.capacity, bank.num_experts
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = set(f.keys())
            owners: dict[int, np.ndarray] = {}
            for layer, lb in bank.layers.items():
                for part, want in lb.tensors.items():
                    name = f"layer.{layer}.{part}"
                    if name not in names:
                        return False, f"tensor {name} is missing from {path.name}"
                    sl = f.get_slice(name)
                    if list(sl.get_shape()) != list(want.shape) or sl.get_dtype() != ST_NAMES[want.dtype]:
                        return False, (f"tensor {name} is {sl.get_dtype()} {sl.get_shape()}, "
                                       f"the bank wants {ST_NAMES[want.dtype]} {list(want.shape)}")
                name = f"layer.{layer}.slot_owner"
                if name not in names:
                    return False, f"tensor {name} is missing from {path.name}"
                owners[layer] = f.get_tensor(name).numpy().astype(np.int64)
                bad = _check_layer(owners[layer], E, S)
                if bad:
                    return False, f"layer {layer}: {bad}"
                pins = set(meta["policy"]["layers"][str(layer)].get("pinned", []))
                if not pins <= set(owners[layer].tolist()):
                    return False, f"layer {layer}: a pinned expert is not in the snapshot's slots"
            # Commit, layer by layer: both tensors are read before the layer changes, so an I/O
            # error here (the file changed since it was checked) leaves every layer whole, old or new.
            bank.synchronize()   # no earlier copy-stream copy may land over ours
            for layer, lb in bank.layers.items():
                saved = {part: f.get_tensor(f"layer.{layer}.{part}") for part in lb.tensors}
                bank.slots.restore(layer, owners[layer].tolist(), saved)
                del saved
    except (OSError, RuntimeError, ValueError, SafetensorError) as exc:   # a damaged header or short data
        return False, f"tensor file {path.name} is unreadable ({type(exc).__name__}: {exc})"
    explicit = {layer: sorted(p) for layer, p in bank.policy.pinned.items() if p}
    bank.policy.load_state(meta["policy"], sorted(bank.layers))
    if explicit:   # pins given for this run replace the snapshot's; pin() loads any not resident
        bank.policy.pinned.clear()
        for layer, experts in explicit.items():
            bank.pin(layer, experts)
    bank.synchronize()
    return True, f"loaded {path.name} ({size / 2**20:.1f} MiB)"
