// core/env: the table of XMOE_* knobs against docs/training.md ("Environment variables") and
// against the sources that read them, and the accessors' refusals (unknown names, a knob read
// as another kind, bad values), with the variables set and unset in this process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>

#include "testing.h"
#include "xmoe/core/env.h"

using namespace xmoe;
using xmoe::testing::error_of;
namespace fs = std::filesystem;

namespace {

std::string read(const fs::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct DocRow {
  std::string default_value, read_in;
};

/// The rows of docs/training.md's "Environment variables" table, by variable.
std::map<std::string, DocRow> documented() {
  const std::string md = read(fs::path(XMOE_SOURCE_DIR) / "docs" / "training.md");
  const size_t start = md.find("\n## Environment variables\n");
  EXPECT_NE(start, std::string::npos) << "docs/training.md has no \"Environment variables\"";
  const size_t end = md.find("\n## ", start + 1);
  std::istringstream section(md.substr(start, end - start));
  // | `XMOE_NAME` | default | `read/in.cpp` | effect |
  const std::regex row(R"(^\| `(XMOE_[A-Z0-9_]+)` \| ([^|]*) \| `([^`]+)` \|)");
  std::map<std::string, DocRow> rows;
  std::smatch m;
  for (std::string line; std::getline(section, line);)
    if (std::regex_search(line, m, row)) {
      EXPECT_EQ(rows.count(m[1]), 0u) << m[1] << " is documented twice";
      rows[m[1]] = {m[2], m[3]};
    }
  return rows;
}

/// How the docs write a knob's default.
std::string doc_default(const env::Knob& k) {
  const std::string d = k.default_value;
  if (k.kind == env::Kind::flag) return d == "1" ? "on" : "off";
  if (!d.empty()) return "`" + d + "`";
  return k.kind == env::Kind::integer ? "automatic" : "unset";
}

/// Sets (or, with nullptr, unsets) a variable for one scope, then puts the old value back.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

TEST(Env, EveryKnobIsDocumentedAndEveryDocumentedVariableIsAKnob) {
  const auto rows = documented();
  ASSERT_FALSE(rows.empty());
  for (const env::Knob& k : env::knobs()) {
    SCOPED_TRACE(k.name);
    EXPECT_FALSE(std::string(k.doc).empty());
    EXPECT_FALSE(k.values.empty());
    const auto it = rows.find(k.name);
    if (it == rows.end()) {
      ADD_FAILURE() << k.name << " is in core/env.cpp but not in docs/training.md";
      continue;
    }
    EXPECT_EQ(it->second.default_value, doc_default(k));
    // The file the docs name reads it, through the accessor of its kind.
    const auto file = fs::path(XMOE_SOURCE_DIR) / "src" / "xmoe" / it->second.read_in;
    const std::string source = read(file);
    EXPECT_CONTAINS(source, fmt::format("env::{}(\"{}\")", env::kind_name(k.kind), k.name));
  }
  for (const auto& [name, row] : rows)
    EXPECT_NO_THROW(env::knob(name)) << name << " is documented but not in core/env.cpp";
}

TEST(Env, DefaultsAreAllowedValues) {
  for (const env::Knob& k : env::knobs()) {
    SCOPED_TRACE(k.name);
    ScopedEnv unset(k.name, nullptr);
    switch (k.kind) {
      case env::Kind::flag:
        EXPECT_EQ(env::flag(k.name), std::string(k.default_value) == "1");
        break;
      case env::Kind::choice:
        EXPECT_EQ(env::choice(k.name), k.default_value);
        break;
      case env::Kind::integer:
        EXPECT_EQ(env::integer(k.name), std::nullopt);
        break;
      case env::Kind::text:
        EXPECT_EQ(env::text(k.name), nullptr);
        break;
    }
  }
}

// Every getenv of an XMOE_* variable goes through the table: the sources name no such variable
// to getenv, and every env::<kind>("XMOE_...") names a knob of that kind. This checks the CUDA
// sources too, which a CPU build does not compile.
TEST(Env, SourcesReadKnobsOnlyThroughTheTable) {
  const std::regex direct(R"re(getenv\(\s*"XMOE_)re");
  const std::regex through(R"re(env::(flag|choice|integer|text)\(\s*"(XMOE_[A-Z0-9_]+)"\))re");
  int reads = 0;
  for (const auto& e : fs::recursive_directory_iterator(fs::path(XMOE_SOURCE_DIR) / "src")) {
    const std::string ext = e.path().extension().string();
    if (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh") continue;
    const std::string text = read(e.path());
    EXPECT_FALSE(std::regex_search(text, direct)) << e.path() << " reads an XMOE_ variable itself";
    for (std::sregex_iterator m(text.begin(), text.end(), through), end; m != end; ++m, ++reads) {
      const std::string kind = (*m)[1], name = (*m)[2];
      const auto& knobs = env::knobs();
      const auto k = std::find_if(knobs.begin(), knobs.end(),
                                  [&](const env::Knob& x) { return name == x.name; });
      if (k == knobs.end()) {
        ADD_FAILURE() << e.path() << " reads " << name << ", which core/env.cpp does not declare";
        continue;
      }
      EXPECT_EQ(env::kind_name(k->kind), kind) << e.path() << " reads " << name;
    }
  }
  EXPECT_GE(reads, static_cast<int>(env::knobs().size()));
}

TEST(Env, AnUnknownNameOrAnotherKindIsAProgrammingError) {
  EXPECT_CONTAINS(error_of([] { env::flag("XMOE_NOT_A_KNOB"); }),
                  "[env] XMOE_NOT_A_KNOB is not in the table of environment variables");
  EXPECT_CONTAINS(error_of([] { env::knob("XMOE_PROFILES"); }), "XMOE_PROFILES");
  EXPECT_CONTAINS(error_of([] { env::flag("XMOE_ATTENTION"); }),
                  "[env] XMOE_ATTENTION is a choice knob, read with env::choice, not env::flag");
  EXPECT_CONTAINS(error_of([] { env::integer("XMOE_PROFILE"); }), "is a flag knob");
}

TEST(Env, ValuesAreReadAndBadOnesRefusedByName) {
  {
    ScopedEnv on("XMOE_CUDA_CHECK_INDICES", "1");
    EXPECT_TRUE(env::flag("XMOE_CUDA_CHECK_INDICES"));
  }
  {
    ScopedEnv off("XMOE_ATTENTION_DETERMINISTIC", "0");
    EXPECT_FALSE(env::flag("XMOE_ATTENTION_DETERMINISTIC"));
  }
  {
    ScopedEnv empty("XMOE_ATTENTION_DETERMINISTIC", "");  // empty: the default (on)
    EXPECT_TRUE(env::flag("XMOE_ATTENTION_DETERMINISTIC"));
  }
  for (const char* bad : {"yes", "2", "true", " 1"}) {
    ScopedEnv v("XMOE_PROFILE", bad);
    EXPECT_CONTAINS(error_of([] { env::flag("XMOE_PROFILE"); }),
                    fmt::format("[env] XMOE_PROFILE = '{}': expected 0 or 1", bad));
  }

  {
    ScopedEnv v("XMOE_GROUPED_GEMM", "cublas");
    EXPECT_EQ(env::choice("XMOE_GROUPED_GEMM"), "cublas");
  }
  {
    ScopedEnv v("XMOE_GROUPED_GEMM", "fast");
    EXPECT_CONTAINS(error_of([] { env::choice("XMOE_GROUPED_GEMM"); }),
                    "[env] XMOE_GROUPED_GEMM = 'fast': expected cutlass or cublas");
  }
  {
    ScopedEnv v("XMOE_SM90_SWIZZLE", "3");
    EXPECT_CONTAINS(error_of([] { env::choice("XMOE_SM90_SWIZZLE"); }),
                    "[env] XMOE_SM90_SWIZZLE = '3': expected 1, 2, 4 or 8");
  }

  {
    ScopedEnv v("XMOE_WEIGHT_GRAD_PIECE_ROWS", "0");
    EXPECT_EQ(env::integer("XMOE_WEIGHT_GRAD_PIECE_ROWS"), 0);
  }
  {
    ScopedEnv v("XMOE_WEIGHT_GRAD_PIECE_ROWS", "4096");
    EXPECT_EQ(env::integer("XMOE_WEIGHT_GRAD_PIECE_ROWS"), 4096);
  }
  for (const char* bad : {"-1", "12k", "lots", "99999999999999999999", "+5"}) {
    ScopedEnv v("XMOE_WEIGHT_GRAD_PIECE_ROWS", bad);
    EXPECT_CONTAINS(error_of([] { env::integer("XMOE_WEIGHT_GRAD_PIECE_ROWS"); }),
                    fmt::format("[env] XMOE_WEIGHT_GRAD_PIECE_ROWS = '{}': expected an integer "
                                ">= 0",
                                bad));
  }

  {
    ScopedEnv v("XMOE_INJECT_FAULT", "1:6");
    EXPECT_STREQ(env::text("XMOE_INJECT_FAULT"), "1:6");
  }
  for (const char* bad : {"1", "1:", ":6", "a:b", "1:6:2", "-1:6"}) {
    ScopedEnv v("XMOE_INJECT_FAULT", bad);
    EXPECT_CONTAINS(error_of([] { env::text("XMOE_INJECT_FAULT"); }),
                    fmt::format("[env] XMOE_INJECT_FAULT = '{}': expected R:S", bad));
  }
}
