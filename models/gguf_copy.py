"""Writes GGUF files derived from an existing one: its metadata copied (all of it or a part), its tensors cut."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Optional


def copy_fields(writer, reader, keep: Callable[[str], bool], overrides: Optional[Dict[str, int]] = None) -> None:
    """Copy the reader's metadata keys that `keep` accepts to the writer (uint32 `overrides` replace values)."""
    import gguf

    overrides = overrides or {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or not keep(key):
            continue
        vtype = f.types[0]
        if key in overrides:
            writer.add_uint32(key, overrides[key])
        elif vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[1]
            vals = ([bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data] if sub == gguf.GGUFValueType.STRING
                    else [f.parts[i][0].item() for i in f.data])
            writer.add_array(key, vals)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(key, bytes(f.parts[-1]).decode("utf-8", "replace"))
        else:
            writer.add_key_value(key, f.parts[-1][0].item(), vtype)


def write_first_layers(source: Path, dest: Path, n_layer: int) -> Path:
    """The model at `source` cut to its first `n_layer` blocks (same weights, metadata and tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(dest), arch)
    copy_fields(writer, reader, lambda key: True, {f"{arch}.block_count": n_layer})
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layer:
            continue
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest
