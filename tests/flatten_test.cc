// The CPU flatten against a naive reference: many shapes and thread counts, empty and one-element
// tensors, unaligned pointers; views, the master partition, and groups rejected before any work.
#include "zeroflat/engine.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "zeroflat/common.h"
#include "zeroflat/device.h"

namespace zeroflat {
namespace {

// Parameters carved out of one arena at chosen byte offsets, so pointers can be misaligned.
struct Params {
  std::vector<unsigned char> arena;
  std::vector<TensorRef> refs;
};

Params make_params(Device& dev, const std::vector<std::uint64_t>& numels, DType dtype,
                   std::mt19937_64& rng, bool misalign) {
  const std::uint64_t es = element_size(dtype);
  std::vector<std::uint64_t> offsets;
  std::uint64_t at = 0;
  for (std::uint64_t n : numels) {
    // Element-aligned always; with misalign, often not 16- or 64-byte aligned.
    at += misalign ? es * (1 + rng() % 9) : (64 - at % 64) % 64;
    offsets.push_back(at);
    at += n * es;
  }
  Params p;
  p.arena.resize(at + 64);
  for (auto& b : p.arena) b = static_cast<unsigned char>(rng() | 1);  // no accidental zeros
  for (std::size_t i = 0; i < numels.size(); ++i) {
    p.refs.push_back(TensorRef{p.arena.data() + offsets[i], numels[i],
                               Shape{static_cast<std::int64_t>(numels[i])}, dtype, &dev});
  }
  return p;
}

// The flat buffer written the obvious way: zeros, then each parameter at its offset.
std::vector<unsigned char> naive_flat(const Layout& l, const std::vector<TensorRef>& params) {
  std::vector<unsigned char> out(l.flat_bytes(), 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel == 0) continue;
    std::memcpy(out.data() + l.offsets()[i] * l.element_size(), params[i].data,
                params[i].num_bytes());
  }
  return out;
}

TEST(Flatten, EqualsNaiveReferenceForManyShapesAndThreadCounts) {
  std::mt19937_64 rng(1129);
  const DType dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
  for (unsigned threads : {1u, 2u, 3u, 5u, 16u}) {
    auto dev = make_device("cpu", DeviceOptions{threads});
    for (int iter = 0; iter < 60; ++iter) {
      LayoutOptions o;
      o.dp = 1 + rng() % 8;
      o.alignment_factor = 1 + rng() % 4;
      o.round_robin = rng() % 2;
      o.dtype = dtypes[rng() % 3];
      o.param_align_bytes = rng() % 2 ? 0 : element_size(o.dtype) << (rng() % 6);
      std::vector<std::uint64_t> numels(rng() % 40);
      for (auto& n : numels) {
        const int kind = static_cast<int>(rng() % 8);
        n = kind == 0 ? 0 : kind == 1 ? 1 : kind == 7 ? 20000 + rng() % 70000 : rng() % 3000;
      }
      Params p = make_params(*dev, numels, o.dtype, rng, iter % 2 == 0);
      const std::vector<unsigned char> arena_before = p.arena;
      FlatGroup g = flatten_group(*dev, p.refs, o);
      const std::vector<unsigned char> want = naive_flat(g.layout, p.refs);
      ASSERT_EQ(g.flat.num_bytes(), want.size());
      if (!want.empty()) {
        ASSERT_EQ(0, std::memcmp(g.flat.data(), want.data(), want.size()))
            << threads << " threads, iter " << iter;
      }
      EXPECT_EQ(p.arena, arena_before) << "the originals were modified";
      // Views point into the flat buffer at the layout offsets, same metadata.
      for (std::size_t i = 0; i < numels.size(); ++i) {
        EXPECT_EQ(g.views[i].data, static_cast<unsigned char*>(g.flat.data()) +
                                       g.layout.offsets()[i] * g.layout.element_size());
        EXPECT_EQ(g.views[i].numel, numels[i]);
        EXPECT_EQ(g.views[i].shape, p.refs[i].shape);
        EXPECT_EQ(g.views[i].dtype, o.dtype);
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST(Flatten, PaddingIsZeroEvenOverGarbage) {
  // Gather directly into a buffer full of garbage: every byte not covered must become zero.
  auto dev = make_device("cpu", DeviceOptions{3});
  std::vector<unsigned char> a(10, 0xAA), b(7, 0xBB);
  std::vector<Segment> segs = {{a.data(), 3, 10}, {b.data(), 20, 7}};
  std::vector<unsigned char> dst(40, 0xFF);
  dev->gather(dst.data(), dst.size(), segs);
  for (std::size_t i = 0; i < dst.size(); ++i) {
    unsigned char want = (i >= 3 && i < 13) ? 0xAA : (i >= 20 && i < 27) ? 0xBB : 0;
    ASSERT_EQ(dst[i], want) << "byte " << i;
  }
  // Large enough for the streaming path, with interior gaps.
  const std::uint64_t n = 96ull << 20;
  std::vector<unsigned char> big(n, 0xFF), src(4 << 20, 0x11);
  std::vector<Segment> many;
  for (std::uint64_t off = 5; off + src.size() < n; off += src.size() + 4099) {
    many.push_back({src.data(), off, src.size()});
  }
  dev->gather(big.data(), n, many);
  std::uint64_t cursor = 0;
  for (const Segment& s : many) {
    for (std::uint64_t i = cursor; i < s.dst_offset; ++i) ASSERT_EQ(big[i], 0) << i;
    ASSERT_EQ(0, std::memcmp(big.data() + s.dst_offset, src.data(), s.num_bytes));
    cursor = s.dst_offset + s.num_bytes;
  }
  for (std::uint64_t i = cursor; i < n; ++i) ASSERT_EQ(big[i], 0) << i;
}

TEST(Flatten, OneHugeTensorAndManyTinyOnesAgree) {
  auto dev = make_device("cpu", DeviceOptions{2});
  std::mt19937_64 rng(5);
  Params one = make_params(*dev, {3u << 20}, DType::kBF16, rng, false);
  std::vector<std::uint64_t> tiny(100000, 31);
  Params many = make_params(*dev, tiny, DType::kBF16, rng, true);
  for (Params* p : {&one, &many}) {
    FlatGroup g = flatten_group(*dev, p->refs, LayoutOptions{4});
    std::vector<unsigned char> want = naive_flat(g.layout, p->refs);
    ASSERT_EQ(0, std::memcmp(g.flat.data(), want.data(), want.size()));
  }
}

TEST(Flatten, EmptyGroupAndAllEmptyParameters) {
  auto dev = make_device("cpu");
  FlatGroup g = flatten_group(*dev, {}, LayoutOptions{3});
  EXPECT_EQ(g.flat.num_bytes(), 0u);
  std::vector<TensorRef> empties(5, TensorRef{nullptr, 0, Shape{0}, DType::kBF16, dev.get()});
  FlatGroup h = flatten_group(*dev, empties, LayoutOptions{2});
  EXPECT_EQ(h.layout.flat_numel(), 0u);
  EXPECT_EQ(h.views.size(), 5u);
}

TEST(Flatten, MasterPartitionIsTheUpcastOfEachRanksPartition) {
  auto dev = make_device("cpu", DeviceOptions{2});
  std::mt19937_64 rng(9);
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    LayoutOptions o;
    o.dp = 3;
    o.dtype = dtype;
    Params p = make_params(*dev, {1000, 1, 0, 777}, dtype, rng, true);
    FlatGroup g = flatten_group(*dev, p.refs, o);
    for (std::uint64_t r = 0; r < o.dp; ++r) {
      DeviceBuffer m = make_master_partition(*dev, g, r);
      ASSERT_EQ(m.num_bytes(), g.layout.partition_numel() * 4);
      TensorRef part = g.partition(r);
      const auto* master = static_cast<const float*>(m.data());
      for (std::uint64_t k = 0; k < part.numel; ++k) {
        float want;
        if (dtype == DType::kFP32) {
          std::memcpy(&want, static_cast<const unsigned char*>(part.data) + 4 * k, 4);
        } else if (dtype == DType::kBF16) {
          std::uint16_t h;
          std::memcpy(&h, static_cast<const unsigned char*>(part.data) + 2 * k, 2);
          std::uint32_t bits = std::uint32_t{h} << 16;
          std::memcpy(&want, &bits, 4);
        } else {
          continue;  // fp16 conversion is checked value by value in host_kernels_test
        }
        std::uint32_t a, b;
        std::memcpy(&a, &master[k], 4);
        std::memcpy(&b, &want, 4);
        ASSERT_EQ(a, b) << "rank " << r << " element " << k;
      }
    }
    EXPECT_THROW((void)g.partition(3), InvalidArgument);
  }
}

std::string rejection(Device& dev, const std::vector<TensorRef>& params, LayoutOptions o = {}) {
  const MemoryInfo before = dev.memory_info();
  try {
    (void)flatten_group(dev, params, o);
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(dev.memory_info().allocated_bytes, before.allocated_bytes);
    EXPECT_EQ(dev.memory_info().peak_allocated_bytes, before.peak_allocated_bytes)
        << "memory was allocated before the group was rejected";
    return e.what();
  }
  return "accepted";
}

TEST(Flatten, BadGroupsAreRejectedBeforeAnyAllocation) {
  auto dev = make_device("cpu");
  auto other = make_device("cpu");
  std::vector<std::uint16_t> a(16), b(16);
  std::vector<float> f(16);
  auto ref = [&](void* data, std::uint64_t n, DType d, Device* on) {
    return TensorRef{data, n, Shape{static_cast<std::int64_t>(n)}, d, on};
  };
  // Mixed dtypes: the message names the parameter, its shape and both dtypes.
  std::string m = rejection(*dev, {ref(a.data(), 16, DType::kBF16, dev.get()),
                                   ref(f.data(), 16, DType::kFP32, dev.get())});
  EXPECT_NE(m.find("parameter 1 (shape [16], fp32)"), std::string::npos) << m;
  EXPECT_NE(m.find("bf16"), std::string::npos) << m;
  // Another device.
  m = rejection(*dev, {ref(a.data(), 16, DType::kBF16, other.get())});
  EXPECT_NE(m.find("parameter 0"), std::string::npos) << m;
  // numel disagrees with the shape.
  TensorRef wrong = ref(a.data(), 16, DType::kBF16, dev.get());
  wrong.shape = {4, 5};
  m = rejection(*dev, {wrong});
  EXPECT_NE(m.find("shape holds 20"), std::string::npos) << m;
  // Null data with elements.
  m = rejection(*dev, {ref(nullptr, 4, DType::kBF16, dev.get())});
  EXPECT_NE(m.find("no data pointer"), std::string::npos) << m;
  // Tied (same storage) and overlapping parameters.
  m = rejection(
      *dev, {ref(a.data(), 16, DType::kBF16, dev.get()), ref(b.data(), 16, DType::kBF16, dev.get()),
             ref(a.data(), 16, DType::kBF16, dev.get())});
  EXPECT_NE(m.find("shares memory"), std::string::npos) << m;
  m = rejection(*dev, {ref(a.data(), 16, DType::kBF16, dev.get()),
                       ref(a.data() + 15, 1, DType::kBF16, dev.get())});
  EXPECT_NE(m.find("shares memory"), std::string::npos) << m;
  // Adjacent is fine.
  EXPECT_EQ(rejection(*dev, {ref(a.data(), 8, DType::kBF16, dev.get()),
                             ref(a.data() + 8, 8, DType::kBF16, dev.get())}),
            "accepted");
  // Bad options.
  LayoutOptions dp0;
  dp0.dp = 0;
  EXPECT_NE(rejection(*dev, {ref(a.data(), 16, DType::kBF16, dev.get())}, dp0).find("dp = 0"),
            std::string::npos);
}

TEST(Flatten, GatherSegmentsOfASliceMatchTheFullBuffer) {
  auto dev = make_device("cpu", DeviceOptions{2});
  std::mt19937_64 rng(3);
  Params p = make_params(*dev, {100, 3, 0, 57, 1000, 9}, DType::kFP16, rng, true);
  LayoutOptions o;
  o.dp = 4;
  o.round_robin = true;
  o.dtype = DType::kFP16;
  FlatGroup g = flatten_group(*dev, p.refs, o);
  const std::uint64_t sb = g.layout.partition_bytes();
  for (std::uint64_t r = 0; r < o.dp; ++r) {
    std::vector<Segment> segs = gather_segments(g.layout, p.refs, r * sb, (r + 1) * sb);
    std::vector<unsigned char> part(sb, 0xEE);
    dev->gather(part.data(), sb, segs);
    ASSERT_EQ(0, std::memcmp(part.data(), static_cast<unsigned char*>(g.flat.data()) + r * sb, sb));
  }
  EXPECT_THROW((void)gather_segments(g.layout, p.refs, 1, 4), InvalidArgument);
}

}  // namespace
}  // namespace zeroflat
