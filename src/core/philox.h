// Philox4x32-10 counter-based random numbers (Salmon et al., SC'11; the generator of cuRAND
// and Random123), identical on CPU and GPU. nibble keys every random draw by
// (seed, stream, offset): key = seed (64 bits), counter = (offset lo, offset hi, stream lo,
// stream hi). Each call yields four 32-bit words; philox_word(i) is word i%4 of block i/4.
// Stochastic rounding uses 16-bit half-words instead (formats/e2m1.h: element i takes half-word
// i%8 of block i/8). SR, RHT signs, initialisation and sampling all draw from here.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace nibble {

struct Philox4x32 {
  uint32_t v[4];
};

NIB_HOST_DEVICE void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if NIB_ON_DEVICE
  // One 32x32->64 multiply (IMAD.WIDE.U32) whose halves are the two words: the 64-bit C++ form
  // left 64-bit XORs and masks in the round function for ptxas to narrow.
  asm("{\n\t.reg .b64 p;\n\tmul.wide.u32 p, %2, %3;\n\tmov.b64 {%1, %0}, p;\n\t}" : "=r"(hi), "=r"(lo) : "r"(a), "r"(b));
#else
  uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}

constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;  // the key increments per round

// One Philox4x32 round on (c0, c1, c2, c3) under the round key (k0, k1).
NIB_HOST_DEVICE void philox_round(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  uint32_t hi0, lo0, hi1, lo1;
  philox_mulhilo(kM0, c0, hi0, lo0);
  philox_mulhilo(kM1, c2, hi1, lo1);
  c0 = hi1 ^ c1 ^ k0;
  c1 = lo1;
  c2 = hi0 ^ c3 ^ k1;
  c3 = lo0;
}

// The raw generator: 10 rounds of Philox4x32 on `counter` under `key`.
NIB_HOST_DEVICE Philox4x32 philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
  uint32_t c0 = counter.v[0], c1 = counter.v[1], c2 = counter.v[2], c3 = counter.v[3];
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    philox_round(c0, c1, c2, c3, key0, key1);
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// The ten round keys of a 64-bit key (round r: the key plus r times (W0, W1)), for callers that
// compute them once: a CUDA kernel that takes them as a parameter reads each from its parameter
// space as an operand of the round's XOR instead of recomputing the schedule per call.
struct PhiloxRoundKeys {
  uint32_t k0[10], k1[10];
};
NIB_HOST_DEVICE PhiloxRoundKeys philox_round_keys(uint64_t seed) {
  PhiloxRoundKeys keys{};
  uint32_t key0 = static_cast<uint32_t>(seed), key1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    keys.k0[round] = key0;
    keys.k1[round] = key1;
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  return keys;
}
// philox4x32_10(counter, seed lo, seed hi) from the seed's round keys.
NIB_HOST_DEVICE Philox4x32 philox4x32_10(Philox4x32 counter, const PhiloxRoundKeys& keys) {
  uint32_t c0 = counter.v[0], c1 = counter.v[1], c2 = counter.v[2], c3 = counter.v[3];
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) philox_round(c0, c1, c2, c3, keys.k0[round], keys.k1[round]);
  return Philox4x32{{c0, c1, c2, c3}};
}

// The counter of block `offset` of `stream`.
NIB_HOST_DEVICE Philox4x32 philox_counter(uint64_t stream, uint64_t offset) {
  return Philox4x32{{static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                     static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
}

// Four random words for block `offset` of `stream` under `seed`.
NIB_HOST_DEVICE Philox4x32 philox_block(uint64_t seed, uint64_t stream, uint64_t offset) {
  return philox4x32_10(philox_counter(stream, offset), static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// Uniform in [0, 1) with 24 random bits; exact in binary32: (word >> 8) * 2^-24.
NIB_HOST_DEVICE float u32_to_uniform(uint32_t word) {
  return static_cast<float>(word >> 8) * 5.9604644775390625e-08f;
}

// The random word for element `index` of `stream` (word index%4 of block index/4).
NIB_HOST_DEVICE uint32_t philox_word(uint64_t seed, uint64_t stream, uint64_t index) {
  Philox4x32 r = philox_block(seed, stream, index >> 2);
  return r.v[index & 3];
}

NIB_HOST_DEVICE float philox_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return u32_to_uniform(philox_word(seed, stream, index));
}

// A sequential host-side generator over one (seed, stream): for sampling, data shuffling and
// initialisation. Its state is (seed, stream, position), so it can be saved and restored.
class PhiloxStream {
 public:
  PhiloxStream(uint64_t seed = 0, uint64_t stream = 0, uint64_t position = 0)
      : seed_(seed), stream_(stream), position_(position) {}
  uint32_t next_u32() { return philox_word(seed_, stream_, position_++); }
  uint64_t next_u64() {
    uint64_t hi = next_u32();
    return (hi << 32) | next_u32();
  }
  float next_uniform() { return u32_to_uniform(next_u32()); }
  // Uniform double in [0, 1) with 53 random bits.
  double next_uniform_double() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Standard normal (Box-Muller on two uniform doubles).
  double next_normal();
  // Uniform integer in [0, n), n > 0 (rejection-free multiply-shift; bias < 2^-32 * n).
  uint64_t next_below(uint64_t n) { return static_cast<uint64_t>((static_cast<unsigned __int128>(next_u64()) * n) >> 64); }

  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }
  uint64_t position() const { return position_; }
  void set_position(uint64_t p) { position_ = p; }

 private:
  uint64_t seed_, stream_, position_;
};

}  // namespace nibble
