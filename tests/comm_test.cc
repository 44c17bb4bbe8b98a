// The local communicator: collectives across ranks as threads, failures and timeouts.
#include "zeroflat/comm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "zeroflat/common.h"
#include "zeroflat/device.h"

namespace zeroflat {
namespace {

using namespace std::chrono_literals;

// Runs fn(communicator) on every rank of a fresh group, each in its own thread; returns each
// rank's error message ("" when it returned normally).
template <typename Fn>
std::vector<std::string> on_ranks(int n, std::chrono::milliseconds timeout, Fn fn) {
  LocalGroup group(n, timeout);
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto comm = group.rank(r);
      try {
        fn(*comm);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(LocalComm, AllGatherInPlaceAcrossOneToFiveRanks) {
  auto dev = make_device("cpu", DeviceOptions{1});
  for (int n = 1; n <= 5; ++n) {
    const std::uint64_t slice = 1000 + static_cast<std::uint64_t>(n);  // not a round number
    std::vector<std::vector<unsigned char>> buffers(static_cast<std::size_t>(n),
                                                    std::vector<unsigned char>(slice * n, 0xEE));
    std::vector<std::string> errors = on_ranks(n, 10s, [&](Communicator& c) {
      auto& mine = buffers[static_cast<std::size_t>(c.rank())];
      for (std::uint64_t i = 0; i < slice; ++i) {
        mine[c.rank() * slice + i] = static_cast<unsigned char>(c.rank() * 37 + i);
      }
      for (int round = 0; round < 3; ++round) c.all_gather_inplace(mine.data(), slice, *dev);
    });
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(errors[static_cast<std::size_t>(r)], "") << n << " ranks";
      for (int owner = 0; owner < n; ++owner) {
        for (std::uint64_t i = 0; i < slice; ++i) {
          ASSERT_EQ(buffers[static_cast<std::size_t>(r)][owner * slice + i],
                    static_cast<unsigned char>(owner * 37 + i))
              << n << " ranks, rank " << r << " slice " << owner;
        }
      }
    }
  }
}

TEST(LocalComm, AllGatherOfAPartMovesOnlyThatPartOfEverySlice) {
  auto dev = make_device("cpu", DeviceOptions{1});
  const int n = 3;
  const std::uint64_t slice = 1001, offset = 300, part = 401;
  std::vector<std::vector<unsigned char>> buffers(n, std::vector<unsigned char>(slice * n, 0xEE));
  std::vector<std::string> errors = on_ranks(n, 10s, [&](Communicator& c) {
    ASSERT_TRUE(c.gathers_parts(*dev));
    auto& mine = buffers[static_cast<std::size_t>(c.rank())];
    for (std::uint64_t i = 0; i < slice; ++i) {
      mine[c.rank() * slice + i] = static_cast<unsigned char>(c.rank() * 37 + i);
    }
    c.all_gather_part(mine.data(), slice, offset, part, *dev);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(errors[static_cast<std::size_t>(r)], "");
    for (int owner = 0; owner < n; ++owner) {
      for (std::uint64_t i = 0; i < slice; ++i) {
        const bool moved = owner == r || (i >= offset && i < offset + part);
        ASSERT_EQ(buffers[static_cast<std::size_t>(r)][owner * slice + i],
                  moved ? static_cast<unsigned char>(owner * 37 + i) : 0xEE)
            << "rank " << r << " slice " << owner << " byte " << i;
      }
    }
  }
  // Ranks that name different parts, or a part past the slice, are refused with nothing copied.
  std::vector<std::vector<unsigned char>> b(2, std::vector<unsigned char>(2 * slice, 0));
  errors = on_ranks(2, 10s, [&](Communicator& c) {
    auto& mine = b[static_cast<std::size_t>(c.rank())];
    mine.assign(mine.size(), static_cast<unsigned char>(c.rank() + 1));
    c.all_gather_part(mine.data(), slice, c.rank() == 0 ? 0 : 8, 100, *dev);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[static_cast<std::size_t>(r)].find("different parts"), std::string::npos)
        << errors[static_cast<std::size_t>(r)];
    EXPECT_EQ(std::count(b[static_cast<std::size_t>(r)].begin(),
                         b[static_cast<std::size_t>(r)].end(), static_cast<unsigned char>(r + 1)),
              static_cast<std::ptrdiff_t>(2 * slice));
  }
  errors = on_ranks(1, 10s, [&](Communicator& c) {
    std::vector<unsigned char> one(slice);
    c.all_gather_part(one.data(), slice, slice - 10, 11, *dev);
  });
  EXPECT_NE(errors[0].find("outside a slice"), std::string::npos) << errors[0];
}

TEST(LocalComm, AllReduceAgreesOnTheMinimumAndMaximum) {
  std::vector<std::vector<std::uint64_t>> mins(4), maxs(4);
  auto errors = on_ranks(4, 10s, [&](Communicator& c) {
    std::vector<std::uint64_t> v = {100u - static_cast<std::uint64_t>(c.rank()),
                                    static_cast<std::uint64_t>(c.rank()) * 10};
    std::vector<std::uint64_t> w = v;
    c.all_reduce_min(v);
    c.all_reduce_max(w);
    mins[static_cast<std::size_t>(c.rank())] = v;
    maxs[static_cast<std::size_t>(c.rank())] = w;
    c.barrier();
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "");
    EXPECT_EQ(mins[static_cast<std::size_t>(r)], (std::vector<std::uint64_t>{97, 0}));
    EXPECT_EQ(maxs[static_cast<std::size_t>(r)], (std::vector<std::uint64_t>{100, 30}));
  }
}

TEST(LocalComm, AFailedRankBecomesACommErrorOnTheOthersNotAHang) {
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = on_ranks(3, 60s, [&](Communicator& c) {
    if (c.rank() == 1) {
      std::this_thread::sleep_for(50ms);
      c.abort("allocation of the partition failed");
      throw OutOfMemory("partition");
    }
    c.barrier();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "the others waited for the timeout";
  for (int r : {0, 2}) {
    EXPECT_NE(errors[static_cast<std::size_t>(r)].find("rank 1 failed: allocation"),
              std::string::npos)
        << errors[static_cast<std::size_t>(r)];
  }
}

TEST(LocalComm, ARankThatNeverArrivesTimesOutWithItsNumber) {
  auto errors = on_ranks(3, 200ms, [&](Communicator& c) {
    if (c.rank() == 2) return;  // disappears
    c.barrier();
  });
  int timed_out = 0;
  for (int r : {0, 1}) {
    const std::string& e = errors[static_cast<std::size_t>(r)];
    EXPECT_NE(e.find("2"), std::string::npos) << e;
    timed_out += e.find("never arrived") != std::string::npos;
  }
  EXPECT_GE(timed_out, 1);
}

TEST(LocalComm, MismatchedCallsAndBadRanksAreErrors) {
  auto errors = on_ranks(2, 10s, [&](Communicator& c) {
    std::vector<std::uint64_t> v(static_cast<std::size_t>(c.rank()) + 1, 5);
    c.all_reduce_min(v);
  });
  EXPECT_NE(errors[0] + errors[1], "");
  EXPECT_THROW(LocalGroup(0), InvalidArgument);
  LocalGroup g(2);
  EXPECT_THROW((void)g.rank(2), InvalidArgument);
  EXPECT_EQ(g.rank(1)->name(), "local");
}

// Ranks that pass different byte counts to the all-gather: every rank refuses before anyone
// copies (a shorter peer's buffer would be read past its end).
TEST(LocalComm, AllGatherChecksEveryRanksByteCountFirst) {
  auto cpu = make_device("cpu", DeviceOptions{1});
  auto errors = on_ranks(3, 10s, [&](Communicator& c) {
    const std::uint64_t slice = c.rank() == 2 ? 16 : 8;
    std::vector<unsigned char> buf(slice * 3, static_cast<unsigned char>(c.rank()));
    c.all_gather_inplace(buf.data(), slice, *cpu);
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("slices of 8 to 16 bytes"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace zeroflat
