// Test helpers: zstd / xz compression of in-memory data (libzstd, liblzma).
#pragma once

#include <lzma.h>
#include <zstd.h>

#include <string>

namespace ptk::testing {

// With a content checksum, as the zstd command line writes by default.
inline std::string ZstdCompress(const std::string& in, int level = 3) {
  std::string out(ZSTD_compressBound(in.size()), '\0');
  ZSTD_CCtx* c = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 1);
  size_t n = ZSTD_compress2(c, out.data(), out.size(), in.data(), in.size());
  ZSTD_freeCCtx(c);
  out.resize(ZSTD_isError(n) ? 0 : n);
  return out;
}

inline std::string XzCompress(const std::string& in, uint32_t preset = 6) {
  std::string out(lzma_stream_buffer_bound(in.size()), '\0');
  size_t pos = 0;
  lzma_ret r = lzma_easy_buffer_encode(preset, LZMA_CHECK_CRC64, nullptr, reinterpret_cast<const uint8_t*>(in.data()),
                                       in.size(), reinterpret_cast<uint8_t*>(out.data()), &pos, out.size());
  out.resize(r == LZMA_OK ? pos : 0);
  return out;
}

}  // namespace ptk::testing
