"""The corpus: Python sources of this interpreter's stdlib and site-packages, filtered, de-duplicated and split train / held-out by a seeded hash of each path."""

from __future__ import annotations

import hashlib
import os
import platform
import site
import sysconfig
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any



from demo_training.settings import CorpusSettings, EOS_TOKEN

@dataclass(frozen=True)
class Document:
    relpath: str
    text: str
    sha256: str


@dataclass
class Corpus:
    train: list[Document]
    heldout: list[Document]
    stats: dict[str, Any]


def stable_hash(seed: int, purpose: str, key: str) -> int:
    """Seeded 64-bit hash: the same file lands in the same split / order on every machine."""
    digest = hashlib.sha256(f"{seed}|{purpose}|{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def discover_roots() -> list[tuple[str, Path]]:
    """The standard library plus every site-packages directory this interpreter uses."""
    paths = sysconfig.get_paths()
    site_dirs = {Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()}
    if hasattr(site, "getsitepackages"):
        site_dirs.update(Path(p).resolve() for p in site.getsitepackages())
    roots = [("stdlib", Path(paths["stdlib"]).resolve())]
    roots += [("site", p) for p in sorted(site_dirs) if p.is_dir()]
    return roots


def list_candidates(roots: Sequence[tuple[str, Path]], settings: CorpusSettings) -> list[tuple[str, Path, int]]:
    """(relpath, path, size) of every .py file within the size limits, sorted by relpath.

    Test directories are skipped: they are full of fixtures and deliberately odd code,
    which makes them a poor sample of "ordinary" Python.  Nested roots (site-packages
    inside the stdlib directory of a pyenv/venv install) are walked only once.
    """
    root_paths = {path for _, path in roots}
    excluded = set(settings.excluded_dir_names)
    found: dict[str, tuple[str, Path, int]] = {}
    for label, root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = sorted(
                d for d in dirnames if d not in excluded and not d.startswith(".") and (here / d) not in root_paths
            )
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = here / name
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if settings.min_file_bytes <= size <= settings.max_file_bytes:
                    relpath = f"{label}/{path.relative_to(root).as_posix()}"
                    found.setdefault(relpath, (relpath, path, size))
    return [found[k] for k in sorted(found)]


def read_python_text(path: Path, settings: CorpusSettings) -> tuple[str | None, str]:
    """File text, or None with the reason it is unusable as training data."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None, "not utf-8"
    if "\x00" in text:
        return None, "nul byte"
    if EOS_TOKEN in text:
        return None, "contains EOS string"  # would be read as a document boundary
    if max((len(line) for line in text.splitlines()), default=0) > settings.max_line_chars:
        return None, "long line (generated/data file)"
    if not text.strip():
        return None, "empty"
    return text, "ok"


def load_corpus(settings: CorpusSettings, seed: int) -> Corpus:
    """Read files in seeded-hash order until the byte cap; de-duplicate; split by path hash.

    Reading in hash order (instead of reading everything and then sampling) keeps the
    corpus a uniform sample of all packages while touching only as many files as needed.
    """
    roots = discover_roots()
    candidates = list_candidates(roots, settings)
    candidates.sort(key=lambda c: (stable_hash(seed, "order", c[0]), c[0]))
    seen: set[str] = set()
    reasons: Counter[str] = Counter()
    train: list[Document] = []
    heldout: list[Document] = []
    total = 0
    for relpath, path, _size in candidates:
        if total >= settings.max_total_bytes:
            break
        text, reason = read_python_text(path, settings)
        if text is None:
            reasons[reason] += 1
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            reasons["duplicate content"] += 1
            continue
        seen.add(digest)
        doc = Document(relpath, text, digest)
        is_heldout = stable_hash(seed, "split", relpath) % 1000 < settings.heldout_permille
        (heldout if is_heldout else train).append(doc)
        total += len(text.encode())
    fingerprint = hashlib.sha256()
    for doc in train + heldout:
        fingerprint.update(f"{doc.relpath}\0{doc.sha256}\n".encode())
    stats = {
        "roots": [f"{label}: {path}" for label, path in roots],
        "candidate_files": len(candidates),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "train_bytes": sum(len(d.text.encode()) for d in train),
        "heldout_bytes": sum(len(d.text.encode()) for d in heldout),
        "rejected": dict(sorted(reasons.items())),
        "fingerprint_sha256": fingerprint.hexdigest(),
        "python": platform.python_version(),
    }
    return Corpus(train, heldout, stats)


def build_heldout_sample(heldout: Sequence[Document], settings: CorpusSettings) -> tuple[str, list[str]]:
    """Concatenate held-out files (each followed by the EOS string) into the evaluation sample.

    Files keep the corpus' seeded-hash order; files larger than sample_max_file_bytes
    are skipped so the sample covers many packages.  The EOS string is a special token,
    so the sample tokenizes exactly like the training stream (docs separated by EOS).
    """
    parts: list[str] = []
    names: list[str] = []
    total = 0
    for doc in heldout:
        piece = doc.text + EOS_TOKEN
        size = len(piece.encode())
        if size > settings.sample_max_file_bytes or total + size > settings.sample_max_bytes:
            continue
        parts.append(piece)
        names.append(doc.relpath)
        total += size
        if total >= settings.sample_target_bytes:
            break
    return "".join(parts), names


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
