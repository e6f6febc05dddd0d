// Collectives under mpirun with rank-encoded payloads: every received slice is checked.
#include <gtest/gtest.h>

#include <chrono>
#include <numeric>

#include "testing.h"
#include "xmoe/comm/group.h"

using namespace xmoe;
using comm::ByteCounters;
using comm::LinkClass;
using xmoe::testing::error_of;

namespace {
std::shared_ptr<comm::Group> world() {
  return comm::world();
}
/// Value that encodes (source rank, destination rank, row, column).
float code(int src, int dst, int64_t row, int64_t col) {
  return static_cast<float>(src * 1000000 + dst * 10000 + row * 10 + col);
}
}  // namespace

TEST(Comm, AllReduceAllGatherReduceScatterBroadcast) {
  auto g = world();
  const int r = g->rank(), n = g->size();
  Tensor t = Tensor::from_vector<float>({float(r), 1.f, float(r * r)}, {3});
  g->all_reduce(t);
  const float sum_r = n * (n - 1) / 2.f;
  EXPECT_EQ(t.to_vector<float>()[0], sum_r);
  EXPECT_EQ(t.to_vector<float>()[1], float(n));
  Tensor m = Tensor::from_vector<int32_t>({r}, {1});
  g->all_reduce(m, comm::ReduceOp::max);
  EXPECT_EQ(m.data<int32_t>()[0], n - 1);

  Tensor mine = Tensor::from_vector<float>({float(r), float(r) + 0.5f}, {1, 2});
  Tensor all = g->all_gather(mine);
  ASSERT_EQ(all.shape(), (Shape{n, 2}));
  for (int p = 0; p < n; ++p) EXPECT_EQ(all.data<float>()[p * 2], float(p));

  Tensor full = Tensor::empty({int64_t(2 * n)});
  for (int i = 0; i < 2 * n; ++i) full.data<float>()[i] = float(i + r);
  Tensor part = g->reduce_scatter(full);
  ASSERT_EQ(part.numel(), 2);
  EXPECT_EQ(part.data<float>()[0], float(n * (2 * r) + sum_r));

  Tensor b = Tensor::from_vector<float>({float(r)}, {1});
  g->broadcast(b, n - 1);
  EXPECT_EQ(b.data<float>()[0], float(n - 1));
}

TEST(Comm, AllToAllVMovesExactlyTheRowsWithEmptyRanks) {
  auto g = world();
  const int r = g->rank(), n = g->size();
  const int64_t d = 3;
  // Rank r sends (r + p) % 3 rows to rank p: some pairs send nothing, and with n >= 3 the
  // pattern leaves some rank receiving zero rows from some peers.
  std::vector<int64_t> send_rows(n);
  for (int p = 0; p < n; ++p) send_rows[p] = (r + p) % 3;
  const auto recv_rows = g->all_to_all_counts(send_rows);
  for (int p = 0; p < n; ++p) EXPECT_EQ(recv_rows[p], (p + r) % 3);
  const int64_t total = std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0});
  Tensor send = Tensor::empty({total, d});
  int64_t row = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < send_rows[p]; ++i, ++row)
      for (int64_t c = 0; c < d; ++c) send.data<float>()[row * d + c] = code(r, p, i, c);
  g->counters().reset();
  Tensor recv = g->all_to_all_v(send, send_rows, recv_rows);
  row = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < recv_rows[p]; ++i, ++row)
      for (int64_t c = 0; c < d; ++c)
        ASSERT_EQ(recv.data<float>()[row * d + c], code(p, r, i, c)) << "from " << p;
  int64_t off_rank = 0;
  for (int p = 0; p < n; ++p)
    if (p != r) off_rank += send_rows[p] * d * 4;
  EXPECT_EQ(g->counters().total(LinkClass::intra_node) + g->counters().total(LinkClass::inter_node),
            off_rank);
  // A rank that sends and receives nothing at all still completes the collective.
  std::vector<int64_t> none(n, 0);
  if (r == 0) {
    Tensor empty = Tensor::empty({0, d});
    Tensor got = g->all_to_all_v(empty, none, std::vector<int64_t>(n, 0));
    EXPECT_EQ(got.size(0), 0);
  } else {
    Tensor empty = Tensor::empty({0, d});
    Tensor got = g->all_to_all_v(empty, none, none);
    EXPECT_EQ(got.size(0), 0);
  }
}

TEST(Comm, AsyncAllToAllOverlapsAndCompletes) {
  auto g = world();
  const int r = g->rank(), n = g->size();
  std::vector<int64_t> rows(n, 2);
  Tensor send = Tensor::empty({2 * n, 1});
  for (int p = 0; p < n; ++p)
    for (int i = 0; i < 2; ++i) send.data<float>()[p * 2 + i] = code(r, p, i, 0);
  Tensor recv;
  auto work = g->all_to_all_v_async(send, rows, rows, recv);
  work->wait();
  for (int p = 0; p < n; ++p) EXPECT_EQ(recv.data<float>()[p * 2 + 1], code(p, r, 1, 0));
}

// The pipelined MoE layer's exchange: row ranges of whole buffers, in place. Rank r sends
// (r + p) % 3 rows to p from a scattered range (the send buffer has a gap row before each
// range) and receives into ranges in reverse rank order with gaps, whose rows stay untouched.
TEST(Comm, AllToAllBetweenRowRangesLeavesOtherRowsAlone) {
  for (const auto& g : {world(), comm::make_single_group()}) {
    SCOPED_TRACE(g->backend_name());
    const int r = g->rank(), n = g->size();
    constexpr int64_t d = 3;
    std::vector<int64_t> send_rows(n), recv_rows(n), send_off(n), recv_off(n);
    int64_t at = 0;
    for (int p = 0; p < n; ++p) {
      send_rows[p] = (r + p) % 3;
      recv_rows[p] = (p + r) % 3;
      send_off[p] = ++at;  // one gap row first
      at += send_rows[p];
    }
    Tensor send = Tensor::full({at, d}, -1.f);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < send_rows[p]; ++i)
        for (int64_t c = 0; c < d; ++c)
          send.data<float>()[(send_off[p] + i) * d + c] = code(r, p, i, c);
    at = 0;
    for (int p = n - 1; p >= 0; --p) {  // ranges in reverse rank order, a gap after each
      recv_off[p] = at;
      at += recv_rows[p] + 1;
    }
    Tensor recv = Tensor::full({at, d}, 7.f);
    g->all_to_all_v_rows_async(send, send_rows, send_off, recv, recv_rows, recv_off)->wait();
    std::vector<bool> written(static_cast<size_t>(at), false);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < recv_rows[p]; ++i) {
        written[recv_off[p] + i] = true;
        for (int64_t c = 0; c < d; ++c)
          ASSERT_EQ(recv.data<float>()[(recv_off[p] + i) * d + c], code(p, r, i, c)) << p;
      }
    for (int64_t row = 0; row < at; ++row)
      if (!written[row]) {
        EXPECT_EQ(recv.data<float>()[row * d], 7.f) << "row " << row;
      }
    send_off[0] = at + 5;  // outside the send buffer
    EXPECT_CONTAINS(error_of([&] {
                      g->all_to_all_v_rows_async(send, send_rows, send_off, recv, recv_rows,
                                                 recv_off);
                    }),
                    "[all_to_all_v] rank 0: send rows");
  }
}

TEST(Comm, SplitAndDeclaredTopology) {
  auto g = world();
  const int r = g->rank(), n = g->size();
  auto half = g->split(r % 2, r);
  EXPECT_EQ(half->size(), (n + 1 - r % 2) / 2);
  Tensor t = Tensor::from_vector<float>({1.f}, {1});
  half->all_reduce(t);
  EXPECT_EQ(t.data<float>()[0], float(half->size()));
  if (n % 2 == 0) {
    const auto topo = comm::Topology::uniform(n, 2);
    EXPECT_EQ(topo.num_nodes(), n / 2);
    EXPECT_EQ(topo.node_of(r), r / 2);
    EXPECT_EQ(topo.local_rank(r), r % 2);
    EXPECT_EQ(topo.link(0, 1), LinkClass::intra_node);
    if (n > 2) {
      EXPECT_EQ(topo.link(0, 2), LinkClass::inter_node);
    }
  }
  EXPECT_THROW(comm::Topology::uniform(n, n + 1), Error);
}

// The checks live in comm::Group, ahead of every backend's transport: the MPI and the
// single-process group refuse the same arguments in the same words, before any communication
// (every rank fails alike, nobody waits) and without counting anything.
TEST(Comm, EveryBackendRefusesBadArgumentsAlike) {
  for (const auto& g : {world(), comm::make_single_group()}) {
    SCOPED_TRACE(g->backend_name());
    const int n = g->size();
    g->counters().reset();
    Tensor d = Tensor::zeros({3, 2});
    std::vector<int64_t> wrong(n + 1, 0), rows(n, 0), negative(n, 0);
    rows[0] = 2;
    negative[n - 1] = -1;
    EXPECT_CONTAINS(
        error_of([&] { g->all_to_all_v(d, wrong, wrong); }),
        fmt::format("[all_to_all_v] need {} send and recv counts, got {} and {}", n, n + 1, n + 1));
    EXPECT_CONTAINS(error_of([&] { g->all_to_all_v(d, rows, rows); }),
                    "[all_to_all_v] send counts sum to 2 but send has 3 rows");
    EXPECT_CONTAINS(error_of([&] { g->all_to_all_v(d, rows, negative); }),
                    fmt::format("[all_to_all_v] negative count for rank {}: send", n - 1));
    EXPECT_CONTAINS(error_of([&] { g->all_gather(Tensor::zeros({})); }),
                    "[all_gather] needs at least 1-d tensors");
    EXPECT_CONTAINS(error_of([&] { g->broadcast(d, n); }),
                    fmt::format("[broadcast] root {} outside a group of {}", n, n));
    EXPECT_CONTAINS(error_of([&] { g->split(-1, 0); }), "[split] color -1 must be >= 0");
    if (n > 1) {
      EXPECT_CONTAINS(error_of([&] { g->reduce_scatter(Tensor::zeros({int64_t(n) + 1})); }),
                      "[reduce_scatter] dim 0 of");
      EXPECT_CONTAINS(
          error_of([&] { g->all_to_all_counts(wrong); }),
          fmt::format("[all_to_all_counts] {} values do not split over {} ranks", n + 1, n));
    }
    for (int k = 0; k < ByteCounters::num_kinds; ++k) {
      EXPECT_EQ(g->counters().calls[k], 0) << "kind " << k;
      EXPECT_EQ(g->counters().bytes[k][0] + g->counters().bytes[k][1], 0) << "kind " << k;
    }
    // Still usable, and a collective that runs is counted once.
    Tensor t = Tensor::from_vector<float>({1.f}, {1});
    g->all_reduce(t);
    EXPECT_EQ(t.data<float>()[0], float(n));
    EXPECT_EQ(g->counters().calls[ByteCounters::all_reduce], 1);
  }
}

// parallel.collective_timeout_s: a watched all-reduce gives the same result, and what the
// watchdog adds to a small all-reduce between MPI ranks (the collective the trainer runs most
// often) is printed as a JSON line. Under mpirun --oversubscribe on a shared machine the
// timings are scheduling noise (busy-waiting ranks share cores); test_watchdog bounds the
// watchdog's own cost per call.
TEST(Comm, WatchedAllReduceIsCorrectAndTimed) {
  auto g = world()->split(0, world()->rank());
  const int n = 2000, r = g->rank(), size = g->size();
  int wrong = 0;
  auto time_all_reduce = [&] {
    g->barrier();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      Tensor t = Tensor::from_vector<float>({float(r + i)}, {1});
      g->all_reduce(t);
      wrong += t.data<float>()[0] != float(size * i + size * (size - 1) / 2);
    }
    Tensor s = Tensor::from_vector<double>(
        {std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}, {1});
    g->all_reduce(s, comm::ReduceOp::max);
    return s.data<double>()[0] / n * 1e6;
  };
  double plain_us = 1e30, watched_us = 1e30;
  for (int round = 0; round < 3; ++round) {  // the best of three of each, interleaved
    g->set_watchdog(nullptr);
    plain_us = std::min(plain_us, time_all_reduce());
    g->set_watchdog(std::make_shared<comm::Watchdog>(600));
    watched_us = std::min(watched_us, time_all_reduce());
    EXPECT_EQ(g->watchdog()->in_flight(), 0u);
  }
  g->set_watchdog(nullptr);
  EXPECT_EQ(wrong, 0);
  if (r == 0)
    std::printf(
        "{\"bench\": \"watchdog_overhead\", \"group\": \"mpi\", \"ranks\": %d, "
        "\"all_reduce_us\": %.2f, \"watched_all_reduce_us\": %.2f}\n",
        size, plain_us, watched_us);
}
