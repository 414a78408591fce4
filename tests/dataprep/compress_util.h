// Test helpers: zstd / xz / gzip compression of in-memory data (libzstd, liblzma, zlib).
#pragma once

#include <lzma.h>
#include <zlib.h>
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

// One gzip member (as `gzip` writes).
inline std::string GzipCompress(const std::string& in) {
  z_stream z = {};
  deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
  std::string out(deflateBound(&z, in.size()) + 64, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  z.avail_in = static_cast<uInt>(in.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  const int r = deflate(&z, Z_FINISH);
  out.resize(r == Z_STREAM_END ? z.total_out : 0);
  deflateEnd(&z);
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
