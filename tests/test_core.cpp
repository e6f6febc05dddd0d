#include <gtest/gtest.h>

#include "xmoe/core/allocator.h"
#include "xmoe/core/rng.h"
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
