// Linked when xmoe is built without MPI.
#include "xmoe/comm/mpi/mpi_group.h"

namespace xmoe::comm::mpi {

std::shared_ptr<Group> make_world(int) {
  XMOE_FAIL(
      "[comm] this process was started by an MPI launcher, but xmoe was built without MPI "
      "(XMOE_MPI=OFF); rebuild with libopenmpi-dev installed");
}

void finalize() {}

}  // namespace xmoe::comm::mpi
