// torch bindings of the kernels in paged_attention.cu: torch.ops.hf_paged.{paged_decode, store_kv, copy_blocks,
// plan_decode}. Built by hf_paged/attention/cuda_backend.py with torch.utils.cpp_extension.load.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "paged_attention.h"

namespace {

hf_paged::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return hf_paged::DType::kFloat32;
    case at::kHalf: return hf_paged::DType::kFloat16;
    case at::kBFloat16: return hf_paged::DType::kBFloat16;
    default: TORCH_CHECK(false, "hf_paged CUDA kernels take float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "hf_paged ", what, ": ", cudaGetErrorString(err));
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.is_cuda() && cache.dim() == 4, name, " must be a CUDA tensor [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(cache.stride(3) == 1, name, " must have a contiguous last (head_dim) dimension");
}

// Only c10/cuda headers (no ATen/cuda/CUDAContext.h, which pulls in cuBLAS / cuSPARSE headers a bare toolkit lacks).
int num_sms(const at::Device& device) {
  int count = 0;
  check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device.index()), "SM count");
  return count;
}

std::vector<int64_t> plan_decode(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t max_context_len, int64_t window, int64_t partition_size) {
  const auto plan = hf_paged::plan_decode(num_seqs, num_heads, num_kv_heads, head_dim, max_context_len, window,
                                          partition_size, num_sms(at::Device(at::kCUDA, c10::cuda::current_device())));
  return {plan.partition_size, plan.max_partitions};
}

// Page strides of the K and V caches, shared by every kernel's parameter struct.
template <typename Params>
void set_cache_strides(Params& p, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  p.k_block_stride = key_cache.stride(0);
  p.k_token_stride = key_cache.stride(1);
  p.k_head_stride = key_cache.stride(2);
  p.v_block_stride = value_cache.stride(0);
  p.v_token_stride = value_cache.stride(1);
  p.v_head_stride = value_cache.stride(2);
}

void paged_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
                  int64_t max_context_len, double scale, int64_t window, double softcap, int64_t partition_size) {
  TORCH_CHECK(query.is_cuda() && query.dim() == 3, "query must be a CUDA tensor [num_seqs, H, D]");
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  const c10::cuda::CUDAGuard guard(query.device());
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2), block_size = key_cache.size(1);
  TORCH_CHECK(query.stride(2) == 1, "query must have a contiguous last dimension");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(),
              "query and caches must share one dtype");
  TORCH_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256, "head_dim must be 64, 128 or 256, got ", head_dim);
  TORCH_CHECK(key_cache.size(3) == head_dim && value_cache.sizes() == key_cache.sizes(), "cache shape mismatch");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor shaped and typed like query");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == num_seqs,
              "block_tables must be contiguous int32 [num_seqs, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == num_seqs,
              "context_lens must be contiguous int32 [num_seqs]");
  const int64_t vec = 16 / query.element_size();
  for (const auto* cache : {&key_cache, &value_cache}) {
    TORCH_CHECK(cache->stride(0) % vec == 0 && cache->stride(1) % vec == 0 && cache->stride(2) % vec == 0 &&
                    reinterpret_cast<uintptr_t>(cache->data_ptr()) % 16 == 0,
                "cache pages must be 16-byte aligned");
  }
  if (num_seqs == 0) return;

  const auto plan = hf_paged::plan_decode(num_seqs, num_heads, num_kv_heads, head_dim, max_context_len, window,
                                          partition_size, num_sms(query.device()));
  at::Tensor tmp_out, tmp_max, tmp_sum;
  hf_paged::DecodeParams p{};
  if (plan.partition_size > 0) {
    const auto opts = query.options().dtype(at::kFloat);
    tmp_out = at::empty({num_seqs, num_heads, plan.max_partitions, head_dim}, opts);
    tmp_max = at::empty({num_seqs, num_heads, plan.max_partitions}, opts);
    tmp_sum = at::empty({num_seqs, num_heads, plan.max_partitions}, opts);
    p.tmp_out = tmp_out.data_ptr<float>();
    p.tmp_max = tmp_max.data_ptr<float>();
    p.tmp_sum = tmp_sum.data_ptr<float>();
  }
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.q_seq_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  set_cache_strides(p, key_cache, value_cache);
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.max_blocks_per_seq = block_tables.size(1);
  p.partition_size = plan.partition_size;
  p.max_partitions = plan.max_partitions;
  p.window = window;
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  check_cuda(hf_paged::paged_decode(p, dtype_of(query), c10::cuda::getCurrentCUDAStream()), "paged_decode");
}

void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
              const at::Tensor& slot_mapping) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(key.is_cuda() && key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be CUDA [T, H_kv, D]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value must have a contiguous last dimension");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "key/value must have the caches' dtype");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3), "key does not match the pages");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be contiguous int64 [T]");
  const c10::cuda::CUDAGuard guard(key.device());
  hf_paged::StoreParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  set_cache_strides(p, key_cache, value_cache);
  p.num_tokens = key.size(0);
  p.num_kv_heads = key.size(1);
  p.head_dim = key.size(2);
  p.block_size = key_cache.size(1);
  check_cuda(hf_paged::store_kv(p, dtype_of(key_cache), c10::cuda::getCurrentCUDAStream()), "store_kv");
}

// Device pointer of a CUDA tensor or of pinned host memory (zero-copy through unified addressing).
const char* device_pointer(const at::Tensor& t) {
  if (t.is_cuda()) return static_cast<const char*>(t.data_ptr());
  TORCH_CHECK(t.is_pinned(), "copy_blocks: a host storage must be pinned (page-locked) memory");
  void* mapped = nullptr;
  check_cuda(cudaHostGetDevicePointer(&mapped, t.data_ptr(), 0), "copy_blocks (host pointer)");
  return static_cast<const char*>(mapped);
}

// Bytes between consecutive entries of the dims before `block_dim`, viewed as one flat dim.
int64_t slice_stride(const at::Tensor& t, int64_t block_dim) {
  for (int64_t d = 0; d + 1 < block_dim; ++d) {
    TORCH_CHECK(t.stride(d) == t.stride(d + 1) * t.size(d + 1), "copy_blocks: the dims before the block dim must "
                                                                 "be collapsible into one");
  }
  return block_dim > 0 ? t.stride(block_dim - 1) * t.element_size() : 0;
}

// dst[..., mapping[i, 1], ...] = src[..., mapping[i, 0], ...] for every pair, over all slices before block_dim.
void copy_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping, int64_t block_dim) {
  TORCH_CHECK(src.dim() == dst.dim() && block_dim >= 0 && block_dim < src.dim(), "copy_blocks: bad block_dim");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "copy_blocks: src and dst must share a dtype");
  for (int64_t d = 0; d < src.dim(); ++d) {
    TORCH_CHECK(d == block_dim || src.size(d) == dst.size(d), "copy_blocks: src and dst differ outside block_dim");
  }
  for (const at::Tensor* t : {&src, static_cast<const at::Tensor*>(&dst)}) {
    int64_t expected = 1;
    for (int64_t d = t->dim() - 1; d > block_dim; --d) {
      TORCH_CHECK(t->stride(d) == expected, "copy_blocks: each block must be contiguous");
      expected *= t->size(d);
    }
  }
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2, "block_mapping must be [N, 2]");
  const at::Device device = src.is_cuda() ? src.device() : dst.device();
  TORCH_CHECK(device.is_cuda(), "copy_blocks: one side must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor mapping = block_mapping.to(device, at::kLong, /*non_blocking=*/true).contiguous();
  int64_t slices = 1;
  for (int64_t d = 0; d < block_dim; ++d) slices *= src.size(d);
  hf_paged::CopyBlocksParams p{};
  p.src = device_pointer(src);
  p.dst = const_cast<char*>(device_pointer(dst));
  p.mapping = mapping.data_ptr<int64_t>();
  p.num_pairs = mapping.size(0);
  p.num_slices = slices;
  p.src_slice_stride = slice_stride(src, block_dim);
  p.dst_slice_stride = slice_stride(dst, block_dim);
  p.src_block_stride = src.stride(block_dim) * src.element_size();
  p.dst_block_stride = dst.stride(block_dim) * dst.element_size();
  int64_t inner = 1;
  for (int64_t d = block_dim + 1; d < src.dim(); ++d) inner *= src.size(d);
  p.block_bytes = inner * src.element_size();
  check_cuda(hf_paged::copy_blocks(p, c10::cuda::getCurrentCUDAStream()), "copy_blocks");
}

}  // namespace

TORCH_LIBRARY(hf_paged, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, int max_context_len, float scale, int window, float softcap, int partition_size) -> ()");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def("copy_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping, int block_dim) -> ()");
  m.def("plan_decode(int num_seqs, int num_heads, int num_kv_heads, int head_dim, int max_context_len, int window, "
        "int partition_size) -> int[]",
        &plan_decode);
}

TORCH_LIBRARY_IMPL(hf_paged, CUDA, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("store_kv", &store_kv);
  m.impl("copy_blocks", &copy_blocks);
}
