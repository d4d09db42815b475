// The face of services/model: a validated, memory-mapped view of a model's
// tensors, whatever the file format, under one naming and layout convention.
//
// Canonical tensor names (Hugging Face naming), all row-major, [out, in] for
// projection matrices exactly as in a safetensors file:
//   model.embed_tokens.weight                     [vocab, hidden]
//   model.layers.{i}.input_layernorm.weight       [hidden]
//   model.layers.{i}.self_attn.q_proj.weight      [num_heads*head_dim, hidden]
//   model.layers.{i}.self_attn.k_proj.weight      [num_kv_heads*head_dim,
//   hidden] model.layers.{i}.self_attn.v_proj.weight [num_kv_heads*head_dim,
//   hidden] model.layers.{i}.self_attn.o_proj.weight      [hidden,
//   num_heads*head_dim] model.layers.{i}.post_attention_layernorm.weight
//   [hidden] model.layers.{i}.mlp.gate_proj.weight         [intermediate,
//   hidden] model.layers.{i}.mlp.up_proj.weight           [intermediate,
//   hidden] model.layers.{i}.mlp.down_proj.weight         [hidden,
//   intermediate] model.norm.weight                             [hidden]
//   lm_head.weight                                [vocab, hidden] (absent when
//   tied)
// and, where the config's family flags ask for them (tensor_layout.h):
//   model.layers.{i}.self_attn.{q,k,v}_proj.bias  [num_heads*head_dim] /
//   [num_kv_heads*head_dim] (qkv_bias); self_attn.o_proj.bias [hidden]
//   (o_bias); self_attn.{q,k}_norm.weight [head_dim] (qk_norm).
//
// RoPE layout: q_proj/k_proj rows are always returned in the HF "rotate-half"
// layout (within a head, dims j and j+head_dim/2 form a rotation pair). GGUF
// files store Meta's interleaved layout (pairs 2j, 2j+1); the GGUF reader
// permutes rows on read so both layouts give identical logits.
//
// Thread-safety: all const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/model_config.h"
#include "model/quant_formats.h"

namespace pdserve::model {

struct TensorInfo {
  std::string name;  // canonical name
  // Storage dtype in the file for F32/F16/BF16 tensors; kF32 for block-
  // quantized ones, which ReadF32 dequantizes (see `format`).
  DType dtype = DType::kF32;
  TensorFormat format = TensorFormat::kF32;  // storage format in the file
  std::vector<int64_t> shape;  // row-major, outermost first (HF order)
};

// A tensor's stored bytes in place (in the mapped file): how an engine
// computes on f16 or block-quantized weights without widening them. The
// tensor is viewed as rows x cols (a 1-D tensor is one row), each row
// `row_bytes` long and a whole number of blocks of `format`.
struct StoredTensor {
  TensorFormat format = TensorFormat::kF32;
  const uint8_t* data = nullptr;  // row 0
  int64_t rows = 0, cols = 0, row_bytes = 0;
  // Non-zero when rows are stored in Meta's interleaved RoPE order (GGUF
  // q/k projections): within each head of this many rows, HF rotate-half
  // row p·d/2 + j is stored as row 2j + p. ReadF32 undoes this; a user of
  // the stored rows must permute its outputs.
  int interleaved_rope_head_dim = 0;
  // Keeps the mapping alive for as long as the view is held, beyond the
  // WeightSource's own lifetime.
  std::shared_ptr<const void> owner;
};

// A rectangular slice of a 1-D or 2-D tensor. A 1-D tensor of length n is
// viewed as one row of n columns. end == -1 means "to the end".
struct Slice2D {
  int64_t row_begin = 0;
  int64_t row_end = -1;
  int64_t col_begin = 0;
  int64_t col_end = -1;
};

// How to find the tokenizer of a model. Exactly one of the two is set.
struct TokenizerSpec {
  // A Hugging Face tokenizer.json (the fast tokenizer; preferred over
  // tokenizer.model when a folder has both, as transformers does) and the
  // tokenizer_config.json next to it (may be empty: bos/eos then come from
  // the post-processor).
  std::string hf_tokenizer_json_path;
  std::string hf_tokenizer_config_path;
  // A SentencePiece ModelProto file (HF layout: tokenizer.model).
  std::string sentencepiece_model_path;
  // Or a vocabulary embedded in GGUF metadata (tokenizer.ggml.*).
  std::string ggml_model;  // tokenizer.ggml.model, e.g. "llama"
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> token_types;  // llama.cpp token types (1 normal, 2
                                     // unknown, 3 control, 6 byte, ...)
  // gpt2 (byte-level BPE) vocabularies: tokenizer.ggml.merges ("a b", rank
  // order) and tokenizer.ggml.pre, naming the pre-tokenizer regex.
  std::vector<std::string> merges;
  std::string ggml_pre;
  // GGUF `tokenizer.chat_template` (a Jinja chat template), when present.
  std::string chat_template;
  int32_t bos_token_id = -1;
  int32_t eos_token_id = -1;
  int32_t unk_token_id = -1;
  int32_t pad_token_id = -1;
  bool add_bos = true;
  bool add_eos = false;
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;

  virtual const ModelConfig& config() const = 0;
  // Human-readable origin (a path, or "dummy:<config path>") used in errors.
  virtual const std::string& description() const = 0;

  virtual bool HasTensor(std::string_view name) const = 0;
  [[nodiscard]] virtual absl::StatusOr<TensorInfo> GetTensorInfo(
      std::string_view name) const = 0;

  // Converts `slice` of tensor `name` to f32 into `out`, row-major, which must
  // hold (rows * cols) floats. Errors: NOT_FOUND for an unknown tensor,
  // OUT_OF_RANGE for a slice outside the shape.
  [[nodiscard]] virtual absl::Status ReadF32(std::string_view name,
                                             const Slice2D& slice,
                                             float* out) const = 0;

  // The stored bytes of tensor `name`, in place. NOT_FOUND for an unknown
  // tensor; UNIMPLEMENTED for a source that has no stored bytes (dummy
  // weights), whose callers use ReadF32.
  [[nodiscard]] virtual absl::StatusOr<StoredTensor> GetStoredTensor(
      std::string_view name) const;

  [[nodiscard]] virtual absl::StatusOr<TokenizerSpec> tokenizer_spec()
      const = 0;
};

enum class LoadFormat {
  kAuto,  // a *.gguf file, or a folder with config.json + safetensors
  kGguf,
  kSafetensors,  // HF folder
  kDummy,        // path is a config.json (or a folder holding one); weights
                 // are deterministic pseudo-random values, for benchmarks
};

// Opens and fully validates a model: every tensor the architecture needs is
// present with the right shape and a supported dtype, and every byte range
// lies inside its file. Errors carry the file name and what is wrong.
// The name a model is served under when none is given: its file or folder
// name without extension ("…/stories260K" -> "stories260K",
// "…/llama-3.2-1b.Q4_K_M.gguf" -> "llama-3.2-1b.Q4_K_M"). The router and the
// workers derive it alike, so their identities agree.
std::string DefaultModelName(const std::string& path);

[[nodiscard]] absl::StatusOr<std::unique_ptr<WeightSource>> OpenModel(
    const std::string& path, LoadFormat format = LoadFormat::kAuto);

// Parses "auto" | "gguf" | "safetensors" | "dummy".
[[nodiscard]] absl::StatusOr<LoadFormat> ParseLoadFormat(std::string_view text);

// Canonical name helpers.
std::string LayerTensorName(
    int layer, std::string_view suffix);  // "model.layers.{i}.{suffix}"

}  // namespace pdserve::model
