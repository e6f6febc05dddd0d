// The NCCL backend under mpirun, on CUDA tensors: the rank-encoded checks of mpi_test_comm.cpp
// (copy to the device, run, copy back; every received slice checked), the async variants and
// their stream ordering, and equality of every collective and byte counter with the MPI backend
// on the same data. Meaningful at np 1 too: the single-rank communicator still runs NCCL's
// kernels and the event logic between the compute and the communication stream.
//
// Every test skips, with the reason, when xmoe was built without NCCL, when no CUDA device is
// visible, or when a host runs more ranks than it has devices (NCCL takes one device per rank).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>

#include "cuda_testing.h"
#include "xmoe/comm/group.h"
#include "xmoe/comm/nccl/nccl_group.h"
#include "xmoe/core/device_api.h"
#include "xmoe/ops/ops.h"

using namespace xmoe;
using comm::ByteCounters;
using comm::LinkClass;

namespace {

/// Value that encodes (source rank, destination rank, row, column); exact in f32 below 2^24.
float code(int src, int dst, int64_t row, int64_t col) {
  return static_cast<float>(src * 1000000 + dst * 10000 + row * 10 + col);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

void expect_same_counters(const ByteCounters& nccl, const ByteCounters& mpi, bool calls) {
  for (int k = 0; k < ByteCounters::num_kinds; ++k) {
    for (int l = 0; l < 2; ++l) EXPECT_EQ(nccl.bytes[k][l], mpi.bytes[k][l]) << "kind " << k;
    if (calls) {
      EXPECT_EQ(nccl.calls[k], mpi.calls[k]) << "kind " << k;
    }
  }
}

template <typename T>
void expect_bitwise_equal(const Tensor& a, const Tensor& b, const char* what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  const auto va = a.to_vector<T>(), vb = b.to_vector<T>();
  ASSERT_EQ(0, std::memcmp(va.data(), vb.data(), va.size() * sizeof(T))) << what;
}

}  // namespace

class Nccl : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cpu_ = comm::world();
    skip_ = skip_reason();
    if (skip_.empty()) {
      nccl_ = comm::nccl::make_group(cpu_, local_rank_);
      dev_ = nccl_->device();
    }
  }
  // Before main() finalises MPI: communicators go while every rank is still here.
  static void TearDownTestSuite() {
    nccl_.reset();
    cpu_.reset();
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
  }

  /// Empty when NCCL can run here (tests/cuda_testing.h).
  static std::string skip_reason() { return xmoe::testing::nccl_skip_reason(*cpu_, local_rank_); }

  static inline std::shared_ptr<comm::Group> cpu_, nccl_;
  static inline std::string skip_;
  static inline int local_rank_ = 0;
  static inline Device dev_;
};

TEST_F(Nccl, AllReduceAllGatherReduceScatterBroadcast) {
  auto& g = nccl_;
  const int r = g->rank(), n = g->size();
  EXPECT_EQ(g->backend_name(), "nccl");
  EXPECT_TRUE(g->device().is_cuda());
  Tensor t = Tensor::from_vector<float>({float(r), 1.f, float(r * r)}, {3}, dev_);
  g->all_reduce(t);
  const float sum_r = n * (n - 1) / 2.f;
  EXPECT_EQ(t.to_vector<float>()[0], sum_r);
  EXPECT_EQ(t.to_vector<float>()[1], float(n));
  Tensor m = Tensor::from_vector<int32_t>({r}, {1}, dev_);
  g->all_reduce(m, comm::ReduceOp::max);
  EXPECT_EQ(m.to_vector<int32_t>()[0], n - 1);
  Tensor lo = Tensor::from_vector<int64_t>({int64_t{r} + (int64_t{1} << 40)}, {1}, dev_);
  g->all_reduce(lo, comm::ReduceOp::min);
  EXPECT_EQ(lo.to_vector<int64_t>()[0], int64_t{1} << 40);
  // bf16 sums small integers exactly (8 significant bits).
  Tensor h = Tensor::from_vector<bf16>({bf16(float(r)), bf16(2.f)}, {2}, dev_);
  g->all_reduce(h);
  EXPECT_EQ(float(h.to_vector<bf16>()[0]), sum_r);
  EXPECT_EQ(float(h.to_vector<bf16>()[1]), float(2 * n));

  Tensor mine = Tensor::from_vector<float>({float(r), float(r) + 0.5f}, {1, 2}, dev_);
  Tensor all = g->all_gather(mine);
  ASSERT_EQ(all.shape(), (Shape{n, 2}));
  EXPECT_EQ(all.device(), dev_);
  const auto av = all.to_vector<float>();
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(av[p * 2], float(p));
    EXPECT_EQ(av[p * 2 + 1], float(p) + 0.5f);
  }

  std::vector<float> fv(2 * n);
  for (int i = 0; i < 2 * n; ++i) fv[i] = float(i + r);
  Tensor part = g->reduce_scatter(Tensor::from_vector<float>(fv, {int64_t(2 * n)}, dev_));
  ASSERT_EQ(part.numel(), 2);
  EXPECT_EQ(part.to_vector<float>()[0], float(n * (2 * r) + sum_r));
  EXPECT_EQ(part.to_vector<float>()[1], float(n * (2 * r + 1) + sum_r));

  Tensor b = Tensor::from_vector<float>({float(r), 7.f}, {2}, dev_);
  g->broadcast(b, n - 1);
  EXPECT_EQ(b.to_vector<float>()[0], float(n - 1));
  EXPECT_EQ(b.to_vector<float>()[1], 7.f);

  // Empty tensors pass through every collective.
  Tensor e = Tensor::empty({0, 4}, DType::f32, dev_);
  g->all_reduce(e);
  EXPECT_EQ(g->all_gather(e).shape(), (Shape{0, 4}));
  g->broadcast(e, 0);
}

TEST_F(Nccl, AllToAllVMovesExactlyTheRowsWithZeroRowPeers) {
  auto& g = nccl_;
  const int r = g->rank(), n = g->size();
  const int64_t d = 3;
  // Rank r sends (r + p + shift) % 3 rows to rank p: some pairs send nothing, and the shifts
  // cover 0, 1 and 2 rows to oneself (so np 1 sees the empty and the non-empty case).
  for (int shift = 0; shift < 3; ++shift) {
    std::vector<int64_t> send_rows(n);
    for (int p = 0; p < n; ++p) send_rows[p] = (r + p + shift) % 3;
    const auto recv_rows = g->all_to_all_counts(send_rows);
    for (int p = 0; p < n; ++p) ASSERT_EQ(recv_rows[p], (p + r + shift) % 3);
    const int64_t total = std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0});
    std::vector<float> sv(static_cast<size_t>(total * d));
    int64_t row = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < send_rows[p]; ++i, ++row)
        for (int64_t c = 0; c < d; ++c) sv[row * d + c] = code(r, p, i, c);
    Tensor send = Tensor::from_vector<float>(sv, {total, d}, dev_);
    g->counters().reset();
    Tensor recv = g->all_to_all_v(send, send_rows, recv_rows);
    EXPECT_EQ(recv.device(), dev_);
    const int64_t got = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
    ASSERT_EQ(recv.shape(), (Shape{got, d}));
    const auto rv = recv.to_vector<float>();
    row = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < recv_rows[p]; ++i, ++row)
        for (int64_t c = 0; c < d; ++c)
          ASSERT_EQ(rv[row * d + c], code(p, r, i, c)) << "from " << p << " shift " << shift;
    int64_t off_rank = 0;
    for (int p = 0; p < n; ++p)
      if (p != r) off_rank += send_rows[p] * d * 4;
    EXPECT_EQ(
        g->counters().total(LinkClass::intra_node) + g->counters().total(LinkClass::inter_node),
        off_rank);
    EXPECT_EQ(g->counters().calls[ByteCounters::all_to_all], 1);
  }
  // A rank that sends and receives nothing at all still takes part in the group.
  std::vector<int64_t> none(n, 0);
  Tensor empty = Tensor::empty({0, d}, DType::f32, dev_);
  Tensor got = g->all_to_all_v(empty, none, none);
  EXPECT_EQ(got.shape(), (Shape{0, d}));
  // i64 rows of 2 columns, one row to every rank.
  std::vector<int64_t> one(n, 1), iv(2 * n);
  for (int p = 0; p < n; ++p) iv[2 * p] = r, iv[2 * p + 1] = (int64_t{p} << 33) + r;
  Tensor ir = g->all_to_all_v(Tensor::from_vector<int64_t>(iv, {n, 2}, dev_), one, one);
  const auto irv = ir.to_vector<int64_t>();
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(irv[2 * p], p);
    EXPECT_EQ(irv[2 * p + 1], (int64_t{r} << 33) + p);
  }
}

// The event logic: inputs produced by kernels still queued on the compute stream are read only
// after they finish, and kernels queued after wait() see the finished result. With either
// event missing, the repeated scaling below races the collective and the values come out wrong.
TEST_F(Nccl, AsyncCollectivesAreOrderedWithTheComputeStream) {
  auto& g = nccl_;
  const int r = g->rank(), n = g->size();
  const int64_t big = int64_t{1} << 24;  // 64 MiB of f32: each scale_ is a real kernel
  Tensor x = Tensor::full({big}, 1.f, dev_);
  Tensor other = Tensor::full({big}, 3.f, dev_);
  for (int i = 0; i < 20; ++i) ops::scale_(x, 2.f);  // queued, not waited for
  auto work = g->all_reduce_async(x);
  for (int i = 0; i < 10; ++i) ops::scale_(other, 1.f);  // overlaps the all-reduce
  work->wait();
  ops::scale_(x, 0.5f);  // must see the reduced values
  const auto xv = x.to_vector<float>();
  const float expect = std::ldexp(1.f, 19) * float(n);
  int64_t wrong = 0;
  for (float v : xv) wrong += v != expect;
  EXPECT_EQ(wrong, 0) << "first value " << xv[0] << ", expected " << expect;
  EXPECT_EQ(other.to_vector<float>()[big - 1], 3.f);

  // all_to_all_v_async: the send rows come out of queued kernels (×4, ×¼ ten times, then ×2:
  // exact in f32), the received rows go into one (×½) after wait(). At np 1 the in-place
  // all-reduce above moves nothing, but this exchange copies through NCCL (self send/recv).
  const int64_t rows = 8192, d = 128;  // 4 MiB to each rank
  std::vector<int64_t> counts(n, rows);
  std::vector<float> sv(static_cast<size_t>(n * rows * d));
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t c = 0; c < d; ++c) sv[(p * rows + i) * d + c] = code(r, p, i % 100, c % 10) / 2;
  Tensor send = Tensor::from_vector<float>(sv, {n * rows, d}, dev_);
  for (int i = 0; i < 10; ++i) {
    ops::scale_(send, 4.f);
    ops::scale_(send, 0.25f);
  }
  ops::scale_(send, 2.f);
  Tensor recv;
  auto a2a = g->all_to_all_v_async(send, counts, counts, recv);
  send = Tensor();  // the Work keeps it alive until the collective is done
  a2a->wait();
  ops::scale_(recv, 0.5f);
  const auto rv = recv.to_vector<float>();
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < rows; i += 97)
      for (int64_t c = 0; c < d; c += 7)
        ASSERT_EQ(rv[(p * rows + i) * d + c], code(p, r, i % 100, c % 10) / 2)
            << "from " << p << " row " << i;

  // A Work dropped without wait() still orders the compute stream before its buffers are reused.
  for (int i = 0; i < 3; ++i) {
    Tensor y = Tensor::full({1024}, float(r + i), dev_);
    g->all_reduce_async(y);
    EXPECT_EQ(y.to_vector<float>()[1023], float(n * i) + n * (n - 1) / 2.f);
  }
}

TEST_F(Nccl, EveryCollectiveEqualsTheMpiBackend) {
  auto& g = nccl_;
  const int r = g->rank(), n = g->size();
  std::mt19937 rng(1234 + 17 * r);
  std::uniform_int_distribution<int> small(-50, 50);
  auto ints = [&](int64_t count) {
    std::vector<float> v(static_cast<size_t>(count));
    for (auto& x : v) x = float(small(rng));  // integer-valued: sums are exact in any order
    return v;
  };
  const bool same_calls = cpu_->backend_name() == "mpi";
  g->counters().reset();
  cpu_->counters().reset();

  for (auto op : {comm::ReduceOp::sum, comm::ReduceOp::max, comm::ReduceOp::min}) {
    Tensor host = Tensor::from_vector<float>(ints(1000), {10, 100});
    Tensor dev = host.to(dev_);
    cpu_->all_reduce(host, op);
    g->all_reduce(dev, op);
    expect_bitwise_equal<float>(dev, host, "all_reduce f32");
    std::vector<int32_t> iv(257);
    for (auto& x : iv) x = small(rng) * 1000;
    Tensor ih = Tensor::from_vector<int32_t>(iv, {257}), id = ih.to(dev_);
    cpu_->all_reduce(ih, op);
    auto w = g->all_reduce_async(id, op);
    w->wait();
    expect_bitwise_equal<int32_t>(id, ih, "all_reduce_async i32");
  }
  std::vector<int64_t> lv(33);
  for (auto& x : lv) x = int64_t{small(rng)} << 35;
  Tensor lh = Tensor::from_vector<int64_t>(lv, {33}), ld = lh.to(dev_);
  cpu_->all_reduce(lh);
  g->all_reduce(ld);
  expect_bitwise_equal<int64_t>(ld, lh, "all_reduce i64");

  std::vector<bf16> hv(3 * 130);
  for (auto& x : hv) x = bf16(float(small(rng)) * 0.37f);
  Tensor gh = Tensor::from_vector<bf16>(hv, {3, 130});
  expect_bitwise_equal<bf16>(g->all_gather(gh.to(dev_)), cpu_->all_gather(gh), "all_gather bf16");

  Tensor rs = Tensor::from_vector<float>(ints(int64_t(4) * n * 5), {int64_t(4) * n, 5});
  expect_bitwise_equal<float>(g->reduce_scatter(rs.to(dev_)), cpu_->reduce_scatter(rs),
                              "reduce_scatter f32");

  // Random uneven counts with zeros, bf16 rows of 37 (74 bytes: not a multiple of 4).
  std::uniform_int_distribution<int64_t> rows(0, 5);
  std::vector<int64_t> send_rows(n);
  for (auto& c : send_rows) c = rows(rng) == 0 ? 0 : rows(rng);
  const auto recv_cpu = cpu_->all_to_all_counts(send_rows);
  const auto recv_rows = g->all_to_all_counts(send_rows);
  EXPECT_EQ(recv_rows, recv_cpu);
  const int64_t total = std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0});
  std::vector<bf16> av(static_cast<size_t>(total * 37));
  for (auto& x : av) x = bf16(float(small(rng)) / 7.f);
  Tensor a2a = Tensor::from_vector<bf16>(av, {total, 37});
  Tensor recv_dev;
  g->all_to_all_v_async(a2a.to(dev_), send_rows, recv_rows, recv_dev)->wait();
  expect_bitwise_equal<bf16>(recv_dev, cpu_->all_to_all_v(a2a, send_rows, recv_cpu),
                             "all_to_all_v bf16");

  Tensor bh = Tensor::from_vector<float>(ints(77), {7, 11}), bd = bh.to(dev_);
  cpu_->broadcast(bh, n - 1);
  g->broadcast(bd, n - 1);
  expect_bitwise_equal<float>(bd, bh, "broadcast f32");

  expect_same_counters(g->counters(), cpu_->counters(), same_calls);
}

TEST_F(Nccl, SplitBarrierAndTopology) {
  auto& g = nccl_;
  const int r = g->rank(), n = g->size();
  ASSERT_EQ(g->topology().size(), n);
  for (int p = 0; p < n; ++p) EXPECT_EQ(g->topology().node_of(p), cpu_->topology().node_of(p));
  {
    auto half = g->split(r % 2, r);
    EXPECT_EQ(half->backend_name(), "nccl");
    EXPECT_EQ(half->device(), dev_);
    EXPECT_EQ(half->size(), (n + 1 - r % 2) / 2);
    EXPECT_EQ(half->rank(), r / 2);
    Tensor t = Tensor::from_vector<float>({1.f, float(r)}, {2}, dev_);
    half->all_reduce(t);
    EXPECT_EQ(t.to_vector<float>()[0], float(half->size()));
    float members = 0;
    for (int p = r % 2; p < n; p += 2) members += float(p);
    EXPECT_EQ(t.to_vector<float>()[1], members);
    half->barrier();
  }  // every rank destroys the split communicator here, in the same order
  g->barrier();
}

TEST_F(Nccl, ClearErrors) {
  auto& g = nccl_;
  const int n = g->size();
  Tensor cpu = Tensor::from_vector<float>({1.f}, {1});
  const std::string e1 = error_of([&] { g->all_reduce(cpu); });
  EXPECT_NE(e1.find("[all_reduce] the NCCL backend moves CUDA tensors"), std::string::npos) << e1;
  EXPECT_NE(error_of([&] { g->all_gather(cpu); }).find("[all_gather]"), std::string::npos);
  EXPECT_NE(error_of([&] { g->broadcast(cpu, 0); }).find("CUDA tensors"), std::string::npos);
  Tensor u8 = Tensor::zeros({4}, DType::u8).to(dev_);
  const std::string e2 = error_of([&] { g->all_reduce(u8); });
  EXPECT_NE(e2.find("no NCCL reduction for dtype u8"), std::string::npos) << e2;
  Tensor d = Tensor::zeros({3, 2}, DType::f32, dev_);
  const std::string e3 = error_of([&] {
    std::vector<int64_t> wrong(n + 1, 0);
    g->all_to_all_v(d, wrong, wrong);
  });
  EXPECT_NE(e3.find("[all_to_all_v] need"), std::string::npos) << e3;
  const std::string e4 = error_of([&] {
    std::vector<int64_t> rows(n, 0);
    rows[0] = 2;
    g->all_to_all_v(d, rows, rows);
  });
  EXPECT_NE(e4.find("send counts sum to 2 but send has 3 rows"), std::string::npos) << e4;
  if (n > 1) {
    Tensor odd = Tensor::zeros({int64_t(n) + 1}, DType::f32, dev_);
    EXPECT_NE(error_of([&] { g->reduce_scatter(odd); }).find("not divisible"), std::string::npos);
  }
  EXPECT_NE(error_of([&] { g->broadcast(d, n); }).find("[broadcast] root"), std::string::npos);
  // Every rank fails the same check before any communication, so nobody waits.
  const std::string e5 = error_of([&] { comm::nccl::make_group(cpu_, 1000); });
  EXPECT_NE(e5.find("cuda:1000 requested"), std::string::npos) << e5;
  // The group is still usable after the errors.
  Tensor ok = Tensor::from_vector<float>({1.f}, {1}, dev_);
  g->all_reduce(ok);
  EXPECT_EQ(ok.to_vector<float>()[0], float(n));
}
