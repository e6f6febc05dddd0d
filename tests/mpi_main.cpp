// main() for tests that run under mpirun: every rank runs every test; only rank 0 prints
// GoogleTest's report, and any rank's failure fails the job's exit code.
#include <gtest/gtest.h>

#include "xmoe/comm/group.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto world = xmoe::comm::world();
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS() != 0;
  xmoe::Tensor flag = xmoe::Tensor::from_vector<int32_t>({failed}, {1});
  world->all_reduce(flag, xmoe::comm::ReduceOp::max);
  failed = flag.data<int32_t>()[0];
  if (failed && world->rank() == 0) std::fprintf(stderr, "a test failed on at least one rank\n");
  world.reset();
  xmoe::comm::finalize();
  return failed;
}
