#include <gtest/gtest.h>

#include "xmoe/core/allocator.h"
#include "xmoe/core/parameter.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/side_stream.h"
#include "xmoe/core/tensor.h"

using namespace xmoe;

TEST(Tensor, ShapeViewsAndCopies) {
  Tensor t = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2});
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.size(-1), 2);
  Tensor r = t.rows(1, 3);
  EXPECT_EQ(r.shape(), (Shape{2, 2}));
  EXPECT_EQ(r.to_vector<float>(), (std::vector<float>{3, 4, 5, 6}));
  EXPECT_TRUE(r.shares_storage(t));
  Tensor c = t.clone();
  c.data<float>()[0] = 42;
  EXPECT_EQ(t.data<float>()[0], 1);
  EXPECT_EQ(t.reshape({-1}).shape(), (Shape{6}));
  EXPECT_EQ(t.item(5), 6.0);
}

TEST(Tensor, FromExternalViewsMemoryItDoesNotOwn) {
  std::vector<float> memory = {1, 2, 3, 4, 5, 6};
  const MemoryStats before = memory_stats();
  auto owner_alive = std::make_shared<int>(0);
  std::weak_ptr<int> watch = owner_alive;
  {
    Tensor t = Tensor::from_external(memory.data(), {2, 3}, DType::f32, Device::cpu(),
                                     std::move(owner_alive));
    EXPECT_EQ(t.raw(), memory.data());
    EXPECT_EQ(memory_stats().live_bytes, before.live_bytes);  // nothing allocated or counted
    EXPECT_EQ(memory_stats().num_allocs, before.num_allocs);
    t.rows(1, 2).fill_(7.f);  // writes land in the external memory
    EXPECT_EQ(memory, (std::vector<float>{1, 2, 3, 7, 7, 7}));
    EXPECT_EQ(t.reshape({3, 2}).to_vector<float>(), memory);
    EXPECT_FALSE(watch.expired());  // the keep-alive lives as long as the view
  }
  EXPECT_TRUE(watch.expired());
  EXPECT_EQ(memory_stats().live_bytes, before.live_bytes);
  EXPECT_EQ(memory[0], 1.f);  // not freed, not touched
  EXPECT_THROW(Tensor::from_external(nullptr, {2}, DType::f32, Device::cpu()), Error);
  EXPECT_TRUE(Tensor::from_external(nullptr, {0, 4}, DType::f32, Device::cpu()).defined());
}

TEST(Tensor, BadArgumentsNameTheProblem) {
  Tensor t = Tensor::zeros({3, 2});
  EXPECT_THROW(t.reshape({4, 2}), Error);
  EXPECT_THROW(t.rows(2, 4), Error);
  EXPECT_THROW(t.data<int32_t>(), Error);
  try {
    check_shape(t, {3, 3}, "myop", "x");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[myop] x has shape [3, 2], expected [3, 3]"),
              std::string::npos);
  }
  // No such device: a clear error whether or not this build and machine have CUDA.
  EXPECT_THROW(Tensor::empty({2}, DType::f32, Device::cuda(99)), Error);
}

TEST(Tensor, Bf16RoundTrip) {
  Tensor t = Tensor::from_vector<float>({1.0f, -2.5f, 3.14159f, 1e-3f}, {4});
  auto back = t.to(DType::bf16).to(DType::f32).to_vector<float>();
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], -2.5f);
  EXPECT_NEAR(back[2], 3.14159f, 0.02f);
  EXPECT_NEAR(back[3], 1e-3f, 1e-5f);
}

TEST(Allocator, LiveAndPeakCounters) {
  const int64_t base = memory_stats().live_bytes;
  reset_peak_memory();
  {
    Tensor a = Tensor::empty({1024});  // 4 KiB
    {
      Tensor b = Tensor::empty({2048});  // 8 KiB
      EXPECT_EQ(memory_stats().live_bytes - base, 12288);
    }
    EXPECT_EQ(memory_stats().live_bytes - base, 4096);
  }
  EXPECT_EQ(memory_stats().live_bytes, base);
  EXPECT_EQ(memory_stats().peak_bytes - base, 12288);
  PeakMemoryScope scope;
  { Tensor c = Tensor::empty({256}); }
  EXPECT_EQ(scope.extra_peak_bytes(), 1024);
}

TEST(Rng, CounterBasedAndIndependentOfSplitting) {
  // A tensor filled whole equals the same tensor filled in two shards with offsets.
  Tensor whole = Tensor::empty({1000});
  fill_normal(whole, 7, stream_id("w"), 1.0f);
  Tensor lo = Tensor::empty({400}), hi = Tensor::empty({600});
  fill_normal(lo, 7, stream_id("w"), 1.0f, 0.f, 0);
  fill_normal(hi, 7, stream_id("w"), 1.0f, 0.f, 400);
  auto w = whole.to_vector<float>();
  auto l = lo.to_vector<float>(), h = hi.to_vector<float>();
  for (int i = 0; i < 400; ++i) ASSERT_EQ(w[i], l[i]);
  for (int i = 0; i < 600; ++i) ASSERT_EQ(w[400 + i], h[i]);
  double mean = 0, var = 0;
  for (float x : w) mean += x;
  mean /= 1000;
  for (float x : w) var += (x - mean) * (x - mean);
  var /= 1000;
  EXPECT_NEAR(mean, 0.0, 0.1);
  EXPECT_NEAR(var, 1.0, 0.15);
  // Different seeds differ.
  EXPECT_NE(Philox::uniform(1, 0, 0), Philox::uniform(2, 0, 0));
  Rng r(3);
  for (int i = 0; i < 100; ++i) EXPECT_LT(r.below(10), 10u);
}

namespace {

/// Sets the CPU allocator's limit for one scope, then puts the old one back.
class ScopedLimit {
 public:
  explicit ScopedLimit(int64_t bytes) : old_(allocator_for(Device::cpu()).limit()) {
    allocator_for(Device::cpu()).set_limit(bytes);
  }
  ~ScopedLimit() { allocator_for(Device::cpu()).set_limit(old_); }
  ScopedLimit(const ScopedLimit&) = delete;
  ScopedLimit& operator=(const ScopedLimit&) = delete;

 private:
  int64_t old_;
};

}  // namespace

// A request no host can hold: OutOfMemory with what was asked and what the host has, and the
// counters exactly as before (nothing was allocated, nothing counted).
TEST(Allocator, ImpossibleHostAllocationThrowsOutOfMemoryAndCountsNothing) {
  const MemoryStats before = memory_stats();
  const int64_t elems = (int64_t{1} << 61) - 1;  // f32: 2^63 - 4 bytes
  try {
    Tensor t = Tensor::empty({elems});
    FAIL() << "allocated " << t.str();
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(e.device(), "cpu");
    EXPECT_EQ(e.bytes_asked(), elems * 4);
    EXPECT_GT(e.bytes_total(), 0);
    EXPECT_GE(e.bytes_free(), 0);
    EXPECT_LE(e.bytes_free(), e.bytes_total());
    EXPECT_EQ(e.live_bytes(), before.live_bytes);
    const std::string what = e.what();
    EXPECT_NE(what.find("[cpu allocator] out of memory: asked 9223372036854775804 bytes"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find(std::to_string(e.bytes_total())), std::string::npos) << what;
  }
  // The largest size_t too (no overflow in the rounding), and as an xmoe::Error.
  EXPECT_THROW(allocator_for(Device::cpu()).allocate(SIZE_MAX), Error);
  const MemoryStats after = memory_stats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.num_allocs, before.num_allocs);
  EXPECT_EQ(after.total_bytes, before.total_bytes);
}

// Allocator::set_limit (XMOE_MEMORY_LIMIT): a request past the cap is refused as by a device of
// that size, naming the cap as the total and what is left as free; what a half-built object had
// allocated is freed as the exception unwinds.
TEST(Allocator, LimitRefusesWhatADeviceOfThatSizeWould) {
  const int64_t base = memory_stats().live_bytes;
  const int64_t old_limit = allocator_for(Device::cpu()).limit();
  {
    ScopedLimit limit(base + 65536);
    EXPECT_EQ(allocator_for(Device::cpu()).limit(), base + 65536);
    Tensor a = Tensor::empty({8192});  // 32 KiB: fits
    try {
      Tensor b = Tensor::empty({16384});  // 64 KiB more: does not
      FAIL() << "allocated " << b.str();
    } catch (const OutOfMemory& e) {
      EXPECT_EQ(e.bytes_asked(), 65536);
      EXPECT_EQ(e.bytes_free(), 32768);
      EXPECT_EQ(e.bytes_total(), base + 65536);
      EXPECT_EQ(e.live_bytes(), base + 32768);
      EXPECT_NE(std::string(e.what()).find("XMOE_MEMORY_LIMIT"), std::string::npos) << e.what();
    }
    EXPECT_EQ(memory_stats().live_bytes, base + 32768);
    // value (32 KiB) just fits, its gradient does not: the value is freed on the way out.
    EXPECT_THROW(Parameter::make("p", {64, 128}), OutOfMemory);
    EXPECT_EQ(memory_stats().live_bytes, base + 32768);
  }
  EXPECT_EQ(memory_stats().live_bytes, base);
  EXPECT_EQ(allocator_for(Device::cpu()).limit(), old_limit);
  allocator_for(Device::cpu()).set_limit(0);  // no cap: fits again
  Tensor after = Tensor::empty({16384});
  allocator_for(Device::cpu()).set_limit(old_limit);
  EXPECT_THROW(allocator_for(Device::cpu()).set_limit(-1), Error);
}

// Parameter::drop_master_weights: the bf16 weights only, from the compute copy when there is one
// (no new memory), else cast on the host.
TEST(Parameter, DropMasterWeightsKeepsTheBf16WeightsOnly) {
  Parameter p = Parameter::make("w", {4, 8});
  p.init_normal(1, 0.5f);
  const std::vector<float> master = p.value.to_vector<float>();
  const std::vector<float> rounded = p.value.to(DType::bf16).to(DType::f32).to_vector<float>();
  const int64_t live = memory_stats().live_bytes;
  p.drop_master_weights(DType::bf16);
  EXPECT_EQ(p.value.dtype(), DType::bf16);
  EXPECT_EQ(p.value.shape(), (Shape{4, 8}));
  EXPECT_EQ(p.value.to(DType::f32).to_vector<float>(), rounded);
  EXPECT_NE(rounded, master);
  EXPECT_EQ(memory_stats().live_bytes, live - 4 * 8 * 2);  // 4 bytes an element -> 2
  EXPECT_EQ(p.grad.dtype(), DType::f32);                   // gradients as they were
  EXPECT_TRUE(p.compute().shares_storage(p.value));

  Parameter q = Parameter::make("q", {4, 8});
  q.compute_copy = q.value.to(DType::bf16);
  const Tensor copy = q.compute_copy;
  q.drop_master_weights(DType::bf16);
  EXPECT_TRUE(q.value.shares_storage(copy));
  EXPECT_FALSE(q.compute_copy.defined());
  EXPECT_THROW(q.drop_master_weights(DType::f32), Error);
}

// The MoE layers share the device's one side stream (one stream, free list and cuBLAS
// workspace, not one per layer) while any holds it; on the CPU there is nothing to share. Its
// stream is made on the first begin(), so this needs no GPU.
TEST(SideStream, OnePerDeviceWhileHeld) {
  std::shared_ptr<SideStream> a = SideStream::for_device(Device::cuda(0));
  std::shared_ptr<SideStream> b = SideStream::for_device(Device::cuda(0));
  EXPECT_EQ(a.get(), b.get());
  EXPECT_NE(SideStream::for_device(Device::cuda(1)).get(), a.get());
  EXPECT_EQ(SideStream::for_device(Device::cuda(1))->device(), Device::cuda(1));
  const std::weak_ptr<SideStream> held = a;
  a.reset();
  b.reset();
  EXPECT_TRUE(held.expired()) << "the registry must not keep a side stream alive";
  EXPECT_NE(SideStream::for_device(Device::cpu()).get(),
            SideStream::for_device(Device::cpu()).get());
}
