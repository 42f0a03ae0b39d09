// The bandwidth benchmark of bench.h. For each (M, K): fills `buffers` BF16 (and F32) inputs with
// N(0,1) values (Philox + Box-Muller on the device; never zeros), then times, with CUDA events
// around each launch, warm-up first, the median of `repeats` launches rotating through the
// buffers: a cudaMemcpyAsync device-to-device copy of the BF16 input (bytes = read + write) and
// every format kernel. Byte counts per row are written next to each row below.
#include "backend/cuda/bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernel_util.cuh"
#include "backend/cuda/quantize.h"
#include "core/bits.h"
#include "core/philox.h"
#include "formats/nvfp4.h"
#include "formats/rht.h"

namespace nibble::cuda {

namespace {

// x (n) <- N(0,1) (Box-Muller on two Philox words), as bf16 bits or f32.
template <typename T>
__global__ void fill_normal_kernel(T* x, int64_t n, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Philox4x32 r = philox_block(seed, 7, static_cast<uint64_t>(i));
    float u1 = (static_cast<float>(r.v[0] >> 8) + 1.0f) * 5.9604644775390625e-08f;  // (0, 1]
    float u2 = static_cast<float>(r.v[1] >> 8) * 5.9604644775390625e-08f;
    float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if constexpr (sizeof(T) == 2) x[i] = f32_to_bf16_bits(z);
    else x[i] = z;
  }
}

// The element arithmetic of the fused backward-operand op with no memory traffic: what a fused
// kernel would cost if its loads, stores, shared-memory transpose and addressing were free. Each
// thread runs kFloorGroups 16-element groups in registers, each with the fused kernel's own steps
// on its fast path: decode of two code words (e2m1_decode8_mul; the codes are the previous
// group's output, so each group depends on the last and nothing is dead), the RHT butterfly, the
// block max, the scale chain (outer scale over the 8 lanes of a 128-block, inner scale, block
// scale, reciprocal) and the fast SR encode (two Philox4x32-10 blocks, the 5-step quotient, the
// top-byte SR index). The thread's last code words go to `out` (so the work is observable).
constexpr int kFloorGroups = 16;
__global__ void __launch_bounds__(256) fused_arithmetic_floor_kernel(uint32_t* out, int64_t threads, SrKeyDevice key) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t w0 = static_cast<uint32_t>(t) * 0x9E3779B9u, w1 = ~w0;  // the first group's codes
  const float so_in = 0.75f;  // the decode factor (inner times outer scale of the input block)
#pragma unroll 1
  for (int it = 0; it < kFloorGroups; ++it) {
    float lo[8], hi[8], v[16];
    e2m1_decode8_mul(lo, w0, so_in);
    e2m1_decode8_mul(hi, w1, so_in);
#pragma unroll
    for (int i = 0; i < 8; ++i) { v[i] = lo[i]; v[8 + i] = hi[i]; }
    formats::rht16_butterfly_f32(v);
    float vmax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) vmax = fmaxf(vmax, fabsf(v[i]));
    const float bamax = vmax * 0.25f;
    const float so = formats::nvfp4_2level_outer_scale(group_max<8>(bamax));
    const uint32_t si = formats::nvfp4_2level_inner_scale(bamax, so);
    const float sp = nvfp4_2level_block_scale_encoded(si, so);
    const float rp = formats::nvfp4_2level_block_reciprocal(sp);
    const uint64_t q0 = (static_cast<uint64_t>(t) * kFloorGroups + it) * 2;
    const PackedBytes<8> packed = nvfp4_2level_encode_block16_fast<true>(v, 4.0f * sp, 0.25f * rp, key, q0);
    w0 = packed.w[0];
    w1 = packed.w[1];
  }
  if (t < threads) out[t] = w0 ^ w1;
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { NIB_CUDA_CHECK(cudaMalloc(&p, bytes)); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T> T* as() const { return static_cast<T*>(p); }
};

// Median milliseconds of one launch of `fn(buffer index)`.
double median_ms(const std::function<void(int)>& fn, int warmup, int repeats, int buffers) {
  for (int i = 0; i < warmup; ++i) fn(i % buffers);
  NIB_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(repeats));
  for (auto& e : ev) NIB_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < repeats; ++i) {
    NIB_CUDA_CHECK(cudaEventRecord(ev[2 * i], nullptr));
    fn(i % buffers);
    NIB_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], nullptr));
  }
  NIB_CUDA_CHECK(cudaEventSynchronize(ev.back()));
  NIB_CUDA_CHECK(cudaGetLastError());
  std::vector<double> ms(static_cast<size_t>(repeats));
  for (int i = 0; i < repeats; ++i) {
    float t = 0;
    NIB_CUDA_CHECK(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
    ms[static_cast<size_t>(i)] = t;
  }
  for (auto& e : ev) NIB_CUDA_CHECK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void check(const Status& s) { NIB_CHECK_MSG(s.is_ok(), "{}", s.message()); }

}  // namespace

Result<std::vector<BandwidthRow>> run_quantize_bandwidth_bench(const BandwidthBenchConfig& cfg) {
  if (cfg.buffers < 1 || cfg.repeats < 1) return invalid_argument("bench: buffers and repeats must be >= 1");
  std::vector<BandwidthRow> rows;
  for (auto [M, K] : cfg.shapes) {
    if (M % 128 != 0 || K % 128 != 0) return invalid_argument("bench: shape {}x{} must be a multiple of 128", M, K);
    const int64_t N = M * K;
    const uint64_t n = static_cast<uint64_t>(N);
    const int B = cfg.buffers;
    std::vector<std::unique_ptr<DeviceBuffer>> xb, xf, dst, codes, scales, outer, amax, codes_t, inner_t, outer_t, y16;
    for (int b = 0; b < B; ++b) {
      xb.push_back(std::make_unique<DeviceBuffer>(n * 2));
      xf.push_back(std::make_unique<DeviceBuffer>(n * 4));
      dst.push_back(std::make_unique<DeviceBuffer>(n * 2));
      codes.push_back(std::make_unique<DeviceBuffer>(n));  // big enough for MXFP8 elements
      scales.push_back(std::make_unique<DeviceBuffer>(n / 16));
      outer.push_back(std::make_unique<DeviceBuffer>(n / 128 * 4));
      amax.push_back(std::make_unique<DeviceBuffer>(16));
      codes_t.push_back(std::make_unique<DeviceBuffer>(n / 2));
      inner_t.push_back(std::make_unique<DeviceBuffer>(n / 16));
      outer_t.push_back(std::make_unique<DeviceBuffer>(n / 128 * 4));
      fill_normal_kernel<uint16_t><<<1024, 256>>>(xb[b]->as<uint16_t>(), N, cfg.seed + b);
      NIB_CUDA_CHECK_LAUNCH();
      fill_normal_kernel<float><<<1024, 256>>>(xf[b]->as<float>(), N, cfg.seed + 100 + b);
      NIB_CUDA_CHECK_LAUNCH();
    }
    y16.push_back(std::make_unique<DeviceBuffer>(n * 2));  // RHT scratch (K, M) bf16
    NIB_CUDA_CHECK(cudaDeviceSynchronize());
    const std::string shape = std::to_string(M) + "x" + std::to_string(K);
    double copy_gbps = 0;
    auto add = [&](const std::string& name, uint64_t bytes, const std::function<void(int)>& fn) {
      double ms = median_ms(fn, cfg.warmup, cfg.repeats, B);
      BandwidthRow r{name, shape, bytes, ms, static_cast<double>(bytes) / (ms * 1e6), 0};
      if (copy_gbps == 0) copy_gbps = r.gbps;
      r.ratio_to_copy = r.gbps / copy_gbps;
      rows.push_back(r);
    };
    const SrKey key{cfg.seed, 3};
    // copy: read 2N + write 2N bytes.
    add("copy d2d bf16 (baseline)", 4 * n, [&](int b) {
      NIB_CUDA_CHECK(cudaMemcpyAsync(dst[b]->p, xb[b]->p, n * 2, cudaMemcpyDeviceToDevice, nullptr));
    });
    // NVFP4 TE: amax pass reads 2N; quantize pass reads 2N, writes N/2 codes + N/16 scales (+4 amax).
    const uint64_t te_bytes = 2 * n + 2 * n + n / 2 + n / 16 + 4;
    add("nvfp4_te_1x16 bf16 rtn (amax+quant)", te_bytes, [&](int b) {
      check(quantize_nvfp4_te(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), amax[b]->as<float>(),
                              xb[b]->as<uint16_t>(), M, K));
    });
    add("nvfp4_te_1x16 bf16 sr (amax+quant)", te_bytes, [&](int b) {
      check(quantize_nvfp4_te(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), amax[b]->as<float>(),
                              xb[b]->as<uint16_t>(), M, K, &key));
    });
    // quantize pass alone (amax given): 2N + N/2 + N/16.
    add("nvfp4_te_1x16 bf16 rtn (quant only)", 2 * n + n / 2 + n / 16, [&](int b) {
      check(quantize_nvfp4_te(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), amax[b]->as<float>(),
                              xb[b]->as<uint16_t>(), M, K, nullptr, AmaxMode::kGiven));
    });
    add("nvfp4_te_1x16 bf16 rtn swizzled", te_bytes, [&](int b) {
      check(quantize_nvfp4_te(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), amax[b]->as<float>(),
                              xb[b]->as<uint16_t>(), M, K, nullptr, AmaxMode::kCompute, ScaleLayout::kSwizzled));
    });
    add("nvfp4_te_1x16 f32 rtn (amax+quant)", 4 * n + 4 * n + n / 2 + n / 16 + 4, [&](int b) {
      check(quantize_nvfp4_te(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), amax[b]->as<float>(),
                              xf[b]->as<float>(), M, K));
    });
    // 2-D: same bytes as 1x16 (amax pass + quantize pass).
    add("nvfp4_te_2d bf16 rtn (amax+quant)", te_bytes, [&](int b) {
      check(quantize_nvfp4_te_2d(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), nullptr, nullptr,
                                 amax[b]->as<float>(), xb[b]->as<uint16_t>(), M, K));
    });
    add("nvfp4_te_2d bf16 rtn +columnwise", te_bytes + n / 2 + n / 16, [&](int b) {
      check(quantize_nvfp4_te_2d(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), codes_t[b]->as<uint8_t>(),
                                 inner_t[b]->as<uint8_t>(), amax[b]->as<float>(), xb[b]->as<uint16_t>(), M, K));
    });
    // nvfp4-2level: one pass: read 2N, write N/2 codes + N/16 inner + N/128*4 outer.
    const uint64_t tl_bytes = 2 * n + n / 2 + n / 16 + n / 32;
    add("nvfp4_2level bf16 rtn", tl_bytes, [&](int b) {
      check(quantize_nvfp4_2level(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), outer[b]->as<float>(),
                                  xb[b]->as<uint16_t>(), M, K));
    });
    add("nvfp4_2level bf16 sr", tl_bytes, [&](int b) {
      check(quantize_nvfp4_2level(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), outer[b]->as<float>(),
                                  xb[b]->as<uint16_t>(), M, K, &key));
    });
    add("nvfp4_2level f32 rtn", 4 * n + n / 2 + n / 16 + n / 32, [&](int b) {
      check(quantize_nvfp4_2level(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), outer[b]->as<float>(),
                                  xf[b]->as<float>(), M, K));
    });
    // MXFP4: read 2N, write N/2 + N/32. MXFP8: read 2N, write N + N/32.
    add("mxfp4 bf16 rceil rtn", 2 * n + n / 2 + n / 32, [&](int b) {
      check(quantize_mxfp4(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), xb[b]->as<uint16_t>(), M, K,
                           MxScaleRule::kRceil));
    });
    add("mxfp4 bf16 floor sr", 2 * n + n / 2 + n / 32, [&](int b) {
      check(quantize_mxfp4(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), xb[b]->as<uint16_t>(), M, K,
                           MxScaleRule::kFloor, &key));
    });
    add("mxfp8 bf16 rceil", 2 * n + n + n / 32, [&](int b) {
      check(quantize_mxfp8(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), xb[b]->as<uint16_t>(), M, K,
                           MxScaleRule::kRceil));
    });
    // Dequantize NVFP4 TE -> bf16: read N/2 + N/16, write 2N.
    for (int b = 0; b < B; ++b)
      check(quantize_nvfp4_te(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), amax[b]->as<float>(), xb[b]->as<uint16_t>(), M, K));
    add("dequant nvfp4_te -> bf16", n / 2 + n / 16 + 2 * n, [&](int b) {
      check(dequantize_nvfp4_te(dst[b]->as<uint16_t>(), codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(),
                                amax[b]->as<float>(), M, K));
    });
    // Fused backward operand: read codes N/2 + inner N/16 + outer N/32 ; write the same for [K, M].
    for (int b = 0; b < B; ++b)
      check(quantize_nvfp4_2level(codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(), outer[b]->as<float>(), xb[b]->as<uint16_t>(), M, K));
    NIB_CUDA_CHECK(cudaDeviceSynchronize());
    // Dequantize nvfp4-2level -> bf16: read N/2 + N/16 + N/32, write 2N.
    add("dequant nvfp4_2level -> bf16", n / 2 + n / 16 + n / 32 + 2 * n, [&](int b) {
      check(dequantize_nvfp4_2level(dst[b]->as<uint16_t>(), codes[b]->as<uint8_t>(), scales[b]->as<uint8_t>(),
                                    outer[b]->as<float>(), M, K));
    });
    const uint64_t fused_bytes = 2 * (n / 2 + n / 16 + n / 32);
    const uint32_t mask = formats::rht_random_sign_mask(cfg.seed, 11);
    add("fused 2level->T->RHT->2level sr", fused_bytes, [&](int b) {
      check(nvfp4_2level_transpose_rht_requantize(codes_t[b]->as<uint8_t>(), inner_t[b]->as<uint8_t>(),
                                                  outer_t[b]->as<float>(), codes[b]->as<uint8_t>(),
                                                  scales[b]->as<uint8_t>(), outer[b]->as<float>(), M, K, mask, &key));
    });
    add("fused 2level->T->RHT->2level rtn", fused_bytes, [&](int b) {
      check(nvfp4_2level_transpose_rht_requantize(codes_t[b]->as<uint8_t>(), inner_t[b]->as<uint8_t>(),
                                                  outer_t[b]->as<float>(), codes[b]->as<uint8_t>(),
                                                  scales[b]->as<uint8_t>(), outer[b]->as<float>(), M, K, mask, nullptr));
    });
    // The fused op's element arithmetic alone (fused_arithmetic_floor_kernel), reported with the
    // fused op's byte count: the ratio a fused kernel could reach if nothing but these steps cost.
    {
      const int64_t threads = N / (16 * kFloorGroups);
      const SrKeyDevice dkey(key);
      add("floor: fused op's arithmetic, no memory", fused_bytes, [&](int b) {
        fused_arithmetic_floor_kernel<<<ceil_div_int(threads, 256), 256>>>(dst[b]->as<uint32_t>(), threads, dkey);
        NIB_CUDA_CHECK_LAUNCH();
      });
    }
    // TE wgrad operand: RHT-transpose (read 2N, write 2N) + amax (2N) + quantize (2N + N/2 + N/16).
    add("te rht_t wgrad bf16 (rht+amax+quant)", 8 * n + n / 2 + n / 16 + 4, [&](int b) {
      check(quantize_nvfp4_te_rht_t(codes_t[b]->as<uint8_t>(), inner_t[b]->as<uint8_t>(), amax[b]->as<float>(),
                                    y16[0]->as<uint16_t>(), xb[b]->as<uint16_t>(), M, K));
    });
    NIB_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return rows;
}

std::string format_bandwidth_table(const std::vector<BandwidthRow>& rows) {
  std::string out = fmt::format("{:<40} {:>11} {:>9} {:>9} {:>8} {:>7}\n", "kernel", "shape", "MB", "ms", "GB/s", "x copy");
  for (const auto& r : rows)
    out += fmt::format("{:<40} {:>11} {:>9.1f} {:>9.4f} {:>8.0f} {:>7.3f}\n", r.name, r.shape,
                       static_cast<double>(r.bytes) / 1e6, r.ms, r.gbps, r.ratio_to_copy);
  return out;
}

}  // namespace nibble::cuda
