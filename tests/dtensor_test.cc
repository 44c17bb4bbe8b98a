// DTensor shards: local_shard against a brute-force reference (every global element's index,
// cut by torch.chunk along each mesh dimension in turn), over shapes of 0 to 3 dimensions, 1-
// and 2-D meshes and every mix of Replicate() and Shard(d), the same dimension cut twice
// included; and the spec's checks.
#include "zeroflat/dtensor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "zeroflat/common.h"

namespace zeroflat {
namespace {

// The rows [first, first + rows) torch.chunk gives piece i of n of `size` rows.
std::pair<std::uint64_t, std::uint64_t> torch_chunk(std::uint64_t size, std::uint64_t n,
                                                    std::uint64_t i) {
  const std::uint64_t c = (size + n - 1) / n;
  std::uint64_t first = 0;
  for (std::uint64_t k = 0; k < n; ++k) {  // torch.chunk: pieces of c rows while rows remain
    const std::uint64_t rows = c == 0 ? 0 : std::min(c, size - std::min(size, first));
    if (k == i) return {first, rows};
    first += rows;
  }
  return {0, 0};
}

// The global element indices coordinate `coord` holds, in local row-major order: each
// dimension's index list cut in turn by the mesh dimensions that shard it.
std::vector<std::uint64_t> reference(const Shape& g, const std::vector<std::uint64_t>& mesh,
                                     const std::vector<MeshPlacement>& pl,
                                     const std::vector<std::uint64_t>& coord) {
  std::vector<std::vector<std::uint64_t>> idx(g.size());
  for (std::size_t d = 0; d < g.size(); ++d) {
    for (std::int64_t k = 0; k < g[d]; ++k) idx[d].push_back(static_cast<std::uint64_t>(k));
  }
  for (std::size_t m = 0; m < mesh.size(); ++m) {
    if (pl[m].kind != MeshPlacement::Kind::kShard) continue;
    std::vector<std::uint64_t>& v = idx[pl[m].dim];
    const auto [first, rows] = torch_chunk(v.size(), mesh[m], coord[m]);
    v = std::vector<std::uint64_t>(v.begin() + static_cast<std::ptrdiff_t>(first),
                                   v.begin() + static_cast<std::ptrdiff_t>(first + rows));
  }
  std::vector<std::uint64_t> out;
  std::vector<std::size_t> at(g.size(), 0);
  for (const auto& v : idx) {
    if (v.empty()) return out;
  }
  while (true) {
    std::uint64_t e = 0;
    for (std::size_t d = 0; d < g.size(); ++d) e = e * static_cast<std::uint64_t>(g[d]) + idx[d][at[d]];
    out.push_back(e);
    std::size_t d = g.size();
    while (d > 0) {
      --d;
      if (++at[d] < idx[d].size()) break;
      at[d] = 0;
      if (d == 0) return out;
    }
    if (g.empty()) return out;
  }
}

std::vector<std::uint64_t> expand(const std::vector<ElementRun>& runs) {
  std::vector<std::uint64_t> out;
  for (const ElementRun& r : runs) {
    for (std::uint64_t k = 0; k < r.numel; ++k) out.push_back(r.first + k);
  }
  return out;
}

TEST(DTensor, EveryShardIsTheReferencesElementsInLocalOrder) {
  std::mt19937 gen(7);
  int cases = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::size_t nd = gen() % 4;
    Shape g;
    for (std::size_t d = 0; d < nd; ++d) g.push_back(static_cast<std::int64_t>(gen() % 7));
    std::vector<std::uint64_t> mesh;
    const std::size_t md = 1 + gen() % 2;
    for (std::size_t m = 0; m < md; ++m) mesh.push_back(1 + gen() % 4);
    std::vector<MeshPlacement> pl;
    for (std::size_t m = 0; m < md; ++m) {
      if (nd == 0 || gen() % 3 == 0) {
        pl.push_back({MeshPlacement::Kind::kReplicate, 0});
      } else {
        pl.push_back({MeshPlacement::Kind::kShard, static_cast<std::uint32_t>(gen() % nd)});
      }
    }
    SCOPED_TRACE(shape_to_string(g) + " on " + std::to_string(mesh[0]) +
                 (md > 1 ? "x" + std::to_string(mesh[1]) : "") + " " + placement_name(pl[0]) +
                 (md > 1 ? ", " + placement_name(pl[1]) : ""));
    std::uint64_t padded = 0;
    std::vector<int> covered(static_cast<std::size_t>(shape_numel(g)), 0);
    std::vector<std::uint64_t> coord(md, 0);
    bool replicated = std::any_of(pl.begin(), pl.end(), [](const MeshPlacement& p) {
      return p.kind == MeshPlacement::Kind::kReplicate;
    });
    while (true) {
      const LocalShard s = local_shard(g, mesh, pl, coord);
      const std::vector<std::uint64_t> want = reference(g, mesh, pl, coord);
      EXPECT_EQ(expand(s.runs), want);
      EXPECT_EQ(s.numel, want.size());
      EXPECT_EQ(shape_numel(s.shape), s.numel);
      EXPECT_LE(s.numel, s.padded_numel);
      if (padded == 0) padded = s.padded_numel;
      EXPECT_EQ(s.padded_numel, padded);  // the same on every coordinate
      for (std::uint64_t e : want) ++covered[e];
      ++cases;
      std::size_t m = md;
      bool done = true;
      while (m > 0) {
        --m;
        if (++coord[m] < mesh[m]) {
          done = false;
          break;
        }
        coord[m] = 0;
      }
      if (done) break;
    }
    if (!replicated) {
      // Without Replicate(), the coordinates hold every element exactly once.
      for (int c : covered) EXPECT_EQ(c, 1);
    }
  }
  EXPECT_GT(cases, 1000);
}

TEST(DTensor, FSDPsUnevenLastShardAndEmptyShards) {
  // 10 rows on 4 ranks: chunks of 3, the last rank 1 row; 2 rows on 4 ranks: ranks 2, 3 empty.
  const std::vector<std::uint64_t> mesh{4};
  const std::vector<MeshPlacement> shard0{{MeshPlacement::Kind::kShard, 0}};
  LocalShard s = local_shard({10, 5}, mesh, shard0, std::vector<std::uint64_t>{3});
  EXPECT_EQ(s.shape, (Shape{1, 5}));
  EXPECT_EQ(s.padded_numel, 15u);
  EXPECT_EQ(s.runs, (std::vector<ElementRun>{{45, 5}}));
  s = local_shard({2, 5}, mesh, shard0, std::vector<std::uint64_t>{2});
  EXPECT_EQ(s.numel, 0u);
  EXPECT_TRUE(s.runs.empty());
  EXPECT_EQ(s.padded_numel, 5u);
  // Shard(1): one run per row.
  s = local_shard({3, 8}, mesh, std::vector<MeshPlacement>{{MeshPlacement::Kind::kShard, 1}},
                  std::vector<std::uint64_t>{1});
  EXPECT_EQ(s.runs, (std::vector<ElementRun>{{2, 2}, {10, 2}, {18, 2}}));
}

TEST(DTensor, BadSpecsAreRefusedNamingWhat) {
  const std::vector<std::uint64_t> mesh{2};
  const std::vector<MeshPlacement> s2{{MeshPlacement::Kind::kShard, 2}};
  EXPECT_THROW(local_shard({4, 4}, mesh, s2, std::vector<std::uint64_t>{0}), InvalidArgument);
  const std::vector<MeshPlacement> s0{{MeshPlacement::Kind::kShard, 0}};
  EXPECT_THROW(local_shard({4}, mesh, s0, std::vector<std::uint64_t>{2}), InvalidArgument);
  EXPECT_THROW(local_shard({4}, std::vector<std::uint64_t>{0}, s0, std::vector<std::uint64_t>{0}),
               InvalidArgument);
  EXPECT_THROW(local_shard({-1}, mesh, s0, std::vector<std::uint64_t>{0}), InvalidArgument);
  ShardSpec spec{{2, 2}, {{0, 0}, {0, 1}, {1, 0}, {1, 1}}, {{s0[0], s0[0]}}};
  EXPECT_NO_THROW(validate(spec, 4, 1));
  EXPECT_THROW(validate(spec, 3, 1), InvalidArgument);
  EXPECT_THROW(validate(spec, 4, 2), InvalidArgument);
  spec.coords[3] = {0, 0};  // two ranks in one cell
  EXPECT_THROW(validate(spec, 4, 1), InvalidArgument);
  spec.coords[3] = {2, 0};
  EXPECT_THROW(validate(spec, 4, 1), InvalidArgument);
}

}  // namespace
}  // namespace zeroflat
