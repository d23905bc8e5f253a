#include "checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define PYSHMCKPT_CRC_X86 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define PYSHMCKPT_CRC_ARM 1
#endif

namespace pyshmckpt {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    table[i] = c;
  }
  return table;
}

std::uint32_t multiply_mod_p(std::uint32_t a, std::uint32_t b) noexcept;
std::uint32_t power_of_bytes(std::uint64_t nbytes) noexcept;

std::uint32_t crc32c_software(const std::uint8_t* p, std::size_t n, std::uint32_t c) noexcept {
  static const std::array<std::uint32_t, 256> table = make_table();
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(PYSHMCKPT_CRC_X86)
// Bytes per lane of the three-lane loop: one crc32 instruction takes 3 cycles but a new one can
// start every cycle, so three independent lanes run about three times as fast as one chain.
constexpr std::size_t kLane = 16u << 10;

__attribute__((target("sse4.2"))) std::uint32_t crc32c_hw(const std::uint8_t* p, std::size_t n,
                                                          std::uint32_t c) noexcept {
  if (n >= 3 * kLane) {
    // The register after A followed by B, from state s: shift(crc(A from s), |B|) ^ crc(B from 0).
    static const std::uint32_t shift1 = power_of_bytes(kLane);
    static const std::uint32_t shift2 = power_of_bytes(2 * kLane);
    do {
      std::uint64_t a = c, b = 0, d = 0;
      for (std::size_t i = 0; i < kLane; i += 8) {
        std::uint64_t va, vb, vd;
        std::memcpy(&va, p + i, 8);
        std::memcpy(&vb, p + kLane + i, 8);
        std::memcpy(&vd, p + 2 * kLane + i, 8);
        a = _mm_crc32_u64(a, va);
        b = _mm_crc32_u64(b, vb);
        d = _mm_crc32_u64(d, vd);
      }
      c = multiply_mod_p(shift2, static_cast<std::uint32_t>(a)) ^
          multiply_mod_p(shift1, static_cast<std::uint32_t>(b)) ^ static_cast<std::uint32_t>(d);
      p += 3 * kLane;
      n -= 3 * kLane;
    } while (n >= 3 * kLane);
  }
  std::uint64_t c64 = c;
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
    p += 8;
    n -= 8;
  }
  c = static_cast<std::uint32_t>(c64);
  while (n-- > 0) c = _mm_crc32_u8(c, *p++);
  return c;
}
bool detect_hardware() noexcept { return __builtin_cpu_supports("sse4.2"); }
#elif defined(PYSHMCKPT_CRC_ARM)
std::uint32_t crc32c_hw(const std::uint8_t* p, std::size_t n, std::uint32_t c) noexcept {
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c = __crc32cd(c, v);
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = __crc32cb(c, *p++);
  return c;
}
bool detect_hardware() noexcept { return true; }
#else
std::uint32_t crc32c_hw(const std::uint8_t* p, std::size_t n, std::uint32_t c) noexcept {
  return crc32c_software(p, n, c);
}
bool detect_hardware() noexcept { return false; }
#endif

// a * b modulo the polynomial, bit-reflected (zlib's multmodp).
std::uint32_t multiply_mod_p(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t m = 1u << 31;
  std::uint32_t p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) modulo the polynomial for k in [0, 72): enough for any 64-bit length in bytes.
std::array<std::uint32_t, 72> make_powers() {
  std::array<std::uint32_t, 72> powers{};
  std::uint32_t p = 1u << 30;  // x^1
  for (auto& power : powers) {
    power = p;
    p = multiply_mod_p(p, p);
  }
  return powers;
}

// x^(8 * nbytes) modulo the polynomial: multiplying a CRC register by it appends nbytes zeros.
std::uint32_t power_of_bytes(std::uint64_t nbytes) noexcept {
  static const std::array<std::uint32_t, 72> powers = make_powers();
  std::uint32_t shift = 1u << 31;  // x^0
  unsigned k = 3;                  // 8 bits a byte
  for (std::uint64_t n = nbytes; n != 0; n >>= 1, ++k) {
    if (n & 1) shift = multiply_mod_p(powers[k], shift);
  }
  return shift;
}

}  // namespace

std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t len_b) noexcept {
  return multiply_mod_p(power_of_bytes(len_b), crc_a) ^ crc_b;
}

bool crc32c_hardware() noexcept {
  static const bool hardware = detect_hardware();
  return hardware;
}

std::uint32_t crc32c(const void* data, std::size_t nbytes, std::uint32_t crc) noexcept {
  const auto* p = static_cast<const std::uint8_t*>(data);
  std::uint32_t c = ~crc;
  c = crc32c_hardware() ? crc32c_hw(p, nbytes, c) : crc32c_software(p, nbytes, c);
  return ~c;
}

}  // namespace pyshmckpt
