#include "comm/testing/channel_checks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/fanout.h"
#include "planner/invariants.h"
#include "planner/planner.h"

namespace rackrun::comm::testing {
namespace {

using ::testing::HasSubstr;

// A deterministic float per (a, b, c) with a full mantissa, so sums round differently in
// different orders.
float Value(int a, int64_t b, int64_t c) {
  uint64_t h = static_cast<uint64_t>(a) * 0x9E3779B97F4A7C15ull ^
               static_cast<uint64_t>(b) * 0xC2B2AE3D27D4EB4Full ^
               static_cast<uint64_t>(c) * 0x165667B19E3779F9ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<float>(static_cast<double>(h % 2000003) / 1000.0 - 1000.0) * 1.0001f;
}

// A small dyadic rational (k/8, |k| <= 16): products and short sums of these are exact in
// float, so results cannot depend on how the compiler contracts or orders the arithmetic.
float Dyadic(int a, int64_t b, int64_t c) {
  const float v = Value(a, b, c);
  return static_cast<float>(static_cast<int64_t>(std::fabs(v) * 1000) % 33 - 16) / 8.0f;
}

std::byte ByteValue(int expert, int64_t i) {
  return static_cast<std::byte>((expert * 131 + i * 7 + (i >> 9)) & 0xFF);
}

absl::Status WaitFor(absl::StatusOr<std::unique_ptr<Request>>& r, absl::Duration timeout) {
  if (!r.ok()) return r.status();
  return (*r)->Wait(timeout);
}

}  // namespace

void CheckAllgather(DataChannel& channel) {
  const int n = channel.size();
  const int me = channel.rank();
  for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{20000}}) {
    std::vector<int32_t> send(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) send[i] = me * 100000 + static_cast<int32_t>(i);
    std::vector<int32_t> recv(static_cast<size_t>(count * n), -1);
    ASSERT_TRUE(channel.Allgather(send.data(), recv.data(), count, DataType::kInt32).ok());
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(recv[r * count + i], r * 100000 + i) << "count " << count << " rank " << r;
      }
    }
  }
}

void CheckAllToAllV(DataChannel& channel) {
  const int n = channel.size();
  const int me = channel.rank();
  auto count = [](int src, int dst) { return static_cast<int64_t>((src + 2 * dst) % 4) * 3; };
  std::vector<int64_t> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
  int64_t send_total = 0;
  int64_t recv_total = 0;
  for (int p = 0; p < n; ++p) {
    // Gaps between blocks check that displacements, not counts, place the data.
    send_counts[p] = count(me, p);
    send_displs[p] = send_total;
    send_total += send_counts[p] + 1;
    recv_counts[p] = count(p, me);
    recv_displs[p] = recv_total;
    recv_total += recv_counts[p] + 2;
  }
  std::vector<int64_t> send(static_cast<size_t>(send_total), -7);
  for (int p = 0; p < n; ++p) {
    for (int64_t i = 0; i < send_counts[p]; ++i) send[send_displs[p] + i] = me * 1000 + p * 10 + i;
  }
  std::vector<int64_t> recv(static_cast<size_t>(recv_total), -9);
  ASSERT_TRUE(channel
                  .AllToAllV(send.data(), send_counts, send_displs, recv.data(), recv_counts,
                             recv_displs, DataType::kInt64)
                  .ok());
  for (int p = 0; p < n; ++p) {
    for (int64_t i = 0; i < recv_counts[p]; ++i) {
      EXPECT_EQ(recv[recv_displs[p] + i], p * 1000 + me * 10 + i) << "from rank " << p;
    }
    EXPECT_EQ(recv[recv_displs[p] + recv_counts[p]], -9) << "gap after block of rank " << p;
  }
}

void CheckBroadcast(DataChannel& channel) {
  const int n = channel.size();
  const int me = channel.rank();
  for (int root = 0; root < n; ++root) {
    std::vector<float> buf(3001, -1.0f);
    if (me == root) {
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = Value(root, static_cast<int64_t>(i), 1);
    }
    ASSERT_TRUE(
        channel.Broadcast(buf.data(), static_cast<int64_t>(buf.size()), DataType::kFloat32, root)
            .ok());
    for (size_t i = 0; i < buf.size(); ++i) {
      ASSERT_EQ(buf[i], Value(root, static_cast<int64_t>(i), 1)) << "root " << root;
    }
  }
}

void CheckBarrier(DataChannel& channel) {
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(channel.Barrier().ok());
  // A barrier separates phases: what a rank sends after it arrives after what it sent
  // before, and every rank sees the pre-barrier Allgather complete.
  int32_t mine = channel.rank() + 1;
  std::vector<int32_t> all(static_cast<size_t>(channel.size()));
  ASSERT_TRUE(channel.Allgather(&mine, all.data(), 1, DataType::kInt32).ok());
  ASSERT_TRUE(channel.Barrier().ok());
  for (int r = 0; r < channel.size(); ++r) EXPECT_EQ(all[r], r + 1);
}

void CheckAllReduce(DataChannel& channel, bool fixed_order) {
  const int n = channel.size();
  const int me = channel.rank();
  // Counts that split unevenly over the ranks, and fewer elements than ranks.
  for (int64_t count : {int64_t{0}, int64_t{2}, int64_t{1003}, int64_t{50001}}) {
    std::vector<int64_t> ints(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) ints[i] = (me + 1) * 1000003 + i;
    std::vector<int64_t> int_sum(static_cast<size_t>(count));
    ASSERT_TRUE(
        channel.AllReduce(ints.data(), int_sum.data(), count, DataType::kInt64, ReduceOp::kSum)
            .ok());
    for (int64_t i = 0; i < count; ++i) {
      ASSERT_EQ(int_sum[i], static_cast<int64_t>(n) * (n + 1) / 2 * 1000003 + n * i);
    }

    // What each rank contributes, and the promise (docs/design.md sections 4.10 and 6.2):
    // those vectors summed in ascending rank order, every addition rounded to float.
    const auto contribution = [count](int rank) {
      std::vector<float> v(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) v[i] = Value(rank, i, 2);
      return v;
    };
    const std::vector<float> x = contribution(me);
    std::vector<float> reference = contribution(0);
    for (int r = 1; r < n; ++r) {
      const std::vector<float> add = contribution(r);
      for (int64_t i = 0; i < count; ++i) reference[i] += add[i];
    }
    std::vector<float> first;
    for (int repeat = 0; repeat < 3; ++repeat) {
      std::vector<float> sum = x;  // in place: send == recv
      ASSERT_TRUE(
          channel.AllReduce(sum.data(), sum.data(), count, DataType::kFloat32, ReduceOp::kSum)
              .ok());
      if (repeat == 0) {
        first = sum;
        for (int64_t i = 0; i < count; ++i) {
          if (fixed_order) {
            ASSERT_EQ(sum[i], reference[i]) << "element " << i << " of " << count;
          } else {
            ASSERT_NEAR(sum[i], reference[i], 1e-5 * (1 + std::fabs(reference[i])));
          }
        }
        // The same bits on every rank.
        std::vector<float> gathered(static_cast<size_t>(count * n));
        ASSERT_TRUE(channel.Allgather(sum.data(), gathered.data(), count, DataType::kFloat32).ok());
        for (int r = 0; r < n && count > 0; ++r) {  // memcmp of no bytes: null pointers
          ASSERT_EQ(std::memcmp(gathered.data() + r * count, sum.data(),
                                static_cast<size_t>(count) * sizeof(float)),
                    0)
              << "rank " << r << " got different AllReduce bits";
        }
      } else if (count > 0) {
        ASSERT_EQ(std::memcmp(first.data(), sum.data(), static_cast<size_t>(count) * sizeof(float)),
                  0)
            << "AllReduce repeat " << repeat << " differs from the first";
      }
    }
  }
}

void CheckSendRecv(DataChannel& channel) {
  const int n = channel.size();
  const int me = channel.rank();
  const int next = (me + 1) % n;
  const int prev = (me + n - 1) % n;
  const absl::Duration timeout = channel.timeout();

  // Ring plus self, a small and a large (rendezvous-sized) message, in one group.
  for (int64_t count : {int64_t{3}, int64_t{3 << 18}}) {
    std::vector<int32_t> out(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) out[i] = me * 7 + static_cast<int32_t>(i);
    std::vector<int32_t> in(static_cast<size_t>(count), -1);
    std::vector<int32_t> self_in(static_cast<size_t>(count), -1);
    ASSERT_TRUE(channel.GroupStart().ok());
    auto s1 = channel.Isend(out.data(), count, DataType::kInt32, next, 5);
    auto r1 = channel.Irecv(in.data(), count, DataType::kInt32, prev, 5);
    auto s2 = channel.Isend(out.data(), count, DataType::kInt32, me, 6);
    auto r2 = channel.Irecv(self_in.data(), count, DataType::kInt32, me, 6);
    ASSERT_TRUE(channel.GroupEnd().ok());
    ASSERT_TRUE(r1.ok() && r2.ok() && s1.ok() && s2.ok());
    // Test until done (bounded), then Wait (which returns at once).
    bool done = false;
    const absl::Time deadline = absl::Now() + timeout;
    while (!done && absl::Now() < deadline) {
      absl::StatusOr<bool> t = (*r1)->Test();
      ASSERT_TRUE(t.ok()) << t.status();
      done = *t;
    }
    ASSERT_TRUE(done) << "ring receive from rank " << prev << " never completed";
    EXPECT_TRUE(WaitFor(r1, timeout).ok());
    EXPECT_TRUE(WaitFor(r2, timeout).ok());
    EXPECT_TRUE(WaitFor(s1, timeout).ok());
    EXPECT_TRUE(WaitFor(s2, timeout).ok());
    for (int64_t i = 0; i < count; ++i) {
      ASSERT_EQ(in[i], prev * 7 + i);
      ASSERT_EQ(self_in[i], me * 7 + i);
    }
  }
  if (!channel.matches_by_tag()) return;

  // Tag matching: tags sent in one order are received in the other, and two messages
  // with one (peer, tag) arrive in sending order.
  int32_t a = 100 + me, b = 200 + me, c = 300 + me, d = 400 + me;
  auto sa = channel.Isend(&a, 1, DataType::kInt32, next, 11);
  auto sb = channel.Isend(&b, 1, DataType::kInt32, next, 10);
  auto sc = channel.Isend(&c, 1, DataType::kInt32, next, 12);
  auto sd = channel.Isend(&d, 1, DataType::kInt32, next, 12);
  int32_t ra = 0, rb = 0, rc = 0, rd = 0;
  auto qb = channel.Irecv(&rb, 1, DataType::kInt32, prev, 10);
  auto qa = channel.Irecv(&ra, 1, DataType::kInt32, prev, 11);
  auto qc = channel.Irecv(&rc, 1, DataType::kInt32, prev, 12);
  auto qd = channel.Irecv(&rd, 1, DataType::kInt32, prev, 12);
  for (auto* r : {&qb, &qa, &qc, &qd, &sa, &sb, &sc, &sd}) ASSERT_TRUE(WaitFor(*r, timeout).ok());
  EXPECT_EQ(ra, 100 + prev);
  EXPECT_EQ(rb, 200 + prev);
  EXPECT_EQ(rc, 300 + prev);
  EXPECT_EQ(rd, 400 + prev);

  // A receive posted before its send exists.
  int64_t late = -1;
  auto early_recv = channel.Irecv(&late, 1, DataType::kInt64, me, 13);
  ASSERT_TRUE(early_recv.ok());
  absl::StatusOr<bool> not_yet = (*early_recv)->Test();
  ASSERT_TRUE(not_yet.ok());
  EXPECT_FALSE(*not_yet);
  int64_t value = 4242;
  auto late_send = channel.Isend(&value, 1, DataType::kInt64, me, 13);
  ASSERT_TRUE(WaitFor(late_send, timeout).ok());
  ASSERT_TRUE(WaitFor(early_recv, timeout).ok());
  EXPECT_EQ(late, 4242);

  // Sizes must agree.
  int32_t small = 1;
  int64_t big = 0;
  auto s_small = channel.Isend(&small, 1, DataType::kInt32, me, 14);
  auto r_big = channel.Irecv(&big, 1, DataType::kInt64, me, 14);
  ASSERT_TRUE(WaitFor(s_small, timeout).ok());
  absl::Status mismatch = WaitFor(r_big, timeout);
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kInvalidArgument) << mismatch;
  EXPECT_THAT(mismatch.message(), HasSubstr("bytes"));
}

void CheckBadArguments(DataChannel& channel) {
  int32_t x = 0;
  auto bad_peer = channel.Isend(&x, 1, DataType::kInt32, channel.size(), 0);
  ASSERT_FALSE(bad_peer.ok());
  EXPECT_EQ(bad_peer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_peer.status().message(), HasSubstr("peer"));
  auto bad_tag = channel.Irecv(&x, 1, DataType::kInt32, 0, kMaxUserTag);
  ASSERT_FALSE(bad_tag.ok());
  EXPECT_THAT(bad_tag.status().message(), HasSubstr("tag"));
  auto bad_count = channel.Irecv(&x, -1, DataType::kInt32, 0, 0);
  ASSERT_FALSE(bad_count.ok());
  EXPECT_THAT(bad_count.status().message(), HasSubstr("count"));
  std::vector<int64_t> short_counts(static_cast<size_t>(channel.size()) + 1, 0);
  std::vector<int64_t> displs(static_cast<size_t>(channel.size()), 0);
  absl::Status a2a =
      channel.AllToAllV(&x, short_counts, displs, &x, displs, displs, DataType::kInt32);
  EXPECT_EQ(a2a.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a2a.message(), HasSubstr("send_counts"));
  absl::Status bytes_sum = channel.AllReduce(&x, &x, 1, DataType::kByte, ReduceOp::kSum);
  EXPECT_EQ(bytes_sum.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bytes_sum.message(), HasSubstr("byte"));
}

void CheckSubChannels(DataChannel& channel, int group, bool fixed_order) {
  const int n = channel.size();
  const int me = channel.rank();
  ASSERT_EQ(n % group, 0);
  absl::StatusOr<std::unique_ptr<DataChannel>> domain = channel.Split(me / group, me);
  ASSERT_TRUE(domain.ok()) << domain.status();
  absl::StatusOr<std::unique_ptr<DataChannel>> stride = channel.Split(me % group, me);
  ASSERT_TRUE(stride.ok()) << stride.status();
  DataChannel& d = **domain;
  DataChannel& s = **stride;
  EXPECT_EQ(d.size(), group);
  EXPECT_EQ(d.rank(), me % group);
  EXPECT_EQ(s.size(), n / group);
  EXPECT_EQ(s.rank(), me / group);
  EXPECT_EQ(d.backend(), channel.backend());

  // Each group's sum and gather hold its own ranks' values, no others.
  for (DataChannel* sub : {&d, &s}) {
    const bool is_domain = sub == &d;
    int64_t x = int64_t{1} << me;
    ASSERT_TRUE(sub->AllReduce(&x, &x, 1, DataType::kInt64, ReduceOp::kSum).ok());
    int64_t expected = 0;
    std::vector<int64_t> members;
    for (int r = 0; r < n; ++r) {
      if (is_domain ? r / group == me / group : r % group == me % group) {
        expected += int64_t{1} << r;
        members.push_back(r);
      }
    }
    EXPECT_EQ(x, expected);
    const int64_t mine = me;
    std::vector<int64_t> all(static_cast<size_t>(sub->size()), -1);
    ASSERT_TRUE(sub->Allgather(&mine, all.data(), 1, DataType::kInt64).ok());
    EXPECT_EQ(all, members);
  }

  // The contract's checks, on both kinds of sub-group.
  for (DataChannel* sub : {&d, &s}) {
    CheckAllgather(*sub);
    CheckAllToAllV(*sub);
    CheckBroadcast(*sub);
    CheckBarrier(*sub);
    CheckAllReduce(*sub, fixed_order);
    CheckSendRecv(*sub);
    CheckBadArguments(*sub);
  }

  // Same peer, same tag on the channel and on the domain: receives posted in the opposite
  // order of the sends still each get their own channel's message.
  if (group > 1) {
    const int peer_sub = (d.rank() + 1) % group;
    const int from_sub = (d.rank() + group - 1) % group;
    const int peer = (me / group) * group + peer_sub;
    const int from = (me / group) * group + from_sub;
    const int32_t on_channel = 1000 + me, on_sub = 2000 + me;
    absl::StatusOr<std::unique_ptr<Request>> send_c =
        channel.Isend(&on_channel, 1, DataType::kInt32, peer, 7);
    absl::StatusOr<std::unique_ptr<Request>> send_d =
        d.Isend(&on_sub, 1, DataType::kInt32, peer_sub, 7);
    int32_t got_sub = -1, got_channel = -1;
    absl::StatusOr<std::unique_ptr<Request>> recv_d =
        d.Irecv(&got_sub, 1, DataType::kInt32, from_sub, 7);
    absl::StatusOr<std::unique_ptr<Request>> recv_c =
        channel.Irecv(&got_channel, 1, DataType::kInt32, from, 7);
    EXPECT_TRUE(WaitFor(recv_d, channel.timeout()).ok());
    EXPECT_TRUE(WaitFor(recv_c, channel.timeout()).ok());
    EXPECT_TRUE(WaitFor(send_c, channel.timeout()).ok());
    EXPECT_TRUE(WaitFor(send_d, channel.timeout()).ok());
    EXPECT_EQ(got_sub, 2000 + from);
    EXPECT_EQ(got_channel, 1000 + from);
  }

  // A split of a split: the domain in reverse order (key), then halves of it by color.
  absl::StatusOr<std::unique_ptr<DataChannel>> reversed = d.Split(0, group - d.rank());
  ASSERT_TRUE(reversed.ok()) << reversed.status();
  EXPECT_EQ((*reversed)->rank(), group - 1 - d.rank());
  int64_t root_rank = me;
  std::vector<int64_t> order(static_cast<size_t>(group));
  ASSERT_TRUE((*reversed)->Allgather(&root_rank, order.data(), 1, DataType::kInt64).ok());
  for (int r = 0; r < group; ++r) {
    EXPECT_EQ(order[static_cast<size_t>(r)], (me / group) * group + group - 1 - r);
  }
  CheckAllReduce(**reversed, fixed_order);
  // The channel itself is untouched by all of the above.
  CheckAllReduce(channel, fixed_order);

  // A negative color anywhere fails the split on every rank, naming that rank.
  absl::StatusOr<std::unique_ptr<DataChannel>> bad = channel.Split(me == n - 1 ? -1 : 0, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr(absl::StrCat("rank ", n - 1, " passed color -1")));
}

void CheckSilentRankTimesOut(DataChannel& channel, int silent) {
  const int me = channel.rank();
  if (me == silent) return;  // stops answering
  const std::string silent_name = "rank " + std::to_string(silent);

  int32_t x = 0;
  auto r = channel.Irecv(&x, 1, DataType::kInt32, silent, 3);
  ASSERT_TRUE(r.ok());
  absl::Status recv = (*r)->Wait(absl::Milliseconds(200));
  EXPECT_EQ(recv.code(), absl::StatusCode::kDeadlineExceeded) << recv;
  EXPECT_THAT(recv.message(), HasSubstr("waiting for " + silent_name));
  EXPECT_THAT(recv.message(), HasSubstr("on rank " + std::to_string(me)));

  int32_t mine = me;
  std::vector<int32_t> all(static_cast<size_t>(channel.size()));
  absl::Status gather = channel.Allgather(&mine, all.data(), 1, DataType::kInt32);
  EXPECT_EQ(gather.code(), absl::StatusCode::kDeadlineExceeded) << gather;
  EXPECT_THAT(gather.message(), HasSubstr("Allgather on rank " + std::to_string(me)));
  EXPECT_THAT(gather.message(), HasSubstr(silent_name));
  // Only the silent rank is named: everyone else answered.
  for (int p = 0; p < channel.size(); ++p) {
    if (p == silent || p == me) continue;
    EXPECT_THAT(gather.message(), ::testing::Not(HasSubstr("rank " + std::to_string(p) + " (")))
        << gather;
  }
  // The channel is broken now, and says so.
  absl::Status after = channel.Barrier();
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition) << after;
  EXPECT_THAT(after.message(), HasSubstr("broken"));
}

planner::Plan RandomPlan(int ranks, int masters_per_rank, int slots_per_rank, int tokens_per_rank,
                         int top_k, uint64_t seed, std::vector<TokenRouting>* routings) {
  std::mt19937_64 rng(seed);
  const int experts = ranks * masters_per_rank;
  top_k = std::min(top_k, experts);
  // Skewed routing: low expert ids are hot.
  routings->assign(static_cast<size_t>(ranks), TokenRouting{});
  planner::LoadMatrix loads(ranks, experts);
  for (int src = 0; src < ranks; ++src) {
    TokenRouting& routing = (*routings)[static_cast<size_t>(src)];
    routing.num_tokens = tokens_per_rank;
    routing.top_k = top_k;
    for (int t = 0; t < tokens_per_rank; ++t) {
      std::vector<int32_t> chosen;
      while (static_cast<int>(chosen.size()) < top_k) {
        const auto a = static_cast<int32_t>(rng() % static_cast<uint64_t>(experts));
        const auto b = static_cast<int32_t>(rng() % static_cast<uint64_t>(experts));
        const int32_t e = std::min(a, b);
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      for (int32_t e : chosen) {
        routing.expert.push_back(e);
        ++loads.at(src, e);
      }
    }
  }
  planner::Plan plan;
  plan.ranks = ranks;
  plan.experts = experts;
  std::vector<int> free_slots(static_cast<size_t>(ranks), slots_per_rank);
  for (int e = 0; e < experts; ++e) {
    plan.first.push_back(static_cast<int32_t>(plan.instances.size()));
    const int home = e / masters_per_rank;
    plan.instances.push_back({e, home, true});
    std::vector<int> replicas;
    for (int r = 0; r < ranks; ++r) {
      if (r != home && free_slots[static_cast<size_t>(r)] > 0 && rng() % 3 == 0) {
        replicas.push_back(r);
        --free_slots[static_cast<size_t>(r)];
      }
    }
    for (int r : replicas) {
      plan.instances.push_back({e, r, false});
      plan.fanout.transfers.push_back({e, home, r, 0});
    }
  }
  plan.first.push_back(static_cast<int32_t>(plan.instances.size()));
  const size_t n = plan.instances.size();
  planner::IndexSplitColumns(&plan);  // columns for the replicated experts only
  plan.quota.assign(n, 0);
  for (int src = 0; src < ranks; ++src) {
    for (int e = 0; e < experts; ++e) {
      int64_t remaining = loads.at(src, e);
      for (int i = plan.first[e]; i < plan.first[e + 1]; ++i) {
        const bool last = i + 1 == plan.first[e + 1];
        const int64_t take =
            last ? remaining : static_cast<int64_t>(rng() % static_cast<uint64_t>(remaining + 1));
        const int32_t column = plan.split_column[static_cast<size_t>(i)];
        if (column >= 0) {
          plan.split[static_cast<size_t>(column) * static_cast<size_t>(ranks) +
                     static_cast<size_t>(src)] = take;
        }
        plan.quota[static_cast<size_t>(i)] += take;
        remaining -= take;
      }
    }
  }
  return plan;
}

namespace {

// The linear expert y = W_e x + b_e, row by row, on dyadic values (exact arithmetic): a
// misrouted row (wrong token, wrong expert, wrong place) changes the result.
void LinearExpert(int expert, const float* in, int64_t rows, int64_t in_width, float* out,
                  int64_t out_width) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out_width; ++o) {
      float acc = Dyadic(expert, o, 1000);
      for (int64_t i = 0; i < in_width; ++i) {
        acc += Dyadic(expert, o * 64 + i, 7) * in[r * in_width + i];
      }
      out[r * out_width + o] = acc;
    }
  }
}

}  // namespace

void CheckTokenDispatch(DataChannel& channel, uint64_t seed, bool use_ultraep) {
  const int n = channel.size();
  const int me = channel.rank();
  constexpr int kMastersPerRank = 3;
  constexpr int kSlots = 2;
  constexpr int kTokens = 41;
  constexpr int kTopK = 2;
  constexpr int64_t kIn = 8;
  constexpr int64_t kOut = 5;
  std::vector<TokenRouting> routings;
  planner::Plan plan = RandomPlan(n, kMastersPerRank, kSlots, kTokens, kTopK, seed, &routings);
  const planner::Domain domain{n, kMastersPerRank, kSlots};
  planner::LoadMatrix loads(n, domain.experts());
  for (int src = 0; src < n; ++src) {
    for (int32_t e : routings[static_cast<size_t>(src)].expert) ++loads.at(src, e);
  }
  if (use_ultraep) {
    absl::StatusOr<std::unique_ptr<planner::Planner>> planner =
        planner::MakePlanner("ultraep", domain, planner::PlannerOptions{});
    ASSERT_TRUE(planner.ok()) << planner.status();
    absl::StatusOr<planner::Plan> solved = (*planner)->Solve(loads, 0);
    ASSERT_TRUE(solved.ok()) << solved.status();
    plan = *std::move(solved);
  }
  ASSERT_TRUE(planner::CheckPlanInvariants(domain, loads, plan).ok());

  const TokenRouting& routing = routings[static_cast<size_t>(me)];
  absl::StatusOr<TokenDispatch> dispatch = TokenDispatch::Create(plan, loads, me, routing);
  ASSERT_TRUE(dispatch.ok()) << dispatch.status();
  for (const TokenDispatch::LocalBatch& b : dispatch->local_batches()) {
    EXPECT_EQ(b.rows, plan.quota[static_cast<size_t>(b.instance)]) << "instance " << b.instance;
    EXPECT_EQ(plan.instances[static_cast<size_t>(b.instance)].rank, me);
  }

  std::vector<float> x(static_cast<size_t>(kTokens * kIn));
  for (int64_t i = 0; i < kTokens * kIn; ++i) x[i] = Dyadic(me + 50, i, 3);
  std::vector<float> slot_out(static_cast<size_t>(dispatch->choice_rows() * kOut), NAN);
  int64_t rows_run = 0;
  ExpertFn linear = [&](const TokenDispatch::LocalBatch& b, const float* in, int64_t in_width,
                        float* out, int64_t out_width) {
    rows_run += b.rows;
    LinearExpert(b.expert, in, b.rows, in_width, out, out_width);
    return absl::OkStatus();
  };
  ASSERT_TRUE(DispatchAndCombine(channel, *dispatch, x, kIn, linear, kOut, slot_out).ok());
  EXPECT_EQ(rows_run, dispatch->expert_rows());
  // At home: every slot's expert applied to its token.
  for (int64_t s = 0; s < dispatch->choice_rows(); ++s) {
    std::vector<float> expected(kOut);
    LinearExpert(routing.expert[static_cast<size_t>(s)], x.data() + (s / kTopK) * kIn, 1, kIn,
                 expected.data(), kOut);
    for (int64_t o = 0; o < kOut; ++o) {
      ASSERT_EQ(slot_out[s * kOut + o], expected[o]) << "slot " << s << " column " << o;
    }
  }
  // Gate-weighted combine in the fixed slot order equals the home computation.
  std::vector<float> gates(static_cast<size_t>(dispatch->choice_rows()));
  for (size_t s = 0; s < gates.size(); ++s) gates[s] = Dyadic(me, static_cast<int64_t>(s), 9);
  std::vector<float> y(static_cast<size_t>(kTokens * kOut));
  ASSERT_TRUE(WeightedCombine(slot_out, gates, kTokens, kTopK, kOut, y).ok());
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t o = 0; o < kOut; ++o) {
      float acc = 0;
      for (int j = 0; j < kTopK; ++j)
        acc += gates[t * kTopK + j] * slot_out[(t * kTopK + j) * kOut + o];
      ASSERT_EQ(y[t * kOut + o], acc);
    }
  }

  // Backward direction: per-slot rows go out with the same layout and come back.
  std::vector<float> grads(static_cast<size_t>(dispatch->choice_rows() * kOut));
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = Value(me, static_cast<int64_t>(i), 11);
  std::vector<float> expert_in(static_cast<size_t>(dispatch->expert_rows() * kOut));
  ASSERT_TRUE(dispatch->DispatchChoices(channel, grads, kOut, expert_in).ok());
  for (const TokenDispatch::LocalBatch& b : dispatch->local_batches()) {
    for (int64_t i = b.offset * kOut; i < (b.offset + b.rows) * kOut; ++i) {
      expert_in[static_cast<size_t>(i)] *= static_cast<float>(b.expert + 1);
    }
  }
  std::vector<float> back(grads.size(), NAN);
  ASSERT_TRUE(dispatch->Combine(channel, expert_in, kOut, back).ok());
  for (int64_t s = 0; s < dispatch->choice_rows(); ++s) {
    const float scale = static_cast<float>(routing.expert[static_cast<size_t>(s)] + 1);
    for (int64_t o = 0; o < kOut; ++o) {
      ASSERT_EQ(back[s * kOut + o], grads[s * kOut + o] * scale) << "slot " << s;
    }
  }

  // Routing that disagrees with the plan is refused before any message moves.
  if (routing.num_tokens > 0) {
    TokenRouting wrong = routing;
    wrong.expert[0] = (wrong.expert[0] + 1) % plan.experts;
    absl::StatusOr<TokenDispatch> refused = TokenDispatch::Create(plan, loads, me, wrong);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(), HasSubstr("split"));
  }
}

namespace {

// Runs `schedule` twice: blocking (ExecuteFanout), then posted (StartFanout) with a
// collective and a Poll before Finish, as the expert-parallel executor overlaps it.
void RunSchedule(DataChannel& channel, const planner::FanoutSchedule& schedule,
                 int64_t expert_bytes, const FanoutExecutorOptions& options,
                 const std::string& label) {
  const int me = channel.rank();
  int64_t expected_in = 0;
  int64_t expected_out = 0;
  std::map<int, bool> receives;
  for (const planner::WeightTransfer& w : schedule.transfers) {
    if (w.dst_rank == me) {
      receives[w.expert] = true;
      expected_in += expert_bytes;
    }
    if (w.src_rank == me) expected_out += expert_bytes;
  }
  for (const bool posted : {false, true}) {
    const std::string what = label + (posted ? " (posted)" : " (blocking)");
    std::map<int, std::vector<std::byte>> storage;
    std::map<int, std::span<std::byte>> buffers;
    for (const planner::WeightTransfer& w : schedule.transfers) {
      if (w.src_rank != me && w.dst_rank != me) continue;
      if (storage.contains(w.expert)) continue;
      std::vector<std::byte>& bytes = storage[w.expert];
      bytes.assign(static_cast<size_t>(expert_bytes), std::byte{0});
      if (!receives[w.expert]) {
        for (int64_t i = 0; i < expert_bytes; ++i) bytes[i] = ByteValue(w.expert, i);
      }
      buffers[w.expert] = bytes;
    }
    absl::StatusOr<FanoutExecutorStats> stats;
    if (!posted) {
      stats = ExecuteFanout(channel, schedule, expert_bytes, buffers, options);
    } else {
      absl::StatusOr<std::unique_ptr<FanoutInFlight>> run =
          StartFanout(channel, schedule, expert_bytes, buffers, options);
      ASSERT_TRUE(run.ok()) << what << ": " << run.status();
      // A collective while the weights travel (the executor's token dispatch).
      const int64_t mine = me;
      std::vector<int64_t> all(static_cast<size_t>(channel.size()));
      ASSERT_TRUE(channel.Allgather(&mine, all.data(), 1, DataType::kInt64).ok()) << what;
      ASSERT_TRUE((*run)->Poll().ok()) << what;
      stats = (*run)->Finish();
    }
    ASSERT_TRUE(stats.ok()) << what << ": " << stats.status();
    EXPECT_EQ(stats->bytes_received, expected_in) << what;
    EXPECT_EQ(stats->bytes_sent, expected_out) << what;
    for (const auto& [expert, bytes] : storage) {
      for (int64_t i = 0; i < expert_bytes; ++i) {
        ASSERT_EQ(bytes[i], ByteValue(expert, i))
            << what << ": rank " << me << " expert " << expert << " byte " << i;
      }
    }
  }
}

}  // namespace

void CheckRelayFanout(DataChannel& channel, FanoutPacing pacing) {
  const int n = channel.size();
  FanoutExecutorOptions options;
  options.chunk_bytes = 4096;
  options.pacing = pacing;
  const int64_t bytes = 5 * 4096 + 123;  // a short last chunk
  if (n < 2) {
    RunSchedule(channel, {}, bytes, options, "empty schedule");
    return;
  }
  // One master (rank 0) to every other rank, directly.
  planner::FanoutSchedule direct;
  for (int d = 1; d < n; ++d) direct.transfers.push_back({7, 0, d, 0});
  RunSchedule(channel, direct, bytes, options, "direct");

  // The same destinations through floor(sqrt(n - 1)) relays (stage 1 from each relay).
  planner::FanoutSchedule relay;
  const int destinations = n - 1;
  const int relays = std::max(1, static_cast<int>(std::sqrt(static_cast<double>(destinations))));
  for (int k = 0; k < relays; ++k) relay.transfers.push_back({7, 0, 1 + k, 0});
  for (int d = 1 + relays; d < n; ++d) {
    relay.transfers.push_back({7, 1 + (d - 1 - relays) % relays, d, 1});
  }
  RunSchedule(channel, relay, bytes, options, "relay");

  // Several experts crossing: every rank is a master, one rank relays two experts to the
  // same leaf (tags keep them apart), and one chain is two relays deep.
  planner::FanoutSchedule crossing;
  for (int e = 0; e < n; ++e) crossing.transfers.push_back({e, e, (e + 1) % n, 0});
  if (n >= 3) {
    crossing.transfers.push_back({0, 1, 2, 1});      // expert 0: 0 -> 1 -> 2
    crossing.transfers.push_back({n - 1, 0, 1, 1});  // expert n-1: n-1 -> 0 -> 1
  }
  if (n >= 4) crossing.transfers.push_back({0, 2, 3, 1});  // expert 0: ... -> 2 -> 3
  RunSchedule(channel, crossing, bytes, options, "crossing");

  // The planner's own relay schedule for one hot expert replicated on every other rank.
  planner::Plan plan;
  plan.ranks = n;
  plan.experts = n;
  for (int e = 0; e < n; ++e) {
    plan.first.push_back(static_cast<int32_t>(plan.instances.size()));
    plan.instances.push_back({e, e, true});
    if (e == 0) {
      for (int r = 1; r < n; ++r) plan.instances.push_back({0, r, false});
    }
  }
  plan.first.push_back(static_cast<int32_t>(plan.instances.size()));
  plan.quota.assign(plan.instances.size(), 0);
  planner::IndexSplitColumns(&plan);
  const planner::FanoutSchedule planned =
      planner::PlanFanout(plan, planner::FanoutOptions{planner::FanoutMode::kRelay});
  ASSERT_EQ(static_cast<int>(planned.transfers.size()), n - 1);
  RunSchedule(channel, planned, bytes, options, "planner relay schedule");

  // A malformed schedule is refused on every rank before any message moves.
  planner::FanoutSchedule twice = direct;
  twice.transfers.push_back(direct.transfers.front());
  std::vector<std::byte> buf(static_cast<size_t>(bytes));
  absl::StatusOr<FanoutExecutorStats> refused =
      ExecuteFanout(channel, twice, bytes, {{7, std::span<std::byte>(buf)}}, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("twice"));
}

}  // namespace rackrun::comm::testing
