// Linked when xmoe is built without NCCL.
#include "xmoe/comm/nccl/nccl_group.h"

namespace xmoe::comm::nccl {

namespace {
[[noreturn]] void missing(const char* what) {
  XMOE_FAIL(
      "[nccl] {}: this xmoe was built without NCCL (XMOE_NCCL=OFF; it needs XMOE_CUDA, XMOE_MPI "
      "and nccl.h / libnccl, see NCCL_ROOT)",
      what);
}
}  // namespace

bool available() {
  return false;
}
std::shared_ptr<Group> make_group(std::shared_ptr<Group>, int) {
  missing("make_group");
}
HostRanks host_ranks(Group&) {
  missing("host_ranks");
}
void abandon(Group&) {}  // without NCCL there is no NCCL group to abandon
std::shared_ptr<Group> make_world(int) {
  missing("make_world");
}

}  // namespace xmoe::comm::nccl
