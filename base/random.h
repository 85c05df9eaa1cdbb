// The one pseudo-random generator: xoshiro256** (Blackman and Vigna) with SplitMix64
// seeding. A fixed algorithm with our own integer and real mappings (never std::
// distributions, whose output differs between standard libraries), so a seed gives the
// same stream on every platform; the whole state is four words, which is what a
// checkpoint stores.
#ifndef RACKRUN_BASE_RANDOM_H_
#define RACKRUN_BASE_RANDOM_H_

#include <array>
#include <cstddef>
#include <cstdint>

namespace rackrun::base {

// The SplitMix64 finaliser of `z + golden ratio`: a bijective 64-bit mix; successive
// calls on a counter give SplitMix64's stream.
inline uint64_t SplitMix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

class Xoshiro256 {
 public:
  using State = std::array<uint64_t, 4>;

  // State words = SplitMix64 of seed + i * golden ratio, i = 0..3 (consecutive outputs of
  // a SplitMix64 counter started at `seed`): never all zero.
  static Xoshiro256 FromSeed(uint64_t seed) {
    State s{};
    for (size_t i = 0; i < s.size(); ++i) s[i] = SplitMix64(seed + i * 0x9e3779b97f4a7c15ULL);
    return Xoshiro256(s);
  }
  // State words = SplitMix64 applied repeatedly (w0 = mix(seed), w1 = mix(w0), ...): the
  // planner's load generators were seeded this way; kept so their streams do not change.
  static Xoshiro256 FromSeedChained(uint64_t seed) {
    State s{};
    for (uint64_t& word : s) word = seed = SplitMix64(seed);
    return Xoshiro256(s);
  }
  explicit Xoshiro256(const State& state) : s_(state) {}

  uint64_t Next() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, 1) with 53 random bits.
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n), n > 0, unbiased: draws below 2^64 mod n are rejected.
  uint64_t Below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    while (true) {
      const uint64_t x = Next();
      if (x >= threshold) return x % n;
    }
  }

  const State& state() const { return s_; }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  State s_;
};

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_RANDOM_H_
