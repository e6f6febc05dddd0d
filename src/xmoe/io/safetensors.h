#pragma once
// safetensors (https://github.com/huggingface/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}, then the tensor bytes. Offsets are relative to the end of
// the header; the data section is covered exactly, without holes or overlaps.
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "xmoe/core/tensor.h"

namespace xmoe::io {

using TensorMap = std::map<std::string, Tensor>;
using Metadata = std::map<std::string, std::string>;

/// Writes `tensors` (any device; copied to the host) with optional string metadata. Tensors are
/// laid out in name order; the header is padded with spaces to a multiple of 8 bytes.
/// Writes `path` directly and fsyncs it: callers that need atomicity write into a temporary
/// folder. A failed write throws "[io] <path>: write failed (<strerror>)" and removes the file.
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const Metadata& metadata = {});

struct SafetensorsFile {
  TensorMap tensors;  ///< CPU tensors
  Metadata metadata;
};

/// Reads and validates a whole file. Every problem (header length beyond the file, bad JSON,
/// unknown dtype, offsets out of range / overlapping / leaving holes, shape x dtype size not
/// equal to the byte span) throws an Error naming the file and the tensor.
SafetensorsFile load_safetensors(const std::string& path);

/// "F32", "BF16", "I32", "I64", "U8".
std::string_view safetensors_dtype(DType dtype);
/// Inverse of safetensors_dtype; nullopt for dtypes xmoe does not support (F16, F64, BOOL, ...).
std::optional<DType> parse_safetensors_dtype(std::string_view name);

}  // namespace xmoe::io
