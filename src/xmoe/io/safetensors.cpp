#include "xmoe/io/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "xmoe/io/file.h"

namespace xmoe::io {

namespace {

using nlohmann::json;

// The reference implementation refuses headers over 100 MB; so do we (a corrupt length field
// would otherwise make us allocate gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

}  // namespace

std::string_view safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
    case DType::f64:
      return "F64";
  }
  return "?";
}

std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  for (DType t : {DType::f32, DType::bf16, DType::i32, DType::i64, DType::u8, DType::f64})
    if (safetensors_dtype(t) == name) return t;
  return std::nullopt;
}

void save_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    XMOE_CHECK(t.defined(), "[safetensors] {}: tensor '{}' is undefined", path, name);
    XMOE_CHECK(name != "__metadata__", "[safetensors] {}: '__metadata__' is not a tensor name",
               path);
    header[name] = {{"dtype", safetensors_dtype(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));

  // OutputFile checks every write and removes the file if any step (a device copy included)
  // throws, so a failed save leaves no truncated file that looks like a tensor file.
  OutputFile f(path);
  f.write(len, 8);
  f.write(text);
  for (const auto& [name, t] : tensors) {
    if (t.nbytes() == 0) continue;  // raw() of an empty tensor may be null
    const Tensor host = t.is_cpu() ? t : t.to(Device::cpu());
    f.write(host.raw(), host.nbytes());
  }
  f.close();
}

SafetensorsFile load_safetensors(const std::string& path) {
  std::error_code ec;
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  XMOE_CHECK(!ec, "[safetensors] {}: {}", path, ec.message());
  XMOE_CHECK(file_size >= 8, "[safetensors] {}: {} bytes is too short for a header (truncated?)",
             path, file_size);
  std::ifstream in(path, std::ios::binary);
  XMOE_CHECK(in, "[safetensors] {}: cannot open for reading", path);
  unsigned char len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  XMOE_CHECK(n <= file_size - 8,
             "[safetensors] {}: header length {} runs past the end of the {}-byte file "
             "(truncated or not a safetensors file)",
             path, n, file_size);
  XMOE_CHECK(n <= kMaxHeaderBytes, "[safetensors] {}: header length {} exceeds the {} limit", path,
             n, kMaxHeaderBytes);
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  XMOE_CHECK(in, "[safetensors] {}: cannot read the header", path);

  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    XMOE_FAIL("[safetensors] {}: header is not valid JSON ({})", path, e.what());
  }
  XMOE_CHECK(header.is_object(), "[safetensors] {}: header is not a JSON object", path);

  SafetensorsFile out;
  const uint64_t data_begin = 8 + n, data_size = file_size - data_begin;
  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      XMOE_CHECK(v.is_object(), "[safetensors] {}: __metadata__ is not an object", path);
      for (const auto& [k, s] : v.items()) {
        XMOE_CHECK(s.is_string(), "[safetensors] {}: __metadata__['{}'] is not a string", path, k);
        out.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    XMOE_CHECK(
        v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
        "[safetensors] {}: tensor '{}' needs dtype, shape and data_offsets", path, name);
    XMOE_CHECK(v["dtype"].is_string(), "[safetensors] {}: tensor '{}': dtype is not a string", path,
               name);
    const std::string dname = v["dtype"].get<std::string>();
    const auto dtype = parse_safetensors_dtype(dname);
    XMOE_CHECK(dtype.has_value(),
               "[safetensors] {}: tensor '{}' has unsupported dtype '{}' (xmoe reads F32, BF16, "
               "I32, I64, U8)",
               path, name, dname);
    Entry e{name, *dtype, {}, 0, 0};
    const json& shape = v["shape"];
    XMOE_CHECK(shape.is_array(), "[safetensors] {}: tensor '{}': shape is not a list", path, name);
    uint64_t numel = 1;
    for (const json& d : shape) {
      XMOE_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
                 "[safetensors] {}: tensor '{}': bad dimension {} in shape {}", path, name,
                 d.dump(), shape.dump());
      const uint64_t dim = d.get<uint64_t>();
      XMOE_CHECK(dim == 0 || numel <= (1ull << 62) / dim,
                 "[safetensors] {}: tensor '{}': shape {} is too large", path, name, shape.dump());
      numel *= dim;
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    const json& off = v["data_offsets"];
    XMOE_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() &&
                   off[1].is_number_unsigned(),
               "[safetensors] {}: tensor '{}': data_offsets {} is not [begin, end]", path, name,
               off.dump());
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    XMOE_CHECK(e.begin <= e.end && e.end <= data_size,
               "[safetensors] {}: tensor '{}': data_offsets [{}, {}] outside the {}-byte data "
               "section (truncated file?)",
               path, name, e.begin, e.end, data_size);
    XMOE_CHECK(numel * dtype_size(e.dtype) == e.end - e.begin,
               "[safetensors] {}: tensor '{}': shape {} of {} needs {} bytes but data_offsets span "
               "{}",
               path, name, shape.dump(), dname, numel * dtype_size(e.dtype), e.end - e.begin);
    entries.push_back(std::move(e));
  }

  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    XMOE_CHECK(e.begin >= covered, "[safetensors] {}: tensor '{}' [{}, {}] overlaps tensor '{}'",
               path, e.name, e.begin, e.end, entries[i - 1].name);
    XMOE_CHECK(e.begin == covered,
               "[safetensors] {}: bytes [{}, {}) before tensor '{}' belong to no tensor", path,
               covered, e.begin, e.name);
    covered = e.end;
  }
  XMOE_CHECK(covered == data_size,
             "[safetensors] {}: {} trailing bytes after the last tensor (data section is {} "
             "bytes, tensors cover {})",
             path, data_size - covered, data_size, covered);

  for (const Entry& e : entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    if (e.end == e.begin) {
      out.tensors.emplace(e.name, std::move(t));
      continue;
    }
    in.seekg(static_cast<std::streamoff>(data_begin + e.begin));
    in.read(static_cast<char*>(t.raw()), static_cast<std::streamsize>(e.end - e.begin));
    XMOE_CHECK(in, "[safetensors] {}: cannot read tensor '{}'", path, e.name);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

}  // namespace xmoe::io
