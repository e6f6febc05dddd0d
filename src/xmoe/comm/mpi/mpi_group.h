#pragma once
// MPI backend of comm::Group (CPU buffers). Built when XMOE_MPI is on; otherwise
// comm/mpi_stub/ provides these functions, which say that MPI is missing.
#include <memory>

#include "xmoe/comm/group.h"

namespace xmoe::comm::mpi {

/// MPI_COMM_WORLD as a Group (initialises MPI with thread support on first use).
std::shared_ptr<Group> make_world(int ranks_per_node);
void finalize();

}  // namespace xmoe::comm::mpi
