// CUDA kernels of hf_paged: paged decode attention, the K/V store into pages, block copies (copy-on-write and
// host <-> device swap). No torch headers: `nvcc -c paged_attention.cu` builds it standalone (see
// tests/test_cuda_build.py); bindings.cpp exposes it to torch as torch.ops.hf_paged.*.
//
// KV layout (hf_paged/kv/cache.py): per layer K and V are [num_blocks, block_size, num_kv_heads, head_dim]
// (NHD pages); one token's head_dim values of one kv head are contiguous.
//
// Decode kernel, one thread block per (sequence, kv head [, chunk of its query heads], context partition):
//   * GQA-aware: the block serves up to GROUP query heads of one kv head, so each K/V element it reads from
//     global memory is loaded once and used by all of them (MQA: one kv head, the whole query group per block).
//   * A token's K row of one kv head is read by LPT consecutive lanes with 16-byte vector loads (a coalesced
//     128-512 byte segment); a warp handles 32 / LPT tokens per step, two steps in flight per loop iteration.
//   * Online softmax in the log2 domain with lazy rescaling (the accumulator is rescaled only when the running
//     maximum grows), fp32 accumulation for fp16 / bf16 / fp32 caches.
//   * Long contexts are split into partitions (grid z); each writes its normalized partial output, maximum and
//     sum, and a reduce kernel merges them (flash-decoding). Short contexts over many sequences run in one pass.
//   * Sliding window: only keys [ctx - window, ctx) are visited (partitions start at the window's first key).
//   * Soft-capping: s -> tanh(s * scale / cap) * cap before the softmax.
#include "paged_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace hf_paged {
namespace {

constexpr int kWarp = 32;
constexpr int kNumWarps = 4;            // decode block: 128 threads
constexpr int kReduceThreads = 128;
constexpr int kCopyThreads = 256;
constexpr int kDefaultPartition = 512;  // tokens per partition when the context is split
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// 16 bytes holding 16 / sizeof(T) elements, unpacked to floats.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 pair;
      if constexpr (std::is_same_v<T, __half>) {
        __half2 h;
        *reinterpret_cast<uint32_t*>(&h) = words[i];
        pair = __half22float2(h);
      } else {
        __nv_bfloat162 b;
        *reinterpret_cast<uint32_t*>(&b) = words[i];
        pair = __bfloat1622float2(b);
      }
      out[2 * i] = pair.x;
      out[2 * i + 1] = pair.y;
    }
  }
}

template <typename T>
__device__ __forceinline__ float tanh_of(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return tanhf(x);  // fp32 caches: full precision
  } else {
    // 1 - 2 / (e^2x + 1): absolute error ~1e-7 everywhere (tanh.approx.f32 would be ~5e-4 relative, i.e. up to
    // 5e-4 * softcap in the logits); saturates correctly to +-1 (e^2x = inf or 0)
    return 1.f - __fdividef(2.f, __expf(2.f * x) + 1.f);
  }
}

// exp2(m - m_new), 0 for an empty state (m = -inf), which also covers m_new = -inf.
__device__ __forceinline__ float rescale(float m, float m_new) { return m == neg_inf() ? 0.f : exp2f(m - m_new); }

template <typename T, int HEAD_DIM>
struct DecodeShape {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));                // elements per 16-byte load
  static constexpr int kLanes = HEAD_DIM / kVec < kWarp ? HEAD_DIM / kVec : kWarp;  // lanes per token
  static constexpr int kElems = HEAD_DIM / kLanes;                            // dims per lane
  static constexpr int kLoads = kElems / kVec;                                // 16-byte loads per lane and row
  static constexpr int kTokensPerWarp = kWarp / kLanes;
  static_assert(HEAD_DIM % (kVec * kLanes) == 0, "head_dim must be a multiple of 16 bytes per lane");
};

template <typename T, int HEAD_DIM, int GROUP>
__global__ void __launch_bounds__(kNumWarps * kWarp) paged_decode_kernel(const DecodeParams p) {
  using Shape = DecodeShape<T, HEAD_DIM>;
  constexpr int VEC = Shape::kVec, LANES = Shape::kLanes, ELEMS = Shape::kElems, LOADS = Shape::kLoads;
  constexpr int TPW = Shape::kTokensPerWarp;
  constexpr int STEP = kNumWarps * TPW;  // tokens per block-wide step
  constexpr int UNROLL = 2;              // steps in flight per loop iteration

  const int per_kv = p.num_heads / p.num_kv_heads;
  const int chunks = (per_kv + GROUP - 1) / GROUP;
  const int kv_head = blockIdx.x / chunks;
  const int first_head = kv_head * per_kv + (blockIdx.x % chunks) * GROUP;
  const int heads_here = min(GROUP, (kv_head + 1) * per_kv - first_head);
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;

  const int ctx = p.context_lens[seq];
  const int start = (p.window > 0 && ctx > p.window) ? ctx - p.window : 0;
  int begin = start, end = ctx;
  if (p.partition_size > 0) {
    begin = start + partition * p.partition_size;
    if (begin >= ctx) return;  // this sequence needs fewer partitions than the longest one
    end = min(ctx, begin + p.partition_size);
  }

  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int sub = lane % LANES;   // position within the token's lane group
  const int slot = lane / LANES;  // which token of the warp's step

  // This lane's slice of each query head, pre-scaled so that scores come out in the log2 domain
  // (or as tanh arguments when soft-capping).
  const bool capped = p.softcap > 0.f;
  const float q_scale = capped ? p.scale / p.softcap : p.scale * kLog2e;
  const float cap = p.softcap * kLog2e;
  const T* query = static_cast<const T*>(p.query) + static_cast<int64_t>(seq) * p.q_seq_stride;
  float q[GROUP][ELEMS];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int dim = (i * LANES + sub) * VEC + e;
        q[g][i * VEC + e] =
            g < heads_here ? to_float(query[(first_head + g) * p.q_head_stride + dim]) * q_scale : 0.f;
      }
    }
  }

  float m[GROUP], l[GROUP], acc[GROUP][ELEMS];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = neg_inf();
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < ELEMS; ++e) acc[g][e] = 0.f;
  }

  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const T* k_base = static_cast<const T*>(p.key_cache) + kv_head * p.k_head_stride;
  const T* v_base = static_cast<const T*>(p.value_cache) + kv_head * p.v_head_stride;
  const int block_size = p.block_size;
  const bool pow2 = (block_size & (block_size - 1)) == 0;
  const int shift = __ffs(block_size) - 1;

  // The loop bound is warp-uniform so every lane takes part in the shuffles; lanes past `end` load nothing.
  for (int t0 = begin + warp * TPW; t0 < end; t0 += UNROLL * STEP) {
    uint4 k_raw[UNROLL][LOADS], v_raw[UNROLL][LOADS];
    bool valid[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = t0 + u * STEP + slot;
      valid[u] = t < end;
      if (valid[u]) {
        const int block = pow2 ? t >> shift : t / block_size;
        const int offset = t - block * block_size;
        const int64_t page = table[block];
        const T* k_row = k_base + page * p.k_block_stride + offset * p.k_token_stride;
        const T* v_row = v_base + page * p.v_block_stride + offset * p.v_token_stride;
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
          k_raw[u][i] = __ldg(reinterpret_cast<const uint4*>(k_row + (i * LANES + sub) * VEC));
          v_raw[u][i] = __ldg(reinterpret_cast<const uint4*>(v_row + (i * LANES + sub) * VEC));
        }
      } else {
#pragma unroll
        for (int i = 0; i < LOADS; ++i) k_raw[u][i] = v_raw[u][i] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float k[ELEMS];
#pragma unroll
      for (int i = 0; i < LOADS; ++i) unpack<T>(k_raw[u][i], k + i * VEC);
      float s[GROUP];
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) dot = fmaf(q[g][e], k[e], dot);
        s[g] = dot;
      }
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) s[g] += __shfl_xor_sync(0xffffffffu, s[g], o);
      }
      if (valid[u]) {
        float v[ELEMS];
#pragma unroll
        for (int i = 0; i < LOADS; ++i) unpack<T>(v_raw[u][i], v + i * VEC);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
          const float x = capped ? tanh_of<T>(s[g]) * cap : s[g];
          if (x > m[g]) {  // lazy rescale: only when the running maximum grows
            const float c = exp2f(m[g] - x);
            l[g] *= c;
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) acc[g][e] *= c;
            m[g] = x;
          }
          const float w = exp2f(x - m[g]);
          l[g] += w;
#pragma unroll
          for (int e = 0; e < ELEMS; ++e) acc[g][e] = fmaf(w, v[e], acc[g][e]);
        }
      }
    }
  }

  // Merge the token slots of the warp (lane groups holding the same dims).
#pragma unroll
  for (int o = LANES; o < kWarp; o <<= 1) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float m_new = fmaxf(m[g], m_other);
      const float a = rescale(m[g], m_new), b = rescale(m_other, m_new);
      l[g] = l[g] * a + l_other * b;
#pragma unroll
      for (int e = 0; e < ELEMS; ++e) acc[g][e] = acc[g][e] * a + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * b;
      m[g] = m_new;
    }
  }

  // Merge the warps through shared memory.
  __shared__ float s_acc[kNumWarps][GROUP][HEAD_DIM];
  __shared__ float s_m[kNumWarps][GROUP], s_l[kNumWarps][GROUP];
  if (slot == 0) {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
      for (int i = 0; i < LOADS; ++i) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) s_acc[warp][g][(i * LANES + sub) * VEC + e] = acc[g][i * VEC + e];
      }
      if (sub == 0) {
        s_m[warp][g] = m[g];
        s_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < heads_here * HEAD_DIM; idx += kNumWarps * kWarp) {
    const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
    float m_all = neg_inf();
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) m_all = fmaxf(m_all, s_m[w][g]);
    float l_all = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float c = rescale(s_m[w][g], m_all);
      l_all += s_l[w][g] * c;
      o += s_acc[w][g][d] * c;
    }
    const float value = l_all > 0.f ? o / l_all : 0.f;
    const int head = first_head + g;
    const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
    if (p.partition_size > 0) {
      const int64_t part = row * p.max_partitions + partition;
      p.tmp_out[part * HEAD_DIM + d] = value;
      if (d == 0) {
        p.tmp_max[part] = m_all;
        p.tmp_sum[part] = l_all;
      }
    } else {
      static_cast<T*>(p.out)[row * HEAD_DIM + d] = from_float<T>(value);
    }
  }
}

__device__ __forceinline__ float block_reduce(float x, bool is_max, float* scratch) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  __syncthreads();  // scratch may still be read from a previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < static_cast<int>(blockDim.x) / kWarp; ++w) x = is_max ? fmaxf(x, scratch[w]) : x + scratch[w];
  return x;
}

// Merges the partitions of one (sequence, query head): out = sum_p w_p out_p / sum_p w_p with
// w_p = sum_p * exp2(max_p - max).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kReduceThreads) paged_decode_reduce_kernel(const DecodeParams p) {
  extern __shared__ float weights[];  // [max_partitions]
  __shared__ float scratch[kReduceThreads / kWarp];
  const int head = blockIdx.x, seq = blockIdx.y;
  const int ctx = p.context_lens[seq];
  const int start = (p.window > 0 && ctx > p.window) ? ctx - p.window : 0;
  const int count = ctx > start ? (ctx - start + p.partition_size - 1) / p.partition_size : 0;
  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  const float* maxes = p.tmp_max + row * p.max_partitions;
  const float* sums = p.tmp_sum + row * p.max_partitions;
  const float* partial = p.tmp_out + row * p.max_partitions * HEAD_DIM;

  float m = neg_inf();
  for (int i = threadIdx.x; i < count; i += blockDim.x) m = fmaxf(m, maxes[i]);
  m = block_reduce(m, true, scratch);
  float total = 0.f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    weights[i] = sums[i] * rescale(maxes[i], m);
    total += weights[i];
  }
  total = block_reduce(total, false, scratch);  // its barriers also publish `weights`
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < count; ++i) o = fmaf(weights[i], partial[i * HEAD_DIM + d], o);
    static_cast<T*>(p.out)[row * HEAD_DIM + d] = from_float<T>(o * inv);
  }
}

int group_for(int per_kv) { return per_kv <= 1 ? 1 : per_kv <= 2 ? 2 : per_kv <= 4 ? 4 : 8; }

template <typename T, int HEAD_DIM, int GROUP>
cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream) {
  const int per_kv = p.num_heads / p.num_kv_heads;
  const int chunks = (per_kv + GROUP - 1) / GROUP;
  const int partitions = p.partition_size > 0 ? p.max_partitions : 1;
  const dim3 grid(p.num_kv_heads * chunks, p.num_seqs, partitions);
  paged_decode_kernel<T, HEAD_DIM, GROUP><<<grid, kNumWarps * kWarp, 0, stream>>>(p);
  if (p.partition_size > 0) {
    const dim3 reduce_grid(p.num_heads, p.num_seqs);
    const size_t smem = static_cast<size_t>(p.max_partitions) * sizeof(float);
    paged_decode_reduce_kernel<T, HEAD_DIM><<<reduce_grid, kReduceThreads, smem, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T, int HEAD_DIM>
cudaError_t dispatch_group(const DecodeParams& p, cudaStream_t stream) {
  switch (group_for(p.num_heads / p.num_kv_heads)) {
    case 1: return launch_decode<T, HEAD_DIM, 1>(p, stream);
    case 2: return launch_decode<T, HEAD_DIM, 2>(p, stream);
    case 4: return launch_decode<T, HEAD_DIM, 4>(p, stream);
    default: return launch_decode<T, HEAD_DIM, 8>(p, stream);
  }
}

template <typename T>
cudaError_t dispatch_head_dim(const DecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return dispatch_group<T, 64>(p, stream);
    case 128: return dispatch_group<T, 128>(p, stream);
    case 256: return dispatch_group<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// ---- store (reshape_and_cache) ---------------------------------------------------------------------------
// Copies whole `Word`s: 16-byte vectors when every row and stride allows it, else single elements.
template <typename Word>
__global__ void store_kv_kernel(const StoreParams p, int elem_bytes) {
  const int token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  const int per_elem = static_cast<int>(sizeof(Word)) / elem_bytes;  // elements per word
  const int words_per_head = p.head_dim / per_elem;
  const char* key = static_cast<const char*>(p.key) + token * p.key_token_stride * elem_bytes;
  const char* value = static_cast<const char*>(p.value) + token * p.value_token_stride * elem_bytes;
  char* k_dst = static_cast<char*>(p.key_cache) + (block * p.k_block_stride + offset * p.k_token_stride) * elem_bytes;
  char* v_dst = static_cast<char*>(p.value_cache) + (block * p.v_block_stride + offset * p.v_token_stride) * elem_bytes;
  for (int i = threadIdx.x; i < p.num_kv_heads * words_per_head; i += blockDim.x) {
    const int h = i / words_per_head, w = i % words_per_head;
    reinterpret_cast<Word*>(k_dst + h * p.k_head_stride * elem_bytes)[w] =
        reinterpret_cast<const Word*>(key + h * p.key_head_stride * elem_bytes)[w];
    reinterpret_cast<Word*>(v_dst + h * p.v_head_stride * elem_bytes)[w] =
        reinterpret_cast<const Word*>(value + h * p.value_head_stride * elem_bytes)[w];
  }
}

// ---- block copies --------------------------------------------------------------------------------------
template <typename Word>
__global__ void __launch_bounds__(kCopyThreads) copy_blocks_kernel(const CopyBlocksParams p) {
  const int64_t pair = blockIdx.x, slice = blockIdx.y;
  const int64_t src_block = p.mapping[2 * pair], dst_block = p.mapping[2 * pair + 1];
  const Word* src = reinterpret_cast<const Word*>(p.src + slice * p.src_slice_stride + src_block * p.src_block_stride);
  Word* dst = reinterpret_cast<Word*>(p.dst + slice * p.dst_slice_stride + dst_block * p.dst_block_stride);
  const int64_t words = p.block_bytes / static_cast<int64_t>(sizeof(Word));
  constexpr int kUnroll = 4;  // independent loads in flight: helps most when one side is host memory
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * kCopyThreads < words; i += kUnroll * kCopyThreads) {
    Word w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) w[u] = src[i + u * kCopyThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * kCopyThreads] = w[u];
  }
  for (; i < words; i += kCopyThreads) dst[i] = src[i];
}

bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

}  // namespace

DecodePlan plan_decode(int num_seqs, int num_heads, int num_kv_heads, int head_dim, int max_context_len, int window,
                       int requested_partition_size, int num_sms) {
  (void)head_dim;
  const int length = window > 0 && window < max_context_len ? window : max_context_len;
  if (requested_partition_size < 0 || length <= 0) return {0, 1};
  if (requested_partition_size > 0) {
    const int count = (length + requested_partition_size - 1) / requested_partition_size;
    return count <= 1 ? DecodePlan{0, 1} : DecodePlan{requested_partition_size, count};
  }
  const int per_kv = num_heads / num_kv_heads;
  const int group = group_for(per_kv);
  const int blocks = num_seqs * num_kv_heads * ((per_kv + group - 1) / group);
  const int count = (length + kDefaultPartition - 1) / kDefaultPartition;
  // One pass when it already fills every SM twice and no block walks a very long context; otherwise split, so
  // that long contexts over few sequences still spread over all SMs. (H200, 64 sequences x 2,048 tokens, 32/8 heads:
  // 3.9 blocks per SM; one pass took 231-244 us, split into 512-token partitions 253-279 us.)
  if (count <= 1 || (blocks >= 2 * num_sms && length <= 4096)) return {0, 1};
  return {kDefaultPartition, count};
}

cudaError_t paged_decode(const DecodeParams& p, DType dtype, cudaStream_t stream) {
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0 || p.num_seqs <= 0) return cudaErrorInvalidValue;
  if (!aligned(p.key_cache, 16) || !aligned(p.value_cache, 16)) return cudaErrorMisalignedAddress;
  switch (dtype) {
    case DType::kFloat32: return dispatch_head_dim<float>(p, stream);
    case DType::kFloat16: return dispatch_head_dim<__half>(p, stream);
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t store_kv(const StoreParams& p, DType dtype, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  const int elem = dtype == DType::kFloat32 ? 4 : 2;
  const int per_vec = 16 / elem;
  const bool vec = p.head_dim % per_vec == 0 && aligned(p.key, 16) && aligned(p.value, 16) &&
                   aligned(p.key_cache, 16) && aligned(p.value_cache, 16) &&
                   p.key_token_stride % per_vec == 0 && p.key_head_stride % per_vec == 0 &&
                   p.value_token_stride % per_vec == 0 && p.value_head_stride % per_vec == 0 &&
                   p.k_block_stride % per_vec == 0 && p.k_token_stride % per_vec == 0 &&
                   p.k_head_stride % per_vec == 0 && p.v_block_stride % per_vec == 0 &&
                   p.v_token_stride % per_vec == 0 && p.v_head_stride % per_vec == 0;
  const int threads = 128;
  if (vec) {
    store_kv_kernel<uint4><<<p.num_tokens, threads, 0, stream>>>(p, elem);
  } else if (elem == 4) {
    store_kv_kernel<uint32_t><<<p.num_tokens, threads, 0, stream>>>(p, elem);
  } else {
    store_kv_kernel<uint16_t><<<p.num_tokens, threads, 0, stream>>>(p, elem);
  }
  return cudaGetLastError();
}

cudaError_t copy_blocks(const CopyBlocksParams& p, cudaStream_t stream) {
  if (p.num_pairs == 0 || p.num_slices == 0 || p.block_bytes == 0) return cudaSuccess;
  if (p.num_slices > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.num_pairs), static_cast<unsigned>(p.num_slices));
  const bool vec = aligned(p.src, 16) && aligned(p.dst, 16) && p.block_bytes % 16 == 0 &&
                   p.src_slice_stride % 16 == 0 && p.dst_slice_stride % 16 == 0 &&
                   p.src_block_stride % 16 == 0 && p.dst_block_stride % 16 == 0;
  if (vec) {
    copy_blocks_kernel<uint4><<<grid, kCopyThreads, 0, stream>>>(p);
  } else {
    copy_blocks_kernel<unsigned char><<<grid, kCopyThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace hf_paged
