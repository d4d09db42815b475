// Writes Llama GGUF v3 files with tensors in any supported format, quantized
// ones included: what tests and the benchmark use to make GGUF files at run
// time (nothing binary is committed). Quantized tensors go through the plain
// reference quantizer of quant_formats.h, not llama.cpp's search, so a file
// is byte-compatible with llama.cpp but not its quantization of the same
// weights.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/model_config.h"
#include "model/quant_formats.h"
#include "model/weight_source.h"

namespace pdserve::model {

// The values of canonical tensor `name` of `shape`, row-major, HF layout
// (q/k in rotate-half order: the writer permutes them into GGUF's
// interleaved order).
using TensorValuesFn = std::function<std::vector<float>(
    const std::string& name, const std::vector<int64_t>& shape)>;
// The storage format of canonical tensor `name`.
using TensorFormatFn = std::function<TensorFormat(const std::string& name)>;

// Every tensor of LlamaTensorLayout(config), llama.* metadata, and a
// placeholder SentencePiece-style vocabulary of config.vocab_size tokens
// (<unk>, <s>, </s>, the 256 byte tokens, then "tok<i>") that llama.cpp
// accepts — or, with `vocabulary`, that GGUF vocabulary (tokenizer.ggml.*:
// a real tokenizer, e.g. another GGUF's tokenizer_spec(), of exactly
// config.vocab_size tokens). Streams one tensor at a time. INVALID_ARGUMENT
// names a tensor whose rows are not a whole number of its format's blocks,
// or a vocabulary that is not GGUF's or not of the config's size.
[[nodiscard]] absl::Status WriteLlamaGguf(
    const std::string& path, const ModelConfig& config,
    const TensorValuesFn& values, const TensorFormatFn& format_of,
    const TokenizerSpec* vocabulary = nullptr);

// The mix llama.cpp's Q4_K_M file type uses: Q6_K for the output head and
// for v_proj and down_proj in the first and last eighth of the layers and
// every third layer between, Q4_K elsewhere; 1-D tensors (norms) F32.
TensorFormat Q4KMFormatOf(const ModelConfig& config, const std::string& name);

// The GGUF (llama.cpp) name of canonical tensor `name`, e.g.
// "model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight".
std::string GgufNameFromCanonical(const std::string& name);

}  // namespace pdserve::model
