"""benchmarks/family_decode.py end to end on the CPU with a shrunk MLA shape: every row the GPU run
will print is there (resident, both MLA forms at both prompt lengths, the bounded bank below E, the HF
peer), what cannot run on a CPU says so, and the checkpoint is gone afterwards (the device's disk
holds one shape at a time)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("family_decode", ROOT / "benchmarks" / "family_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_family_decode_smoke_on_cpu(tmp_path: Path) -> None:
    bench = _load_benchmark()
    out, root = tmp_path / "out", tmp_path / "ckpt"
    assert bench.main(["--out", str(out), "--root", str(root), "--shape", "glm-4.7-flash:2", "--device", "cpu",
                       "--tiny", "--prompt-tokens", "12", "--gen-tokens", "4", "--long-prompt-tokens", "20"]) == 0
    result = json.loads((out / "family_decode.json").read_text())
    (shape,) = result["shapes"]
    assert shape["shape"] == "glm-4.7-flash" and "error" not in shape and shape["checkpoint_bytes"] > 0
    rows = [(r["row"], r["prompt_tokens"]) for r in shape["rows"]]
    assert rows == [("resident, MLA expanded", 12), ("resident, MLA expanded", 20), ("resident, MLA absorbed", 12),
                    ("resident, MLA absorbed", 20), ("25% bank", 12)]
    assert all(r["routing"].startswith("uniform") and r["decode_tok_s"] > 0 for r in shape["rows"])
    bounded = shape["rows"][-1]
    assert bounded["capacity"] == shape["bounded"]["capacity"] < bounded["num_experts"]
    assert shape["hf_resident"]["model_type"] == "glm4_moe_lite" and shape["hf_resident"]["decode_tok_s"] > 0
    assert shape["skipped"] == ["HF offload: needs CUDA"]
    assert not (root / "glm-4.7-flash").exists() and not (root / "hf").exists()
    assert "moestream resident, MLA absorbed" in bench.table(shape)
