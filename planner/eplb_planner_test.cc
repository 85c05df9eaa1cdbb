#include "planner/eplb_planner.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "planner/invariants.h"
#include "planner/plan.h"
#include "planner/planner.h"

namespace rackrun::planner {
namespace {

struct EplbGolden {
  std::string name;
  int physical;
  int gpus;
  std::vector<float> weight;
  std::vector<int32_t> phy_to_log;
  std::vector<int32_t> phy_rank;
  std::vector<int32_t> log_count;
};

// Generated once by running DeepSeek's published eplb.py (github deepseek-ai/EPLB, commit
// 57919718) under torch 1.13.0a0 with rebalance_experts(w[None], physical, 1, 1, gpus).
const std::vector<EplbGolden> kGoldens = {
    {"random_ints",
     12,
     4,
     {0x1.3c00000000000p+6f, 0x1.0000000000000p+5f, 0x1.7800000000000p+6f, 0x1.6800000000000p+5f,
      0x1.6000000000000p+6f, 0x1.7800000000000p+6f, 0x1.4c00000000000p+6f, 0x1.0c00000000000p+6f},
     {0, 4, 1, 7, 3, 6, 2, 2, 4, 5, 5, 6},
     {0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 1, 0},
     {1, 1, 2, 1, 2, 2, 2, 1}},
    {"ties",
     12,
     4,
     {0x1.4000000000000p+2f, 0x1.4000000000000p+2f, 0x1.4000000000000p+2f, 0x1.4000000000000p+2f,
      0x1.0000000000000p+0f, 0x1.0000000000000p+0f, 0x1.0000000000000p+0f, 0x1.0000000000000p+0f},
     {0, 0, 4, 1, 1, 5, 2, 2, 6, 3, 3, 7},
     {0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0},
     {2, 2, 2, 2, 1, 1, 1, 1}},
    {"all_zero",
     12,
     4,
     {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f},
     {0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0},
     {0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4},
     {5, 1, 1, 1, 1, 1, 1, 1}},
    {"one_hot",
     24,
     4,
     {0x1.f400000000000p+9f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f,
      0.0f, 0.0f, 0.0f},
     {0, 0, 0, 3, 2, 1, 0, 0, 12, 15, 14, 13, 0, 0, 11, 10, 9, 8, 0, 0, 7, 6, 5, 4},
     {8, 4, 0, 0, 0, 0, 7, 3, 0, 0, 0, 0, 6, 2, 0, 0, 0, 0, 5, 1, 0, 0, 0, 0},
     {9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}},
    {"no_slots",
     16,
     4,
     {0x1.0000000000000p+0f, 0x1.d000000000000p+4f, 0x1.8800000000000p+5f, 0x1.e000000000000p+3f,
      0x1.4800000000000p+5f, 0x1.8000000000000p+1f, 0x1.4000000000000p+3f, 0x1.c000000000000p+2f,
      0x1.7000000000000p+4f, 0x1.e000000000000p+4f, 0x1.e000000000000p+3f, 0x1.8000000000000p+4f,
      0x1.1000000000000p+5f, 0x1.8000000000000p+2f, 0x1.2000000000000p+5f, 0x1.e000000000000p+3f},
     {2, 8, 6, 0, 4, 11, 10, 13, 14, 1, 15, 5, 12, 9, 3, 7},
     {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
     {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}},
    {"one_per_gpu",
     4,
     4,
     {0x1.8000000000000p+1f, 0x1.0000000000000p+0f, 0x1.0000000000000p+1f, 0.0f},
     {0, 1, 2, 3},
     {0, 0, 0, 0},
     {1, 1, 1, 1}},
    {"ep16_zipf",
     96,
     16,
     {0x1.044f200000000p+7f,  0x1.e796500000000p+7f, 0x1.9faafa0000000p+5f,  0x1.bdb8ce0000000p+9f,
      0x1.2f91940000000p+7f,  0x1.1d57320000000p+9f, 0x1.641cc80000000p+5f,  0x1.7169d80000000p+5f,
      0x1.31d20c0000000p+10f, 0x1.52aecc0000000p+6f, 0x1.24f9280000000p+8f,  0x1.6d562c0000000p+8f,
      0x1.84acca0000000p+6f,  0x1.b46f6c0000000p+6f, 0x1.c6ef560000000p+6f,  0x1.455b5a0000000p+8f,
      0x1.f1a41a0000000p+5f,  0x1.4130720000000p+7f, 0x1.57b25a0000000p+5f,  0x1.0a3b720000000p+8f,
      0x1.cf89840000000p+5f,  0x1.13a65a0000000p+6f, 0x1.8406000000000p+7f,  0x1.1b3d560000000p+6f,
      0x1.7fb2400000000p+5f,  0x1.786cf40000000p+5f, 0x1.5dfd3a0000000p+6f,  0x1.f0ce8e0000000p+6f,
      0x1.bb2ece0000000p+5f,  0x1.fe189a0000000p+5f, 0x1.115a8e0000000p+7f,  0x1.e5c1020000000p+5f,
      0x1.05947e0000000p+6f,  0x1.480dc60000000p+6f, 0x1.3e0b420000000p+6f,  0x1.da65bc0000000p+5f,
      0x1.1fb4b40000000p+7f,  0x1.5dcca60000000p+5f, 0x1.2bae1e0000000p+6f,  0x1.a0924e0000000p+7f,
      0x1.51cb460000000p+5f,  0x1.97355e0000000p+5f, 0x1.0000000000000p+12f, 0x1.233d120000000p+6f,
      0x1.a3520c0000000p+6f,  0x1.b1a2280000000p+5f, 0x1.ddb6800000000p+10f, 0x1.873d680000000p+5f,
      0x1.e1ac3c0000000p+8f,  0x1.c16aa60000000p+7f, 0x1.dafdda0000000p+6f,  0x1.0c70660000000p+6f,
      0x1.76e7de0000000p+6f,  0x1.9371660000000p+6f, 0x1.6aa5840000000p+5f,  0x1.6a09e60000000p+6f,
      0x1.9fdf8c0000000p+8f,  0x1.6afdc20000000p+7f, 0x1.5cb5760000000p+9f,  0x1.c524560000000p+5f,
      0x1.a878220000000p+5f,  0x1.8f125e0000000p+5f, 0x1.3499fc0000000p+6f,  0x1.54df000000000p+7f},
     {3,  8,  1,  44, 33, 47, 3,  8,  48, 14, 43, 60, 3,  8,  48, 13, 38, 59, 10, 8,
      8,  50, 21, 2,  42, 42, 57, 36, 29, 25, 42, 42, 63, 15, 31, 37, 42, 5,  11, 17,
      35, 40, 42, 5,  11, 4,  16, 7,  42, 46, 58, 52, 62, 45, 42, 46, 58, 55, 9,  24,
      42, 46, 49, 53, 34, 41, 42, 46, 39, 27, 23, 28, 42, 46, 56, 30, 32, 54, 42, 46,
      56, 0,  51, 61, 42, 46, 22, 15, 20, 18, 42, 19, 58, 12, 26, 6},
     {0,  3,  0, 0, 0, 0, 2,  1, 0, 0, 0, 0, 1,  0, 1, 0, 0, 0, 0, 2, 4, 0, 0, 0,
      4,  13, 0, 0, 0, 0, 7,  0, 0, 0, 0, 0, 6,  1, 0, 0, 0, 0, 8, 0, 1, 0, 0, 0,
      5,  3,  2, 0, 0, 0, 9,  4, 1, 0, 0, 0, 10, 2, 0, 0, 0, 0, 3, 5, 0, 0, 0, 0,
      11, 1,  0, 0, 0, 0, 12, 6, 1, 0, 0, 0, 2,  0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0},
     {1, 1, 1, 3, 1, 2, 1, 1, 5, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 1, 1,  1,
      1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 14, 1,
      1, 1, 7, 1, 2, 1, 1, 1, 1, 1, 1, 1, 2, 1, 3, 1, 1, 1, 1, 1}},
    {"ep64_zipf_mean",
     384,
     64,
     {0x1.e757ce0000000p+9f,  0x1.cfb1260000000p+6f,  0x1.6cef1a0000000p+7f,
      0x1.da27f00000000p+6f,  0x1.f4a0c40000000p+6f,  0x1.164e560000000p+7f,
      0x1.eccdd20000000p+7f,  0x1.2ef5c20000000p+7f,  0x1.7488520000000p+9f,
      0x1.0ae2d00000000p+8f,  0x1.c41c280000000p+9f,  0x1.4758100000000p+7f,
      0x1.263e760000000p+7f,  0x1.6f6b440000000p+8f,  0x1.58b0e60000000p+8f,
      0x1.fedb220000000p+6f,  0x1.c0e1480000000p+6f,  0x1.a5dac00000000p+9f,
      0x1.1a1e360000000p+7f,  0x1.d4fae20000000p+7f,  0x1.b46df40000000p+9f,
      0x1.f6a3d80000000p+6f,  0x1.ead2f20000000p+6f,  0x1.0816880000000p+7f,
      0x1.84a6660000000p+7f,  0x1.e521ca0000000p+6f,  0x1.2efe140000000p+9f,
      0x1.4888320000000p+8f,  0x1.caa3d80000000p+6f,  0x1.8f45600000000p+8f,
      0x1.13d3740000000p+7f,  0x1.06072c0000000p+8f,  0x1.2fd19a0000000p+10f,
      0x1.ecc0840000000p+6f,  0x1.3b77ce0000000p+7f,  0x1.dca5600000000p+7f,
      0x1.5068320000000p+8f,  0x1.3628b40000000p+9f,  0x1.296bc60000000p+8f,
      0x1.b592b00000000p+8f,  0x1.03ab440000000p+8f,  0x1.33143a0000000p+8f,
      0x1.c666660000000p+7f,  0x1.8221ca0000000p+7f,  0x1.d320c40000000p+6f,
      0x1.0a599a0000000p+7f,  0x1.2214fe0000000p+7f,  0x1.ddc18a0000000p+6f,
      0x1.1e0ac00000000p+7f,  0x1.7fb0c40000000p+9f,  0x1.0936c80000000p+7f,
      0x1.cbcd920000000p+8f,  0x1.abed920000000p+7f,  0x1.7d33340000000p+7f,
      0x1.4071aa0000000p+7f,  0x1.547efa0000000p+8f,  0x1.d13df40000000p+7f,
      0x1.491e360000000p+7f,  0x1.b23c6a0000000p+7f,  0x1.45a0000000000p+9f,
      0x1.cc4fe00000000p+6f,  0x1.125fbe0000000p+13f, 0x1.8733b60000000p+7f,
      0x1.1b69780000000p+7f,  0x1.7ac8320000000p+7f,  0x1.2c91680000000p+8f,
      0x1.31fcee0000000p+7f,  0x1.2163860000000p+10f, 0x1.2374bc0000000p+7f,
      0x1.796ccc0000000p+8f,  0x1.17e7ae0000000p+8f,  0x1.dc00000000000p+8f,
      0x1.4ae9fc0000000p+7f,  0x1.eeb22e0000000p+6f,  0x1.e495820000000p+7f,
      0x1.35147a0000000p+7f,  0x1.7cedf40000000p+10f, 0x1.dbf2b00000000p+6f,
      0x1.b59ea80000000p+10f, 0x1.bdb8520000000p+6f,  0x1.06f8d40000000p+7f,
      0x1.e16a7e0000000p+6f,  0x1.601cac0000000p+7f,  0x1.d3c0c40000000p+8f,
      0x1.56d0840000000p+9f,  0x1.f553740000000p+7f,  0x1.524dd20000000p+7f,
      0x1.616ac00000000p+8f,  0x1.a7f8520000000p+8f,  0x1.282aa00000000p+9f,
      0x1.b576c80000000p+7f,  0x1.2a89380000000p+7f,  0x1.c5b43a0000000p+6f,
      0x1.3db18a0000000p+9f,  0x1.4e90e60000000p+7f,  0x1.39e4de0000000p+8f,
      0x1.cdfefa0000000p+6f,  0x1.30774c0000000p+7f,  0x1.18d6040000000p+7f,
      0x1.e11fb60000000p+11f, 0x1.d861480000000p+6f,  0x1.a2d1ec0000000p+7f,
      0x1.fe29fc0000000p+7f,  0x1.e703120000000p+6f,  0x1.4c6b860000000p+8f,
      0x1.e48f1a0000000p+8f,  0x1.0000000000000p+14f, 0x1.20620c0000000p+8f,
      0x1.7459dc0000000p+8f,  0x1.bf4bc60000000p+6f,  0x1.0fefe00000000p+8f,
      0x1.0876240000000p+10f, 0x1.5e11680000000p+7f,  0x1.3fdb640000000p+10f,
      0x1.6026660000000p+9f,  0x1.f6b1680000000p+8f,  0x1.6f2b020000000p+7f,
      0x1.bf76460000000p+7f,  0x1.688d500000000p+7f,  0x1.98504a0000000p+11f,
      0x1.36a6ea0000000p+7f,  0x1.d4dd300000000p+6f,  0x1.1030a40000000p+7f,
      0x1.d9446a0000000p+10f, 0x1.2611160000000p+12f, 0x1.26578e0000000p+8f,
      0x1.6a09dc0000000p+9f,  0x1.c8fbe80000000p+6f,  0x1.5a0d500000000p+7f,
      0x1.20b8d40000000p+7f,  0x1.65feea0000000p+10f, 0x1.1b79160000000p+11f,
      0x1.0189380000000p+7f,  0x1.5621ca0000000p+7f,  0x1.622e980000000p+7f,
      0x1.898fe00000000p+8f,  0x1.df93740000000p+6f,  0x1.0dd26e0000000p+7f,
      0x1.8f13740000000p+7f,  0x1.73b8d40000000p+7f,  0x1.a17f3c0000000p+8f,
      0x1.65f5400000000p+8f,  0x1.9733f80000000p+10f, 0x1.51cb440000000p+10f,
      0x1.98451e0000000p+9f,  0x1.ed73340000000p+8f,  0x1.7cf8560000000p+12f,
      0x1.23547a0000000p+8f,  0x1.1455500000000p+10f, 0x1.1cb8520000000p+7f,
      0x1.3386a80000000p+7f,  0x1.2d78520000000p+7f,  0x1.c421ca0000000p+8f,
      0x1.506c8c0000000p+7f,  0x1.f106a80000000p+7f,  0x1.6666ea0000000p+7f,
      0x1.5434bc0000000p+7f,  0x1.91c6a80000000p+7f,  0x1.150f5c0000000p+7f,
      0x1.9a1c280000000p+7f,  0x1.44bd300000000p+8f,  0x1.3d6c4a0000000p+8f,
      0x1.af0eda0000000p+7f,  0x1.f2a2d00000000p+6f,  0x1.58147a0000000p+7f,
      0x1.03ae980000000p+7f,  0x1.0b7efa0000000p+7f,  0x1.aea8720000000p+8f,
      0x1.43db220000000p+7f,  0x1.a8d8940000000p+7f,  0x1.383d700000000p+7f,
      0x1.7865e40000000p+7f,  0x1.716e140000000p+7f,  0x1.1d7f3c0000000p+8f,
      0x1.27a8f60000000p+7f,  0x1.c2e6ea0000000p+7f,  0x1.4223d80000000p+7f,
      0x1.1f5fbe0000000p+7f,  0x1.129a1c0000000p+7f,  0x1.f0a7f00000000p+6f,
      0x1.9fdfbe0000000p+7f,  0x1.5cfefa0000000p+8f,  0x1.a5cf5c0000000p+7f,
      0x1.8405e40000000p+8f,  0x1.89ca3e0000000p+7f,  0x1.45970a0000000p+7f,
      0x1.bc13740000000p+7f,  0x1.2bfe760000000p+7f,  0x1.f9b43a0000000p+7f,
      0x1.1b71680000000p+9f,  0x1.1790620000000p+7f,  0x1.1163d80000000p+7f,
      0x1.1aac080000000p+8f,  0x1.6447ae0000000p+7f,  0x1.fab6460000000p+6f,
      0x1.029aa00000000p+7f,  0x1.c7570a0000000p+6f,  0x1.e8a8720000000p+7f,
      0x1.c9f43a0000000p+7f,  0x1.00278e0000000p+9f,  0x1.04c49c0000000p+7f,
      0x1.3d1ba60000000p+7f,  0x1.9483960000000p+7f,  0x1.c279dc0000000p+6f,
      0x1.e343960000000p+6f,  0x1.e8e9780000000p+6f,  0x1.4dfc8c0000000p+9f,
      0x1.0a60c40000000p+9f,  0x1.2fc9780000000p+8f,  0x1.c415820000000p+6f,
      0x1.636b7c0000000p+11f, 0x1.9b3aa00000000p+8f,  0x1.9528320000000p+8f,
      0x1.0529160000000p+9f,  0x1.760b440000000p+7f,  0x1.1580e60000000p+9f,
      0x1.8c69fc0000000p+7f,  0x1.e0947a0000000p+7f,  0x1.086eda0000000p+8f,
      0x1.36726e0000000p+8f,  0x1.b8be760000000p+7f,  0x1.128a3e0000000p+8f,
      0x1.3b2c4a0000000p+11f, 0x1.f8ab020000000p+6f,  0x1.d69cac0000000p+6f,
      0x1.6a9f7c0000000p+8f,  0x1.9cf8520000000p+7f,  0x1.cd91680000000p+7f,
      0x1.7fa6660000000p+7f,  0x1.0d63120000000p+8f,  0x1.974ac00000000p+7f,
      0x1.fcc6a80000000p+6f,  0x1.29170a0000000p+7f,  0x1.0f00000000000p+7f,
      0x1.015aa00000000p+8f,  0x1.4cba5e0000000p+7f,  0x1.d8c7ae0000000p+7f,
      0x1.21a8520000000p+9f,  0x1.39d8940000000p+7f,  0x1.6abae20000000p+7f,
      0x1.01d3f00000000p+11f, 0x1.d1676c0000000p+6f,  0x1.bcba1c0000000p+8f,
      0x1.5c0bc60000000p+7f,  0x1.7ea5a20000000p+8f,  0x1.4109780000000p+8f,
      0x1.007a5e0000000p+7f,  0x1.3ec49c0000000p+7f,  0x1.0ca76c0000000p+7f,
      0x1.24d78e0000000p+7f,  0x1.0fd20c0000000p+9f,  0x1.05ddb20000000p+7f,
      0x1.1531ec0000000p+8f,  0x1.fb3c4a0000000p+9f,  0x1.d5076c0000000p+9f,
      0x1.8b93d80000000p+9f},
     {210, 123, 83,  180, 159, 1,   210, 123, 51,  58,  138, 163, 210, 123, 152, 197, 118, 33,  210,
      123, 10,  6,   155, 81,  210, 254, 254, 182, 230, 224, 131, 130, 143, 74,  239, 4,   131, 130,
      143, 217, 2,   223, 131, 130, 143, 35,  116, 15,  131, 71,  10,  227, 171, 233, 189, 105, 242,
      175, 228, 30,  106, 124, 255, 221, 94,  79,  106, 124, 255, 110, 153, 196, 106, 124, 135, 252,
      57,  127, 106, 124, 183, 192, 72,  203, 106, 124, 67,  237, 187, 158, 106, 124, 67,  237, 91,
      190, 106, 124, 67,  107, 150, 251, 106, 124, 49,  125, 249, 98,  106, 124, 49,  147, 97,  45,
      106, 213, 29,  9,   156, 92,  106, 240, 211, 85,  134, 204, 106, 240, 144, 31,  164, 28,  106,
      240, 144, 40,  128, 44,  106, 240, 212, 229, 86,  16,  106, 199, 140, 56,  214, 166, 106, 76,
      88,  117, 62,  195, 106, 76,  17,  236, 172, 200, 106, 76,  17,  19,  139, 23,  106, 253, 113,
      186, 24,  50,  106, 253, 113, 220, 216, 194, 106, 222, 39,  101, 226, 96,  106, 222, 20,  52,
      184, 246, 106, 222, 20,  169, 202, 77,  106, 222, 167, 90,  157, 25,  106, 222, 113, 198, 64,
      137, 106, 115, 78,  162, 43,  122, 106, 145, 78,  42,  53,  178, 106, 0,   78,  102, 112, 47,
      106, 0,   78,  188, 82,  205, 215, 111, 32,  234, 243, 3,   146, 119, 141, 41,  174, 149, 146,
      119, 87,  37,  66,  80,  146, 119, 114, 219, 120, 132, 146, 119, 114, 37,  238, 21,  146, 119,
      181, 95,  75,  165, 146, 250, 126, 26,  7,   248, 146, 142, 244, 70,  176, 100, 146, 142, 69,
      173, 247, 103, 146, 142, 8,   38,  129, 48,  146, 207, 32,  154, 193, 73,  146, 111, 32,  218,
      133, 209, 148, 61,  104, 59,  168, 121, 148, 119, 8,   89,  68,  63,  99,  61,  14,  161, 34,
      179, 99,  61,  84,  93,  11,  60,  99,  61,  84,  93,  185, 241, 99,  61,  55,  245, 201, 22,
      99,  61,  36,  160, 54,  136, 99,  61,  206, 27,  170, 231, 99,  61,  206, 59,  235, 109, 61,
      61,  108, 89,  46,  177, 61,  61,  13,  65,  12,  5,   61,  61,  225, 26,  151, 191, 61,  61,
      126, 208, 232, 18},
     {1,  1, 0,  0, 0,  0,  2,  2, 0,  0, 0, 0, 3,  0,  0,  0, 0, 0,  4,  3,  1,  0, 0,  0,  0, 0,
      1,  0, 0,  0, 0,  1,  2,  0, 0,  0, 2, 2, 0,  0,  0,  0, 1, 0,  1,  0,  0,  0, 3,  0,  0, 0,
      0,  0, 0,  0, 0,  0,  0,  0, 19, 0, 1, 0, 0,  0,  15, 6, 0, 0,  0,  0,  16, 8, 0,  0,  0, 0,
      25, 4, 0,  0, 0,  0,  5,  2, 2,  0, 0, 0, 1,  3,  0,  1, 0, 0,  21, 5,  1,  0, 0,  0,  2, 1,
      1,  0, 0,  0, 24, 7,  0,  0, 0,  0, 4, 0, 0,  0,  0,  0, 3, 0,  0,  0,  0,  0, 23, 2,  0, 0,
      0,  0, 13, 1, 1,  0,  0,  0, 8,  3, 0, 0, 0,  0,  20, 0, 0, 0,  0,  0,  22, 1, 0,  0,  0, 0,
      14, 0, 1,  0, 0,  0,  18, 2, 0,  0, 0, 0, 27, 0,  2,  0, 0, 0,  17, 1,  0,  0, 0,  0,  9, 0,
      0,  0, 0,  0, 26, 2,  0,  0, 0,  0, 0, 1, 1,  0,  0,  0, 7, 4,  0,  0,  0,  0, 11, 3,  1, 0,
      0,  0, 6,  0, 1,  0,  0,  0, 28, 0, 0, 0, 0,  0,  10, 1, 2, 0,  0,  0,  12, 0, 3,  0,  0, 0,
      0,  1, 2,  0, 0,  0,  6,  2, 0,  0, 0, 0, 8,  3,  0,  0, 0, 0,  2,  1,  0,  0, 0,  0,  7, 0,
      1,  1, 0,  0, 9,  4,  0,  0, 0,  0, 1, 0, 0,  0,  0,  0, 4, 0,  0,  0,  0,  0, 10, 1,  0, 0,
      0,  0, 3,  2, 0,  0,  0,  0, 0,  0, 0, 0, 0,  0,  5,  0, 1, 0,  0,  0,  0,  1, 0,  0,  0, 0,
      1,  5, 1,  0, 0,  0,  0,  0, 0,  0, 0, 0, 4,  15, 0,  1, 0, 0,  3,  14, 1,  0, 0,  0,  2, 6,
      0,  0, 0,  0, 1,  12, 0,  0, 0,  0, 5, 7, 1,  0,  0,  0, 6, 13, 0,  1,  0,  0, 9,  10, 0, 1,
      0,  0, 4,  3, 0,  0,  0,  0, 11, 2, 0, 1, 0,  0,  8,  5, 1, 0,  0,  0},
     {2, 1,  1, 1,  1, 1, 1, 1, 2, 1, 2, 1, 1, 1, 1, 1, 1, 2, 1, 1,  2, 1, 1, 1, 1, 1, 2, 1, 1,
      1, 1,  1, 3,  1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  2, 1, 1, 1, 1, 1, 1, 1, 1,
      1, 2,  1, 16, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 3, 1,  4, 1, 1, 1, 1, 1, 2, 1, 1,
      1, 1,  2, 1,  1, 1, 2, 1, 1, 1, 1, 1, 7, 1, 1, 1, 1, 1, 1, 29, 1, 1, 1, 1, 2, 1, 3, 2, 1,
      1, 1,  1, 6,  1, 1, 1, 4, 9, 1, 2, 1, 1, 1, 3, 4, 1, 1, 1, 1,  1, 1, 1, 1, 1, 1, 3, 3, 2,
      1, 11, 1, 2,  1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  1, 1, 1, 1, 1, 1, 1, 1, 1,
      1, 1,  1, 1,  1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  1, 1, 1, 1, 1, 1, 1, 1, 1,
      1, 1,  1, 2,  1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 5,  1, 1, 1, 1, 1, 1, 1, 1, 1,
      1, 1,  1, 1,  1, 2, 1, 1, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  1, 2, 2, 2}},
    {"ep8_int_ties",
     48,
     8,
     {0x1.4000000000000p+3f, 0x1.e000000000000p+4f, 0x1.4000000000000p+3f, 0x1.4000000000000p+4f,
      0x1.4000000000000p+4f, 0x1.4000000000000p+3f, 0x1.4000000000000p+4f, 0x1.4000000000000p+3f,
      0x1.4000000000000p+3f, 0x1.4000000000000p+3f, 0x1.e000000000000p+4f, 0x1.e000000000000p+4f,
      0x1.4000000000000p+4f, 0x1.4000000000000p+3f, 0x1.4000000000000p+3f, 0x1.4000000000000p+3f,
      0x1.4000000000000p+3f, 0x1.4000000000000p+3f, 0x1.4000000000000p+3f, 0x1.4000000000000p+3f,
      0x1.4000000000000p+3f, 0x1.4000000000000p+4f, 0x1.4000000000000p+4f, 0x1.4000000000000p+3f,
      0x1.e000000000000p+4f, 0x1.e000000000000p+4f, 0x1.e000000000000p+4f, 0x1.4000000000000p+3f,
      0x1.4000000000000p+3f, 0x1.e000000000000p+4f, 0x1.4000000000000p+3f, 0x1.4000000000000p+4f},
     {25, 11, 27, 4,  13, 21, 25, 29, 31, 5, 14, 22, 24, 3,  10, 1, 6,  15, 26, 4,  1,  0, 7,  16,
      29, 6,  31, 12, 8,  17, 11, 10, 30, 1, 9,  18, 24, 12, 22, 2, 10, 19, 26, 21, 28, 3, 23, 20},
     {1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 2, 0, 0, 0, 1, 1, 0, 0, 0,
      0, 1, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0},
     {1, 3, 1, 2, 2, 1, 2, 1, 1, 1, 3, 2, 2, 1, 1, 1,
      1, 1, 1, 1, 1, 2, 2, 1, 2, 2, 2, 1, 1, 2, 1, 2}},
};

TEST(EplbRebalanceTest, MatchesPublishedEplbPy) {
  for (const EplbGolden& golden : kGoldens) {
    SCOPED_TRACE(golden.name);
    const EplbPlacement placement = EplbRebalance(golden.weight, golden.physical, golden.gpus);
    EXPECT_EQ(placement.phy_to_log, golden.phy_to_log);
    EXPECT_EQ(placement.phy_rank, golden.phy_rank);
    EXPECT_EQ(placement.log_count, golden.log_count);
  }
}

TEST(EplbRebalanceTest, RejectsShapesEplbPyAssertsOn) {
  EXPECT_TRUE(EplbRebalance({1, 2, 3, 4}, 6, 4).phy_to_log.empty());  // 6 % 4 != 0
  EXPECT_TRUE(EplbRebalance({1, 2, 3, 4}, 2, 2).phy_to_log.empty());  // fewer physical
  EXPECT_TRUE(EplbRebalance({}, 4, 2).phy_to_log.empty());
}

LoadMatrix Uniform(int ranks, int experts, int64_t value) {
  LoadMatrix loads(ranks, experts);
  for (int64_t& c : loads.counts) c = value;
  return loads;
}

TEST(EplbPlannerTest, FirstMicrobatchIsHomePlacementThenReplansEveryK) {
  const Domain domain{4, 2, 1};
  PlannerOptions options;
  options.eplb_window = 3;
  options.eplb_interval = 2;
  options.expert_bytes = 100;
  EplbPlanner planner(domain, options);
  LoadMatrix hot = Uniform(4, 8, 1);
  for (int src = 0; src < 4; ++src) hot.at(src, 0) = 50;  // expert 0 (rank 0) is hot

  // Microbatch 0: no history, masters only at home.
  absl::StatusOr<Plan> plan = planner.Solve(hot, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_replicas(), 0);
  EXPECT_FALSE(planner.last_replanned());
  EXPECT_EQ(planner.last_replacement_bytes(), 0);
  EXPECT_TRUE(CheckPlanInvariants(domain, hot, *plan).ok());

  // Microbatch 1: first replan, from microbatch 0's loads; expert 0 gets replicas.
  plan = planner.Solve(hot, 0);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(planner.last_replanned());
  EXPECT_GT(plan->first[1] - plan->first[0], 1);
  EXPECT_GT(planner.last_replacement_bytes(), 0);
  EXPECT_EQ(planner.last_replacement_bytes() % 100, 0);
  InvariantOptions relaxed;
  relaxed.masters_at_home = false;
  EXPECT_TRUE(CheckPlanInvariants(domain, hot, *plan, relaxed).ok())
      << CheckPlanInvariants(domain, hot, *plan, relaxed);

  // Microbatch 2 keeps the placement; microbatch 3 replans (1, 1+K, ...), with the same
  // history shape so nothing moves.
  const Plan replanned = *plan;
  plan = planner.Solve(hot, 0);
  EXPECT_FALSE(planner.last_replanned());
  EXPECT_EQ(planner.last_replacement_bytes(), 0);
  EXPECT_EQ(plan->instances, replanned.instances);
  plan = planner.Solve(hot, 0);
  EXPECT_TRUE(planner.last_replanned());
  EXPECT_EQ(planner.last_replacement_bytes(), 0);

  // Layers keep separate histories: a new layer starts at home again.
  plan = planner.Solve(hot, 7);
  EXPECT_EQ(plan->num_replicas(), 0);
}

TEST(EplbPlannerTest, PlansFromThePastNotTheCurrentLoads) {
  const Domain domain{4, 2, 1};
  PlannerOptions options;
  options.eplb_window = 1;
  options.eplb_interval = 1;
  EplbPlanner planner(domain, options);
  LoadMatrix hot0 = Uniform(4, 8, 1);
  LoadMatrix hot7 = Uniform(4, 8, 1);
  for (int src = 0; src < 4; ++src) {
    hot0.at(src, 0) = 100;
    hot7.at(src, 7) = 100;
  }
  ASSERT_TRUE(planner.Solve(hot0, 0).ok());
  // The plan for hot7 is made from hot0's loads: expert 0 is replicated, expert 7 is not.
  absl::StatusOr<Plan> plan = planner.Solve(hot7, 0);
  ASSERT_TRUE(plan.ok());
  EXPECT_GT(plan->first[1] - plan->first[0], 1);
  EXPECT_EQ(plan->first[8] - plan->first[7], 1);
  // Same expected placement as EplbRebalance on the window's mean.
  std::vector<float> weight(8, 4.0f);
  weight[0] = 400.0f;
  const EplbPlacement expected = EplbRebalance(weight, 4 * 3, 4);
  for (int p = 0; p < 12; ++p) {
    const int e = expected.phy_to_log[static_cast<size_t>(p)];
    bool found = false;
    for (int i = plan->first[static_cast<size_t>(e)]; i < plan->first[static_cast<size_t>(e) + 1];
         ++i) {
      found |= plan->instances[static_cast<size_t>(i)].rank == p / 3;
    }
    EXPECT_TRUE(found) << "expert " << e << " on rank " << p / 3;
  }
}

TEST(EplbPlannerTest, EvenSplitMergesReplicasOnOneRank) {
  // One hot expert and 2 slots per rank: eplb.py may place two replicas of it on one GPU.
  const Domain domain{2, 2, 2};
  PlannerOptions options;
  options.eplb_window = 1;
  options.eplb_interval = 1;
  EplbPlanner planner(domain, options);
  LoadMatrix loads(2, 4);
  loads.at(0, 0) = 1001;
  loads.at(1, 0) = 1000;
  ASSERT_TRUE(planner.Solve(loads, 0).ok());
  absl::StatusOr<Plan> plan = planner.Solve(loads, 0);
  ASSERT_TRUE(plan.ok());
  InvariantOptions relaxed;
  relaxed.masters_at_home = false;
  EXPECT_TRUE(CheckPlanInvariants(domain, loads, *plan, relaxed).ok())
      << CheckPlanInvariants(domain, loads, *plan, relaxed);
  // Expert 0 has 5 physical replicas (4 redundant slots all go to it), 2001 tokens: shares
  // 401, 400, 400, 400, 400 summed per rank.
  const std::vector<float> weight = {2001, 0, 0, 0};
  const EplbPlacement placement = EplbRebalance(weight, 8, 2);
  EXPECT_EQ(placement.log_count[0], 5);
  int64_t total = 0;
  for (int i = plan->first[0]; i < plan->first[1]; ++i)
    total += plan->quota[static_cast<size_t>(i)];
  EXPECT_EQ(total, 2001);
  // Two ranks hold the five replicas: two instances, each the sum of its replicas' shares.
  ASSERT_EQ(plan->first[1] - plan->first[0], 2);
  for (int i = plan->first[0]; i < plan->first[1]; ++i) {
    const int64_t quota = plan->quota[static_cast<size_t>(i)];
    EXPECT_TRUE(quota / 400 == 2 || quota / 400 == 3) << quota;
    EXPECT_LE(quota % 400, 1) << quota;
  }
}

TEST(EplbPlannerTest, RejectsLoadsOfAnotherShape) {
  EplbPlanner planner(Domain{4, 2, 1}, PlannerOptions{});
  const absl::StatusOr<Plan> plan = planner.Solve(LoadMatrix(4, 4), 0);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("loads.experts"), std::string::npos);
}

TEST(EplbPlannerTest, RestoredStatePlansLikeTheSavedPlanner) {
  const Domain domain{4, 2, 1};
  PlannerOptions options;
  options.eplb_window = 3;
  options.eplb_interval = 2;
  EplbPlanner original(domain, options);
  // Loads that change every microbatch, on two layers.
  const auto loads_at = [](int m) {
    LoadMatrix l = Uniform(4, 8, 1 + m % 3);
    for (int src = 0; src < 4; ++src) l.at(src, (m / 2) % 8) = 40 + 5 * src;
    return l;
  };
  for (int m = 0; m < 5; ++m) {
    for (int layer : {0, 3}) ASSERT_TRUE(original.Solve(loads_at(m), layer).ok());
  }
  const std::string state = original.SaveState();
  ASSERT_FALSE(state.empty());
  EplbPlanner restored(domain, options);
  ASSERT_TRUE(restored.RestoreState(state).ok()) << restored.RestoreState(state);
  EXPECT_EQ(restored.SaveState(), state);
  for (int m = 5; m < 12; ++m) {
    for (int layer : {0, 3}) {
      absl::StatusOr<Plan> a = original.Solve(loads_at(m), layer);
      absl::StatusOr<Plan> b = restored.Solve(loads_at(m), layer);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(*a, *b) << "microbatch " << m << " layer " << layer;
    }
  }
  // Another domain or other settings: refused, planner unchanged.
  EplbPlanner other(Domain{2, 4, 1}, options);
  absl::Status s = other.RestoreState(state);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("saved for 4 ranks"), std::string::npos) << s;
  EXPECT_TRUE(other.SaveState().size() < state.size());
  PlannerOptions longer = options;
  longer.eplb_window = 4;
  EXPECT_EQ(EplbPlanner(domain, longer).RestoreState(state).code(),
            absl::StatusCode::kFailedPrecondition);
  // Damaged bytes.
  EXPECT_EQ(restored.RestoreState(state.substr(0, state.size() - 8)).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(restored.RestoreState(state + "x").code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(restored.RestoreState("not a state").code(), absl::StatusCode::kDataLoss);
  // Stateless policies save nothing and refuse a state.
  absl::StatusOr<std::unique_ptr<Planner>> ultraep = MakePlanner("ultraep", domain, options);
  ASSERT_TRUE(ultraep.ok());
  EXPECT_TRUE((*ultraep)->SaveState().empty());
  EXPECT_TRUE((*ultraep)->RestoreState("").ok());
  EXPECT_EQ((*ultraep)->RestoreState(state).code(), absl::StatusCode::kFailedPrecondition);
}

// A job's training and evaluation planners checkpoint as one payload: both histories come
// back; a training state alone (what checkpoints held before) leaves the evaluation planner
// fresh; damaged or mismatched payloads change neither planner; stateless policies save "".
TEST(EplbPlannerTest, TrainingAndEvaluationStatesSaveAndRestoreTogether) {
  const Domain domain{4, 2, 1};
  PlannerOptions options;
  options.eplb_window = 3;
  options.eplb_interval = 2;
  const auto loads_at = [](int m, int hot) {
    LoadMatrix l = Uniform(4, 8, 1 + m % 3);
    for (int src = 0; src < 4; ++src) l.at(src, (m / 2 + hot) % 8) = 40 + 5 * src;
    return l;
  };
  EplbPlanner train(domain, options), eval(domain, options);
  for (int m = 0; m < 5; ++m) {
    ASSERT_TRUE(train.Solve(loads_at(m, 0), 0).ok());
    ASSERT_TRUE(eval.Solve(loads_at(m, 3), 0).ok());
  }
  const std::string both = SavePlannerStates(train, eval);
  EplbPlanner train2(domain, options), eval2(domain, options);
  ASSERT_TRUE(RestorePlannerStates(both, train2, eval2).ok());
  EXPECT_EQ(train2.SaveState(), train.SaveState());
  EXPECT_EQ(eval2.SaveState(), eval.SaveState());
  EXPECT_EQ(SavePlannerStates(train2, eval2), both);
  for (int m = 5; m < 9; ++m) {
    EXPECT_EQ(*eval2.Solve(loads_at(m, 3), 0), *eval.Solve(loads_at(m, 3), 0)) << m;
  }

  // A training state alone: the evaluation planner starts fresh.
  EplbPlanner train3(domain, options), eval3(domain, options);
  const std::string fresh = eval3.SaveState();
  ASSERT_TRUE(RestorePlannerStates(train.SaveState(), train3, eval3).ok());
  EXPECT_EQ(train3.SaveState(), train.SaveState());
  EXPECT_EQ(eval3.SaveState(), fresh);

  // Damaged or for other settings: an error, and neither planner changed.
  EplbPlanner train4(domain, options), eval4(domain, options);
  for (const std::string& bad : {both.substr(0, both.size() - 1), both + "x", both.substr(0, 12)}) {
    EXPECT_EQ(RestorePlannerStates(bad, train4, eval4).code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(train4.SaveState(), fresh);
    EXPECT_EQ(eval4.SaveState(), fresh);
  }
  // One part for another window: refused, and the other part not applied (the training
  // planner is rolled back when the evaluation part is the one refused).
  PlannerOptions longer = options;
  longer.eplb_window = 4;
  EplbPlanner other(domain, longer);
  ASSERT_TRUE(other.Solve(loads_at(0, 0), 0).ok());
  for (const std::string& mixed :
       {SavePlannerStates(other, eval), SavePlannerStates(train, other)}) {
    const absl::Status s = RestorePlannerStates(mixed, train4, eval4);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("window 4"), std::string::npos) << s;
    EXPECT_EQ(train4.SaveState(), fresh);
    EXPECT_EQ(eval4.SaveState(), fresh);
  }

  absl::StatusOr<std::unique_ptr<Planner>> a = MakePlanner("ultraep", domain, options);
  absl::StatusOr<std::unique_ptr<Planner>> b = MakePlanner("ultraep", domain, options);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(SavePlannerStates(**a, **b).empty());
  EXPECT_TRUE(RestorePlannerStates("", **a, **b).ok());
}

}  // namespace
}  // namespace rackrun::planner
