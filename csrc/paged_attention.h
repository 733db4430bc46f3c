// Host-side interface of the CUDA kernels in paged_attention.cu. Plain C++ and the CUDA runtime only (no torch
// headers), so the kernels compile standalone with nvcc; bindings.cpp maps torch tensors onto these structs.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace hf_paged {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Decode attention: one query token per sequence, K/V read in place from the pages.
// Every stride is in elements. Queries sit at position context_lens[b] - 1 (the cache already holds the new
// token); keys k with k > pos - window are visible when window > 0; softcap > 0 maps each scaled score s to
// tanh(s / softcap) * softcap.
struct DecodeParams {
  void* out;                     // [num_seqs, num_heads, head_dim], contiguous
  const void* query;             // [num_seqs, num_heads, head_dim], strides q_seq_stride / q_head_stride, dim 1
  const void* key_cache;         // [num_blocks, block_size, num_kv_heads, head_dim] (NHD pages), dim stride 1
  const void* value_cache;
  const int32_t* block_tables;   // [num_seqs, max_blocks_per_seq]
  const int32_t* context_lens;   // [num_seqs]
  float* tmp_out;                // [num_seqs, num_heads, max_partitions, head_dim]; partitioned launches only
  float* tmp_max;                // [num_seqs, num_heads, max_partitions] (log2 domain)
  float* tmp_sum;                // [num_seqs, num_heads, max_partitions]
  int64_t q_seq_stride, q_head_stride;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq;
  int partition_size;            // tokens per partition; 0: one pass over the whole context, no reduce step
  int max_partitions;
  int window;                    // 0: no sliding window
  float scale, softcap;          // softcap 0: off
};

// How a decode launch splits the context. partition_size 0 means a single pass.
struct DecodePlan {
  int partition_size;
  int max_partitions;
};

// requested_partition_size > 0 forces that partition size (a single partition still runs in one pass);
// 0 picks one from the grid size: long contexts over few sequences are split so that every SM has work.
DecodePlan plan_decode(int num_seqs, int num_heads, int num_kv_heads, int head_dim, int max_context_len, int window,
                       int requested_partition_size, int num_sms);

// cudaErrorInvalidValue for an unsupported dtype / head_dim (64, 128, 256) / head ratio.
cudaError_t paged_decode(const DecodeParams& params, DType dtype, cudaStream_t stream);

// reshape_and_cache: key/value rows [num_tokens, num_kv_heads, head_dim] into their flat slots
// (block * block_size + offset) of the NHD pages. Negative slots are skipped (padding).
struct StoreParams {
  const void* key;
  const void* value;
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;   // [num_tokens]
  int64_t key_token_stride, key_head_stride, value_token_stride, value_head_stride;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int num_tokens, num_kv_heads, head_dim, block_size;
};

cudaError_t store_kv(const StoreParams& params, DType dtype, cudaStream_t stream);

// Block copies between two paged storages shaped [num_slices, num_blocks, ...] where each block is block_bytes
// contiguous bytes (the KV storage [layers, 2, num_blocks, block_size, H_kv, D] has layers * 2 slices).
// src and dst may be the same storage (copy-on-write), or one of them pinned host memory mapped into the
// device's address space (swap): one launch moves all blocks, however scattered.
struct CopyBlocksParams {
  const char* src;
  char* dst;
  const int64_t* mapping;        // [num_pairs, 2]: (src block, dst block), device-readable
  int64_t num_pairs, num_slices;
  int64_t src_slice_stride, dst_slice_stride;   // bytes
  int64_t src_block_stride, dst_block_stride;   // bytes
  int64_t block_bytes;
};

cudaError_t copy_blocks(const CopyBlocksParams& params, cudaStream_t stream);

}  // namespace hf_paged
