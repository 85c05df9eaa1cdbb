#include "coordinator/scheduler.h"

#include <gtest/gtest.h>

namespace rackrun::coordinator {
namespace {

QueuedJob Job(const std::string& id, int ranks, const std::string& channel = "",
              int64_t not_before = 0) {
  QueuedJob q;
  q.job_id = id;
  q.spec.mutable_resources()->set_ranks(ranks);
  q.spec.mutable_resources()->set_channel(channel);
  q.not_before_ms = not_before;
  return q;
}

IdleWorker W(const std::string& id, const std::string& host, int launcher_rank,
             std::vector<std::string> channels = {"ucx", "gloo"}) {
  return IdleWorker{id, host, 1, launcher_rank, "", std::move(channels), ""};
}

TEST(SchedulerTest, RanksAreDeterministicByHostThenLauncherRank) {
  std::vector<IdleWorker> idle = {W("w-3", "b", 0), W("w-1", "a", 1), W("w-2", "a", 0),
                                  W("w-4", "b", -1)};
  std::vector<Placement> p = Schedule({Job("j-1", 4)}, idle, 0);
  ASSERT_EQ(p.size(), 1u);
  ASSERT_EQ(p[0].ranks.size(), 4u);
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-2");
  EXPECT_EQ(p[0].ranks[1].worker_id, "w-1");
  EXPECT_EQ(p[0].ranks[2].worker_id, "w-4");
  EXPECT_EQ(p[0].ranks[3].worker_id, "w-3");
  std::reverse(idle.begin(), idle.end());
  std::vector<Placement> again = Schedule({Job("j-1", 4)}, idle, 0);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(again[0].ranks[r].worker_id, p[0].ranks[r].worker_id);
}

TEST(SchedulerTest, FifoWithoutOvertaking) {
  std::vector<IdleWorker> idle = {W("w-1", "a", 0), W("w-2", "a", 1)};
  // j-1 needs 3: nothing starts, j-2 (1 rank) waits behind it.
  EXPECT_TRUE(Schedule({Job("j-1", 3), Job("j-2", 1)}, idle, 0).empty());
  std::vector<Placement> p = Schedule({Job("j-1", 1), Job("j-2", 0), Job("j-3", 1)}, idle, 0);
  ASSERT_EQ(p.size(), 2u);  // 0 ranks means 1
  EXPECT_EQ(p[0].job_id, "j-1");
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-1");
  EXPECT_EQ(p[1].job_id, "j-2");
  EXPECT_EQ(p[1].ranks[0].worker_id, "w-2");
}

TEST(SchedulerTest, ChannelKindAndBackoff) {
  std::vector<IdleWorker> idle = {W("w-1", "a", 0, {"ucx", "gloo"}),
                                  W("w-2", "a", 1, {"ucx", "gloo", "nccl"})};
  std::vector<Placement> p = Schedule({Job("j-1", 1, "nccl")}, idle, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-2");
  EXPECT_TRUE(Schedule({Job("j-1", 2, "nccl")}, idle, 0).empty());
  EXPECT_TRUE(Schedule({Job("j-1", 1, "", 100)}, idle, 99).empty());
  EXPECT_EQ(Schedule({Job("j-1", 1, "", 100)}, idle, 100).size(), 1u);
}

// A job of `ranks` ranks on resources.device `device`.
QueuedJob OnDevice(const std::string& id, int ranks, const std::string& device) {
  QueuedJob q = Job(id, ranks);
  q.spec.mutable_resources()->set_device(device);
  return q;
}

IdleWorker Gpu(const std::string& id, const std::string& host, int launcher_rank) {
  IdleWorker w = W(id, host, launcher_rank);
  w.gpu = true;
  return w;
}

TEST(SchedulerTest, CudaJobsRunOnlyOnGpuWorkersCpuJobsAnywhere) {
  EXPECT_TRUE(NeedsGpu(OnDevice("j", 1, "cuda").spec));
  EXPECT_TRUE(NeedsGpu(OnDevice("j", 1, "cuda:3").spec));
  EXPECT_FALSE(NeedsGpu(OnDevice("j", 1, "cpu").spec));
  EXPECT_FALSE(NeedsGpu(OnDevice("j", 1, "").spec));
  // w-1 (CPU) comes first in rank order; the cuda job skips it for the GPU worker, the cpu
  // job behind it takes the CPU worker.
  const std::vector<IdleWorker> idle = {W("w-1", "a", 0), Gpu("w-2", "a", 1)};
  Unplaced unplaced{"stale", "stale"};
  std::vector<Placement> p =
      Schedule({OnDevice("j-1", 1, "cuda"), OnDevice("j-2", 1, "cpu")}, idle, 0, &unplaced);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-2");
  EXPECT_EQ(p[1].ranks[0].worker_id, "w-1");
  EXPECT_TRUE(unplaced.job_id.empty()) << unplaced.reason;
  // A cpu job may run on a GPU worker (it is the first in rank order here).
  p = Schedule({OnDevice("j-3", 1, "cpu")}, {Gpu("w-2", "a", 0), W("w-1", "a", 1)}, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-2");
  // Two GPU ranks on one GPU worker and one CPU worker: not placed.
  EXPECT_TRUE(Schedule({OnDevice("j-4", 2, "cuda:0")}, idle, 0).empty());
}

TEST(SchedulerTest, ACudaJobWithoutGpuWorkersIsNotPlacedAndSaysWhy) {
  const std::vector<IdleWorker> cpus = {W("w-1", "a", 0), W("w-2", "a", 1)};
  Unplaced unplaced;
  // FIFO: the cpu job behind the waiting cuda job waits too.
  EXPECT_TRUE(Schedule({OnDevice("j-1", 1, "cuda"), OnDevice("j-2", 1, "cpu")}, cpus, 0, &unplaced)
                  .empty());
  EXPECT_EQ(unplaced.job_id, "j-1");
  EXPECT_EQ(unplaced.reason,
            "not placed: resources.device: cuda needs 1 idle worker with a GPU offering channel "
            "ucx; idle now: 2 workers, none with a GPU (start rackrun-worker --device cuda:N on a "
            "GPU machine, or use resources.device: cpu)");
  // One GPU worker of three idle, two GPU ranks asked.
  const std::vector<IdleWorker> mixed = {W("w-1", "a", 0), Gpu("w-2", "a", 1), W("w-3", "a", 2)};
  EXPECT_TRUE(Schedule({OnDevice("j-5", 2, "cuda:1")}, mixed, 0, &unplaced).empty());
  EXPECT_EQ(unplaced.job_id, "j-5");
  EXPECT_NE(unplaced.reason.find("resources.device: cuda:1 needs 2 idle workers with a GPU"),
            std::string::npos)
      << unplaced.reason;
  EXPECT_NE(unplaced.reason.find("idle now: 3 workers, 1 with a GPU"), std::string::npos)
      << unplaced.reason;
  // GPU workers running other jobs: counted, and the job may just be waiting for them.
  EXPECT_TRUE(Schedule({OnDevice("j-7", 1, "cuda")}, cpus, 0, &unplaced, 2).empty());
  EXPECT_EQ(unplaced.reason,
            "not placed: resources.device: cuda needs 1 idle worker with a GPU offering channel "
            "ucx; idle now: 2 workers, none with a GPU; busy now: 2 with a GPU (it starts when "
            "enough of them are idle, or start rackrun-worker --device cuda:N on a GPU machine, "
            "or use resources.device: cpu)");
  // A cpu job that waits for workers is no device matter: nothing to say.
  EXPECT_TRUE(Schedule({OnDevice("j-6", 4, "cpu")}, mixed, 0, &unplaced).empty());
  EXPECT_TRUE(unplaced.job_id.empty()) << unplaced.reason;
}

// A cuda job of issue 35's c1024 shape (823M parameters: 12.3 GiB of parameters, gradients
// and AdamW moments at one rank) and GPU workers that reported their memory.
QueuedJob C1024(const std::string& id, int ranks) {
  QueuedJob q = OnDevice(id, ranks, "cuda");
  rackrun::v1::ModelSpec* m = q.spec.mutable_model();
  m->set_vocab(256);
  m->set_width(1024);
  m->set_blocks(4);
  m->set_heads(16);
  m->set_seq_len(1024);
  m->mutable_moe()->set_experts(64);
  m->mutable_moe()->set_top_k(4);
  m->mutable_moe()->set_expert_hidden(1024);
  q.spec.mutable_data()->set_batch_size(8);
  return q;
}

IdleWorker GpuOf(const std::string& id, int launcher_rank, int64_t gib) {
  IdleWorker w = Gpu(id, "a", launcher_rank);
  w.gpu_bytes = gib << 30;
  return w;
}

TEST(SchedulerTest, ACudaJobGoesToAGpuThatHoldsItsParametersAndOptimizerState) {
  const int64_t one = GpuStateBytes(C1024("j", 1).spec), two = GpuStateBytes(C1024("j", 2).spec);
  EXPECT_GT(one, int64_t{12} << 30);
  EXPECT_LT(one, int64_t{13} << 30);
  // Two ranks shard the experts: about half a rank.
  EXPECT_GT(two, int64_t{6} << 30);
  EXPECT_LT(two, int64_t{7} << 30);
  // w-1 comes first in rank order but its 4 GiB holds neither; w-3 reported no size (an
  // older worker): it may take any.
  const std::vector<IdleWorker> idle = {GpuOf("w-1", 0, 4), GpuOf("w-2", 1, 80),
                                        GpuOf("w-3", 2, 0)};
  Unplaced unplaced;
  std::vector<Placement> p = Schedule({C1024("j-1", 1)}, idle, 0, &unplaced);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-2");
  p = Schedule({C1024("j-2", 2)}, idle, 0, &unplaced);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-2");
  EXPECT_EQ(p[0].ranks[1].worker_id, "w-3");
  // Without w-3 only one GPU can: not placed, and the reason says why with the bytes.
  EXPECT_TRUE(Schedule({C1024("j-3", 2)}, {idle[0], idle[1]}, 0, &unplaced).empty());
  EXPECT_EQ(unplaced.job_id, "j-3");
  EXPECT_NE(unplaced.reason.find("idle now: 2 workers, 1 with a GPU of at least 6.3 GiB (a rank's "
                                 "parameters, gradients and AdamW moments), 1 with a smaller one "
                                 "(start rackrun-worker"),
            std::string::npos)
      << unplaced.reason;
  // A cpu job of the same shape may run anywhere.
  QueuedJob cpu = C1024("j-4", 2);
  cpu.spec.mutable_resources()->set_device("cpu");
  p = Schedule({cpu}, {idle[0], idle[1]}, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-1");
}

// A job of `ranks` ranks in domains of `g` (parallelism.expert_parallel), 8 experts.
QueuedJob Domains(const std::string& id, int ranks, int g) {
  QueuedJob q = Job(id, ranks);
  q.spec.mutable_model()->mutable_moe()->set_experts(8);
  q.spec.mutable_parallelism()->set_expert_parallel(g);
  return q;
}

IdleWorker R(const std::string& id, const std::string& host, int launcher_rank,
             const std::string& rack) {
  IdleWorker w = W(id, host, launcher_rank);
  w.rack = rack;
  return w;
}

std::vector<std::string> RacksOf(const Placement& p) {
  std::vector<std::string> out;
  for (const IdleWorker& w : p.ranks) out.push_back(w.rack);
  return out;
}

// Labels interleaved with hosts: the ranks of each domain still share one label, domain 0
// on the first label, and the order inside a domain is (host, launcher rank).
TEST(SchedulerTest, EachDomainIsPackedOntoOneRackLabel) {
  const std::vector<IdleWorker> idle = {R("w-1", "h1", 0, "a"), R("w-2", "h1", 1, "b"),
                                        R("w-3", "h2", 0, "a"), R("w-4", "h2", 1, "b")};
  std::vector<Placement> p = Schedule({Domains("j-1", 4, 2)}, idle, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].expert_parallel, 2);
  EXPECT_EQ(RacksOf(p[0]), (std::vector<std::string>{"a", "a", "b", "b"}));
  EXPECT_EQ(p[0].ranks[0].worker_id, "w-1");
  EXPECT_EQ(p[0].ranks[1].worker_id, "w-3");
  EXPECT_EQ(p[0].ranks[2].worker_id, "w-2");
  EXPECT_EQ(p[0].ranks[3].worker_id, "w-4");
  EXPECT_TRUE(p[0].note.empty()) << p[0].note;
  // Without domains (G = ranks = 2) the one domain is packed too.
  p = Schedule({Job("j-2", 2)}, idle, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(RacksOf(p[0]), (std::vector<std::string>{"a", "a"}));
}

// Best fit: a domain takes the smallest label that holds it, so a larger one stays whole
// for the next domain or job; unlabeled workers form one group of their own.
TEST(SchedulerTest, DomainsTakeTheSmallestLabelThatHoldsThem) {
  const std::vector<IdleWorker> idle = {R("w-1", "h1", 0, "big"),   R("w-2", "h1", 1, "big"),
                                        R("w-3", "h1", 2, "big"),   R("w-4", "h1", 3, "big"),
                                        R("w-5", "h2", 0, "small"), R("w-6", "h2", 1, "small"),
                                        R("w-7", "h3", 0, ""),      R("w-8", "h3", 1, "")};
  // j-1: one domain of 2 takes a 2-worker group ("" sorts first); j-2: 2 x 2 takes "small"
  // and 2 of "big"; j-3: one domain of 2 takes the rest of "big", unmixed.
  std::vector<Placement> p =
      Schedule({Domains("j-1", 2, 2), Domains("j-2", 4, 2), Domains("j-3", 2, 2)}, idle, 0);
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(RacksOf(p[0]), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(RacksOf(p[1]), (std::vector<std::string>{"small", "small", "big", "big"}));
  EXPECT_EQ(RacksOf(p[2]), (std::vector<std::string>{"big", "big"}));
  for (const Placement& placed : p) EXPECT_TRUE(placed.note.empty()) << placed.note;
}

// No label has G free workers: the domain mixes labels (the largest groups first, so as
// few as possible), after the domains that fit, and the note says which and why.
TEST(SchedulerTest, ADomainNoLabelHoldsMixesLabelsAndSaysSo) {
  const std::vector<IdleWorker> idle = {R("w-1", "h1", 0, "a"), R("w-2", "h1", 1, "a"),
                                        R("w-3", "h2", 0, "b"), R("w-4", "h3", 0, "c"),
                                        R("w-5", "h3", 1, "c"), R("w-6", "h4", 0, "")};
  // 3 domains of 2: a and c hold one each; the third mixes b and the unlabeled worker.
  std::vector<Placement> p = Schedule({Domains("j-1", 6, 2)}, idle, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(RacksOf(p[0]), (std::vector<std::string>{"a", "a", "c", "c", "", "b"}));
  EXPECT_EQ(p[0].note,
            "placement: domain 2 spans racks (unlabeled), b (no rack label had 2 free workers; "
            "free: (unlabeled): 1, b: 1); its expert-parallel traffic crosses racks");
  // Too few workers in all: the job waits (and holds the queue), as without labels.
  EXPECT_TRUE(Schedule({Domains("j-1", 8, 2), Job("j-2", 1)}, idle, 0).empty());
  // One domain wider than any label: mixed, starting with the largest label.
  p = Schedule({Domains("j-3", 4, 4)},
               {R("w-1", "h1", 0, "a"), R("w-2", "h2", 0, "b"), R("w-3", "h2", 1, "b"),
                R("w-4", "h2", 2, "b")},
               0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(RacksOf(p[0]), (std::vector<std::string>{"b", "b", "b", "a"}));
  EXPECT_NE(p[0].note.find("domain 0 spans racks b, a"), std::string::npos) << p[0].note;
}

// The channel filter comes before the labels: a label whose workers lack the channel does
// not count.
TEST(SchedulerTest, LabelsCountOnlyWorkersWithTheJobsChannel) {
  std::vector<IdleWorker> idle = {R("w-1", "h1", 0, "a"), R("w-2", "h1", 1, "a"),
                                  R("w-3", "h2", 0, "b"), R("w-4", "h2", 1, "b")};
  idle[0].channels = {"gloo", "nccl"};
  idle[2].channels = {"gloo", "nccl"};
  idle[3].channels = {"gloo", "nccl"};
  QueuedJob j = Domains("j-1", 2, 2);
  j.spec.mutable_resources()->set_channel("nccl");
  std::vector<Placement> p = Schedule({j}, idle, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(RacksOf(p[0]), (std::vector<std::string>{"b", "b"}));
}

}  // namespace
}  // namespace rackrun::coordinator
