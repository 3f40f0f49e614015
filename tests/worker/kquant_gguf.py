"""A copy of a GGUF file with some of its matrices re-quantized to K-quants (``kquant_pack``) or to the
types ``gguf`` itself quantizes (q4_0, q8_0, ...): every metadata field and every other tensor as the
source holds them."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

from tests.worker.kquant_pack import GGML_NAMES, quantize


def write_kquant_copy(source: str, target: str, choose: Callable[[str], str | None]) -> dict[str, str]:
    """``choose(tensor name)``: a format to re-quantize that matrix to, or None to copy it.
    Returns the re-quantized tensors' formats by name."""
    reader = gguf.GGUFReader(source)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    chosen, tensors = {}, []
    for tensor in reader.tensors:
        fmt = choose(tensor.name) if len(tensor.shape) == 2 else None
        if fmt is None:
            data, kind = tensor.data, tensor.tensor_type
        else:
            dense = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            if fmt in GGML_NAMES:
                data, kind = quantize(dense, fmt), gguf.GGMLQuantizationType[GGML_NAMES[fmt]]
            else:
                kind = gguf.GGMLQuantizationType[fmt.upper()]
                data = gguf.quants.quantize(dense, kind)
            chosen[tensor.name] = fmt
        tensors.append((tensor.name, np.ascontiguousarray(data), kind))
        writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return chosen
