"""Our GGUF header reader gives exactly what `gguf.GGUFReader` gives: every metadata value with its
Python type, every tensor's name, ggml type, dimensions, offset and size, on the GGUFs the test
helpers write (a tokenizer, block types, a split set) and on a file holding every value type; and
damaged headers are refused in one sentence that names the file."""

import struct

import gguf
import numpy as np
import pytest
import transformers
from gguf import GGUFValueType as V
from gguf_checkpoints import make_gguf

from moestream.checkpoint.gguf_file import GGUFCheckpoint
from moestream.checkpoint.gguf_header import read_header
from moestream.errors import CheckpointError


def typed(value):
    """A value with the type of every part, so 1 and 1.0 and True differ."""
    if isinstance(value, list):
        return ["list", [typed(v) for v in value]]
    return [type(value).__name__, value]


def theirs(path):
    reader = gguf.GGUFReader(path)
    metadata = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            try:
                metadata[key] = typed(field.contents())
            except UnicodeDecodeError:
                metadata[key] = typed(None)
    tensors = [(t.name, int(t.tensor_type), tuple(t.shape.tolist()), int(t.data_offset), int(t.n_bytes))
               for t in reader.tensors]
    return metadata, tensors, int(reader.alignment), int(reader.data_offset)


def ours(path):
    header = read_header(path)
    metadata = {key: typed(value) for key, value in header.metadata.items()}
    tensors = [(t.name, t.ggml_type, t.dims, t.data_offset, t.n_bytes) for t in header.tensors]
    return metadata, tensors, header.alignment, header.data_offset


def assert_same(path):
    mine, reference = ours(path), theirs(path)
    assert list(mine[0]) == list(reference[0])   # the same keys in the same order
    for key in reference[0]:
        assert mine[0][key] == reference[0][key], key
    assert mine[1:] == reference[1:]
    assert reference[1]   # tensors were compared


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    config = transformers.Qwen3MoeConfig(vocab_size=160, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, num_hidden_layers=2, num_experts_per_tok=2,
                                         head_dim=64, intermediate_size=256, moe_intermediate_size=256, num_experts=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
    return root


def test_a_tokenizer_and_block_types_read_as_gguf_reads_them(qwen, tmp_path):
    path = tmp_path / "q.gguf"
    make_gguf(qwen, path, experts="Q4_K", down="Q6_K", dense="Q8_0", embeddings="F16", tokenizer=True,
              template="{{ messages }}")
    assert_same(path)
    assert len(read_header(path).metadata["tokenizer.ggml.tokens"]) == 160
    ck = GGUFCheckpoint(path)   # the checkpoint's tensors: shape rows first, absolute offsets
    for t in gguf.GGUFReader(path).tensors:
        mine = ck.tensors[t.name]
        assert (mine.path, mine.offset, mine.nbytes, mine.qtype, mine.shape) == \
            (path, int(t.data_offset), int(t.n_bytes), int(t.tensor_type), tuple(reversed(t.shape.tolist())))


def test_every_part_of_a_split_set_reads_as_gguf_reads_it(qwen, tmp_path):
    make_gguf(qwen, tmp_path / "model.gguf", experts="Q8_0", split=10)
    parts = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert len(parts) > 1
    for part in parts:
        assert_same(part)
    ck = GGUFCheckpoint(parts[0])
    assert sorted(ck.tensors) == sorted(t.name for p in parts for t in gguf.GGUFReader(p).tensors)
    assert {ck.tensors[t.name].path for t in gguf.GGUFReader(parts[-1]).tensors} == {parts[-1]}


def every_value_type(path, alignment=256):
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_custom_alignment(alignment)
    scalars = {V.UINT8: 200, V.INT8: -7, V.UINT16: 60000, V.INT16: -300, V.UINT32: 4_000_000_000, V.INT32: -5,
               V.FLOAT32: 1e-6, V.BOOL: True, V.UINT64: 2**63 + 5, V.INT64: -(2**40), V.FLOAT64: 0.1}
    for vtype, value in scalars.items():
        w.add_key_value(f"s.{vtype.name}", value, vtype)
        w.add_key_value(f"a.{vtype.name}", [value, value, value], V.ARRAY, sub_type=vtype)
    w.add_key_value("s.bool_false", False, V.BOOL)
    w.add_string("s.string", "héllo ✓")
    w.add_string("s.empty", "")
    w.add_array("a.strings", ["", "a b", "é", "<|im_end|>"])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_array("a.nested_strings", [["x"], ["y", "z"]])
    w.add_key_value("s.not_utf8", b"\xff\xfe", V.STRING)
    w.add_key_value("a.not_utf8", [b"ok", b"\xff"], V.ARRAY, sub_type=V.STRING)
    w.add_tensor("token_embd.weight", np.zeros((3, 5), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((2, 4, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.zeros(7, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "all.gguf"
    every_value_type(path)
    assert_same(path)
    meta = read_header(path).metadata
    assert meta["s.not_utf8"] is None and meta["a.not_utf8"] is None   # unreadable values read as absent
    assert meta["a.nested"] == [1, 2, 3] and meta["s.UINT64"] == 2**63 + 5 and meta["s.BOOL"] is True
    assert read_header(path).data_offset % 256 == 0


def refused(path, data, reason):
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=reason) as exc:
        read_header(path)
    message = str(exc.value)
    assert message.startswith(str(path)) and "\n" not in message and message.endswith(".")


def test_a_damaged_header_is_refused_in_one_sentence(tmp_path):
    path = tmp_path / "all.gguf"
    every_value_type(path)
    data = path.read_bytes()
    last = data.index(b"output_norm.weight")   # the last tensor's entry: name, 1 dim, type, offset
    header_end = last + len(b"output_norm.weight") + 4 + 8 + 4 + 8
    bad = tmp_path / "bad.gguf"
    for cut in range(0, header_end, 3):   # a cut anywhere in the header
        refused(bad, data[:cut], r"is not a readable GGUF file \((it is empty|its header runs past the end of "
                                 r"the file)\); re-download it")
    refused(bad, b"GGUF" + bytes(60), r"GGUF version 0; moestream reads versions 2 and 3")
    refused(bad, b"GGML" + data[4:], "does not start with 'GGUF'")
    refused(bad, data[:4] + struct.pack(">I", 3) + data[8:], "big-endian")
    refused(bad, data[:24] + b"\xff" * 8 + data[32:], "runs past the end")   # a key longer than the file
    refused(bad, data.replace(b"a.UINT8", b"s.UINT8"), "key 's.UINT8' appears twice")
    at = data.index(b"general.alignment") + len(b"general.alignment") + 4   # its value, after its type
    refused(bad, data[:at] + struct.pack("<I", 48) + data[at + 4:], "general.alignment is not a u32 power of two")
    unknown = bytearray(data)
    at = last + len(b"output_norm.weight") + 4 + 8   # its ggml type, after its 1 dim
    unknown[at:at + 4] = struct.pack("<I", 99)
    refused(bad, bytes(unknown), "tensor 'output_norm.weight' has unknown ggml type 99")
