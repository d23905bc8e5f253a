#include "stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#include <xmmintrin.h>
#define PYSHMCKPT_STREAMING_STORES 1
#endif

namespace pyshmckpt {

void stream_copy(void* dst, const void* src, std::size_t n) {
#ifdef PYSHMCKPT_STREAMING_STORES
  constexpr std::size_t kLine = 64;
  auto* d = static_cast<std::uint8_t*>(dst);
  const auto* s = static_cast<const std::uint8_t*>(src);
  // Up to the destination's first line boundary with memcpy; too short to be worth streaming too.
  std::size_t head = (kLine - reinterpret_cast<std::uintptr_t>(d) % kLine) % kLine;
  if (n < head + kLine) {
    std::memcpy(d, s, n);
    return;
  }
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const std::size_t lines = n / kLine;
  for (std::size_t i = 0; i < lines; ++i, d += kLine, s += kLine) {
    // Read ahead without keeping the source in the outer caches either (the caller's working set,
    // a Python interpreter's objects, stays there).
    _mm_prefetch(reinterpret_cast<const char*>(s) + 8 * kLine, _MM_HINT_NTA);
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before returning
  std::memcpy(d, s, n % kLine);
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace pyshmckpt
