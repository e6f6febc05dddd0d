#include "xmoe/core/error.h"

namespace xmoe {

void throw_error(const char* /*file*/, int /*line*/, const std::string& message) {
  throw Error(message);
}

}  // namespace xmoe
