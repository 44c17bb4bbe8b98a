// The sim device: exact accounting against a capacity, with or without data.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/engine.h"

namespace zeroflat {
namespace {

TEST(SimDevice, AccountsEveryByteAgainstItsCapacity) {
  auto dev = make_device("sim:1MiB");
  EXPECT_EQ(dev->name(), "sim:1MiB");
  void* a = dev->allocate(600 << 10);
  EXPECT_EQ(dev->memory_info().allocated_bytes, 600u << 10);
  try {
    (void)dev->allocate(500 << 10);
    FAIL() << "allocated past the capacity";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("sim:1MiB"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dev->memory_info().allocated_bytes, 600u << 10);  // the failure took nothing
  void* b = dev->allocate(424 << 10);                         // exactly full
  EXPECT_EQ(dev->memory_info().free_bytes, 0u);
  dev->release(a, 600 << 10);
  dev->release(b, 424 << 10);
  EXPECT_EQ(dev->memory_info().allocated_bytes, 0u);
  EXPECT_EQ(dev->memory_info().peak_allocated_bytes, 1u << 20);
  EXPECT_THROW((void)make_device("sim"), InvalidArgument);
  EXPECT_THROW((void)make_device("sim:0"), InvalidArgument);
  EXPECT_THROW((void)make_device("sim:lots"), InvalidArgument);
}

TEST(SimDevice, WithDataItFlattensLikeTheCpu) {
  auto sim = make_device("sim:64MiB", DeviceOptions{2});
  std::vector<std::uint16_t> a(100, 7), b(33, 9);
  std::vector<TensorRef> params = {{a.data(), 100, {100}, DType::kBF16, sim.get()},
                                   {b.data(), 33, {33}, DType::kBF16, sim.get()}};
  LayoutOptions o;
  o.dp = 4;
  FlatGroup g = flatten_group(*sim, params, o);
  const auto* flat = static_cast<const std::uint16_t*>(g.flat.data());
  EXPECT_EQ(flat[0], 7);
  EXPECT_EQ(flat[100], 9);
  EXPECT_EQ(flat[g.layout.flat_numel() - 1], 0);
  EXPECT_EQ(sim->memory_info().allocated_bytes, g.layout.flat_bytes());
}

TEST(SimDevice, WithoutDataA61GBModelFitsOnALaptop) {
  DeviceOptions no_data;
  no_data.no_data = true;
  auto sim = make_device("sim:80GiB", no_data);
  const std::uint64_t model = 61'064'245'248;  // qwen3-30b-a3b, 48 layers, bf16
  void* originals = sim->allocate(model);
  void* flat = sim->allocate(7'633'030'656);  // one rank's eighth
  EXPECT_NE(originals, flat);
  EXPECT_EQ(sim->memory_info().allocated_bytes, model + 7'633'030'656);
  EXPECT_THROW((void)sim->allocate(model), OutOfMemory);
  const Segment s{originals, 0, 4096};
  sim->gather(flat, 4096, {&s, 1});  // checked, not copied
  const Segment bad{originals, 4000, 200};
  EXPECT_THROW(sim->gather(flat, 4096, {&bad, 1}), InvalidArgument);
  EXPECT_THROW((void)sim->checksum(flat, 16), Unsupported);
  sim->release(flat, 7'633'030'656);
  sim->release(originals, model);
  EXPECT_EQ(sim->memory_info().allocated_bytes, 0u);
}

}  // namespace
}  // namespace zeroflat
