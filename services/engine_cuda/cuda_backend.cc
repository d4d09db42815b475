// The CUDA backend of LlamaEngine: bf16 weights and activations, fp32
// residual stream and accumulation, cuBLAS GEMMs, the kernels of kernels.cu,
// a paged bf16 KV pool in device memory, and CUDA Graph replay of decode and
// verify steps bucketed by batch size.
//
// One step: the host packs the batch's metadata (step_plan.h) into a pinned
// buffer, one async copy puts it at fixed device addresses, then either a
// graph captured for the step's shape replays or the same launch sequence
// runs eagerly; logits (or hidden states, for a pipeline stage) come back in
// one copy. Graph and eager paths share RunStep, so they can differ only by
// what capture cannot see (use_graphs=false is the reference to compare).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/nccl_communicator.h"
#include "common/float16.h"
#include "common/status_macros.h"
#include "engine/attention_math.h"
#include "engine/engine_backend.h"
#include "engine/step_plan.h"
#include "engine_cuda/cublas_loader.h"
#include "engine_cuda/kernels.h"

namespace pdserve::engine {
namespace {

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorString(error)));
}

absl::Status CublasStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": cuBLAS status ", static_cast<int>(status)));
}

// Device memory, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      if (ptr_ != nullptr) cudaFree(ptr_);
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  absl::Status Allocate(size_t bytes, const char* what) {
    *this = DeviceBuffer();
    if (bytes == 0) return absl::OkStatus();
    void* p = nullptr;
    const cudaError_t error = cudaMalloc(&p, bytes);
    if (error != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state
      return absl::ResourceExhaustedError(
          absl::StrCat("cudaMalloc of ", bytes, " bytes for ", what, ": ",
                       cudaGetErrorString(error)));
    }
    ptr_ = p;
    bytes_ = bytes;
    return absl::OkStatus();
  }
  template <typename T>
  absl::Status Upload(const std::vector<T>& host, const char* what) {
    PDS_RETURN_IF_ERROR(Allocate(host.size() * sizeof(T), what));
    if (host.empty()) return absl::OkStatus();
    return CudaStatus(
        cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice), what);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory (async copies from it do not stage).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  absl::Status Allocate(size_t bytes) {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    return CudaStatus(cudaMallocHost(&ptr_, bytes), "cudaMallocHost");
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

class StreamHandle {
 public:
  ~StreamHandle() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  absl::Status Create() {
    return CudaStatus(
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
        "cudaStreamCreate");
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A cuBLAS handle and the entry points it is used through (cuBLAS is
// loaded on the first Create(), cublas_loader.h says why).
class CublasHandle {
 public:
  ~CublasHandle() {
    if (handle_ != nullptr) api_->destroy(handle_);
  }
  absl::Status Create() {
    absl::StatusOr<const cuda::CublasApi*> api = cuda::LoadCublas();
    if (!api.ok()) return api.status();
    api_ = *api;
    return CublasStatus(api_->create(&handle_), "cublasCreate");
  }
  cublasHandle_t get() const { return handle_; }
  const cuda::CublasApi& api() const { return *api_; }

 private:
  const cuda::CublasApi* api_ = nullptr;
  cublasHandle_t handle_ = nullptr;
};

class GraphExec {
 public:
  explicit GraphExec(cudaGraphExec_t exec) : exec_(exec) {}
  ~GraphExec() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  }
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  cudaGraphExec_t get() const { return exec_; }

 private:
  cudaGraphExec_t exec_;
};

struct DeviceLayer {
  DeviceBuffer attn_norm;  // f32 [hidden]
  DeviceBuffer wqkv;       // bf16 [qkv_rows, hidden]
  DeviceBuffer wo;         // bf16 [hidden, attn_width]
  DeviceBuffer ffn_norm;   // f32 [hidden]
  DeviceBuffer w_gate_up;  // bf16 [2 ffn, hidden]
  DeviceBuffer w_down;     // bf16 [hidden, ffn]
  // Family extras in f32, empty (null) when the model has none: the q/k/v
  // biases of this rank's rows [qkv_rows], the q/k norms [head_dim], the
  // o_proj bias [hidden].
  DeviceBuffer qkv_bias, q_norm, k_norm, o_bias;

  int64_t bytes() const {
    return attn_norm.bytes() + wqkv.bytes() + wo.bytes() + ffn_norm.bytes() +
           w_gate_up.bytes() + w_down.bytes() + qkv_bias.bytes() +
           q_norm.bytes() + k_norm.bytes() + o_bias.bytes();
  }
};

std::vector<uint16_t> ToBf16(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = FloatToBf16(values[i]);
  return out;
}

// Steps of at most this many tokens split each token's context into
// partitions (flash-decoding); bigger steps have parallelism enough in their
// tokens and run one partition per token.
constexpr int kSplitMaxTokens = 256;
// Bounds the partials buffer: kSplitMaxTokens x kMaxPartitions runs per query
// head (272 MB for 32 heads of 128 dims).
constexpr int kMaxPartitions = 64;
constexpr int kMaxHeadDim = 256;

// Keys per partition that keep a max-context sequence within kMaxPartitions.
int PartitionForContext(int max_context) {
  return (max_context + kMaxPartitions - 1) / kMaxPartitions;
}

class CudaBackend final : public EngineBackend {
 public:
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(
      const model::WeightSource& weights, const EngineOptions& options,
      ShardPlan plan);
  ~CudaBackend() override {
    // Members free device memory after this body: on this engine's device.
    cudaSetDevice(options_.device);
    graphs_.clear();
  }

  const ShardPlan& plan() const override { return plan_; }
  kv::KvDType kv_dtype() const override { return kv::KvDType::kBF16; }
  bool kv_on_device() const override { return true; }
  int64_t weight_bytes() const override { return weight_bytes_; }
  absl::Status Forward(const ForwardBatch& batch, kv::KvPool& pool,
                       ForwardResult* result) override;
  absl::StatusOr<std::unique_ptr<kv::KvPool>> CreateKvPool(
      const kv::KvCacheLayout& layout, int64_t num_blocks) override;
  absl::Status CopyBlocksFromHost(const kv::KvPool& host,
                                  std::span<const int32_t> blocks,
                                  kv::KvPool& pool) override;
  absl::Status CopyToHost(const kv::KvPool& pool,
                          std::span<const kv::StridedCopy> copies,
                          kv::KvPool& host) override;

 private:
  absl::Status Init(const model::WeightSource& weights);
  absl::Status LoadWeights(const model::WeightSource& weights);
  absl::Status EnsureStepBuffers(int block_size, kv::KvPool& pool);
  // How a step runs attention: the kernel and grid (PlanAttention), the
  // prefill tiles, and for the legacy kernel its partitions.
  struct StepAttention {
    AttentionPlan plan;
    int num_items = 0;  // sequences (decode) or tiles (prefill)
    int legacy_partition = 0;
    int legacy_partitions = 1;
  };
  StepAttention PlanStepAttention(int num_sequences, int max_queries,
                                  int num_tokens, int num_tiles,
                                  int longest_context) const;
  // Enqueues one whole step on stream_ (what a graph captures): every layer,
  // then the logits of the first min(num_logit_rows, max_logit_rows_) rows.
  absl::Status RunStep(int num_tokens, int num_logit_rows,
                       const StepAttention& attention);
  // Final norm of every logit row (RunStep), then lm_head, all-reduce and
  // argmax of rows [begin, begin + rows) into logits_ and argmax_ + begin.
  absl::Status NormalizeLogitRows(int num_logit_rows);
  absl::Status LogitsSlice(int begin, int rows);
  absl::Status Gemm(const uint16_t* x, int rows, int64_t in,
                    const DeviceBuffer& w, int64_t out, float* y, int64_t ldy);
  absl::Status AllReduce(float* data, int64_t count);
  absl::StatusOr<cudaGraphExec_t> GraphFor(const GraphShape& shape);
  const int32_t* Meta(int64_t offset) const {
    return meta_device_.as<int32_t>() + offset;
  }

  ShardPlan plan_;
  CudaOptions options_;
  comm::Communicator* communicator_ = nullptr;
  comm::NcclCommunicator* nccl_ = nullptr;  // set when communicator_ is NCCL
  bool graphs_enabled_ = false;
  int64_t weight_bytes_ = 0;
  int max_context_ = 0;
  int max_logit_rows_ = 0;
  int split_partition_ = 0;  // legacy kernel: keys per partition when split
  AttentionEngineShape attention_shape_;

  StreamHandle stream_;
  CublasHandle cublas_;
  DeviceBuffer cublas_workspace_;

  DeviceBuffer embedding_;  // bf16 [vocab_rows, hidden]
  std::vector<DeviceLayer> layers_;
  DeviceBuffer final_norm_;  // f32
  DeviceBuffer lm_head_;     // bf16 [vocab_rows, hidden]
  DeviceBuffer rope_cos_, rope_sin_;

  // Activations, sized for options_.max_tokens_per_step.
  DeviceBuffer x_, normed_, qkv_, attn_out_, proj_, gate_up_, act_;
  DeviceBuffer partials_, gathered_, logits_, argmax_;
  std::vector<float> host_reduce_;  // staging for non-NCCL communicators

  // Step metadata (fixed addresses; graphs read them on replay).
  int block_size_ = 0;
  StepMetadataLayout meta_layout_;
  PinnedBuffer meta_host_;
  DeviceBuffer meta_device_;
  cuda::KvCacheView cache_;  // the pool graphs were captured against
  std::vector<int> buckets_;
  std::map<std::pair<int, int>, std::unique_ptr<GraphExec>> graphs_;
};

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    const model::WeightSource& weights, const EngineOptions& options,
    ShardPlan plan) {
  if (options.kv_dtype.has_value() && *options.kv_dtype != kv::KvDType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA backend keeps KV in bf16, not ",
                     kv::KvDTypeName(*options.kv_dtype)));
  }
  auto backend = std::unique_ptr<CudaBackend>(new CudaBackend());
  backend->plan_ = std::move(plan);
  backend->options_ = options.cuda;
  backend->communicator_ = options.communicator;
  PDS_RETURN_IF_ERROR(backend->Init(weights));
  return backend;
}

absl::Status CudaBackend::Init(const model::WeightSource& weights) {
  const model::ModelConfig& c = plan_.config;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        "the CUDA backend needs a GPU and none is visible");
  }
  if (options_.device < 0 || options_.device >= devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA device ", options_.device, " of ", devices, " visible"));
  }
  if (c.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim ", c.head_dim, " exceeds the CUDA kernels' ", kMaxHeadDim));
  }
  if (options_.max_tokens_per_step < 1 || options_.max_sequences < 1 ||
      options_.attention_partition < 1) {
    return absl::InvalidArgumentError(
        "CUDA options need positive max_tokens_per_step, max_sequences and "
        "attention_partition");
  }
  PDS_RETURN_IF_ERROR(
      CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
  PDS_RETURN_IF_ERROR(stream_.Create());
  PDS_RETURN_IF_ERROR(cublas_.Create());
  PDS_RETURN_IF_ERROR(
      CublasStatus(cublas_.api().set_stream(cublas_.get(), stream_.get()),
                   "cublasSetStream"));
  // A workspace of our own, so cuBLAS never allocates inside a graph capture.
  PDS_RETURN_IF_ERROR(cublas_workspace_.Allocate(32 << 20, "cuBLAS workspace"));
  PDS_RETURN_IF_ERROR(CublasStatus(
      cublas_.api().set_workspace(cublas_.get(), cublas_workspace_.as<void>(),
                                  cublas_workspace_.bytes()),
      "cublasSetWorkspace"));
  nccl_ = dynamic_cast<comm::NcclCommunicator*>(communicator_);
  // A host communicator blocks on the CPU mid-step, which no graph can hold.
  graphs_enabled_ =
      options_.use_graphs && (plan_.shard.tp_size == 1 || nccl_ != nullptr);
  buckets_ = GraphBatchBuckets(
      std::min(options_.max_graph_batch, options_.max_sequences));

  PDS_RETURN_IF_ERROR(LoadWeights(weights));

  // Activations for the largest step.
  const int64_t t = options_.max_tokens_per_step;
  const int64_t hidden = c.hidden_size;
  max_context_ = c.max_position_embeddings;
  max_logit_rows_ = static_cast<int>(std::min<int64_t>(
      t, options_.max_logit_rows > 0
             ? options_.max_logit_rows
             : std::max(256, options_.max_graph_batch *
                                 options_.max_graph_tokens_per_sequence)));
  split_partition_ =
      std::max(options_.attention_partition, PartitionForContext(max_context_));
  const int64_t partial_rows =
      std::max<int64_t>(t, int64_t{kSplitMaxTokens} * kMaxPartitions);
  PDS_RETURN_IF_ERROR(x_.Allocate(t * hidden * 4, "hidden states"));
  PDS_RETURN_IF_ERROR(normed_.Allocate(t * hidden * 2, "normed"));
  PDS_RETURN_IF_ERROR(qkv_.Allocate(t * plan_.qkv_rows() * 4, "qkv"));
  PDS_RETURN_IF_ERROR(
      attn_out_.Allocate(t * plan_.attn_width() * 2, "attention out"));
  PDS_RETURN_IF_ERROR(proj_.Allocate(t * hidden * 4, "projection"));
  PDS_RETURN_IF_ERROR(
      gate_up_.Allocate(t * 2 * plan_.ffn_rows() * 4, "gate/up"));
  PDS_RETURN_IF_ERROR(act_.Allocate(t * plan_.ffn_rows() * 2, "activation"));
  PDS_RETURN_IF_ERROR(
      partials_.Allocate(partial_rows * plan_.q_heads * (c.head_dim + 2) * 4,
                         "attention partials"));
  if (plan_.holds_last()) {
    // Every token of a step may want logits (a prefill chunk scoring its
    // prompt): rows beyond max_logit_rows_ go through the lm_head in slices
    // of that many, so only the [rows, vocab] buffer is bounded.
    PDS_RETURN_IF_ERROR(gathered_.Allocate(t * hidden * 4, "logit rows"));
    PDS_RETURN_IF_ERROR(logits_.Allocate(
        int64_t{max_logit_rows_} * c.vocab_size * 4, "logits"));
    PDS_RETURN_IF_ERROR(argmax_.Allocate(t * 4, "argmax"));
  }

  PDS_RETURN_IF_ERROR(cuda::ConfigureAttentionKernels());
  int multiprocessors = 0;
  PDS_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount,
                             options_.device),
      "cudaDeviceGetAttribute"));
  attention_shape_.group = c.num_heads / c.num_kv_heads;
  attention_shape_.head_dim = c.head_dim;
  attention_shape_.local_kv_heads = plan_.kv_heads;
  attention_shape_.multiprocessors = multiprocessors;
  attention_shape_.partial_capacity = partial_rows;
  return absl::OkStatus();
}

absl::Status CudaBackend::LoadWeights(const model::WeightSource& weights) {
  const model::ModelConfig& c = plan_.config;
  if (plan_.holds_first()) {
    std::vector<float> embedding;
    PDS_RETURN_IF_ERROR(LoadEmbedding(weights, plan_, &embedding));
    PDS_RETURN_IF_ERROR(embedding_.Upload(ToBf16(embedding), "embedding"));
  }
  if (plan_.holds_last()) {
    std::vector<float> norm, head;
    PDS_RETURN_IF_ERROR(LoadHead(weights, plan_, &norm, &head));
    PDS_RETURN_IF_ERROR(final_norm_.Upload(norm, "final norm"));
    PDS_RETURN_IF_ERROR(lm_head_.Upload(ToBf16(head), "lm_head"));
  }
  std::vector<float> cos, sin;
  BuildRopeTables(c, &cos, &sin);
  PDS_RETURN_IF_ERROR(rope_cos_.Upload(cos, "rope cos"));
  PDS_RETURN_IF_ERROR(rope_sin_.Upload(sin, "rope sin"));

  // Layers load in parallel: reading (or generating) and converting f32 to
  // bf16 on the host is what takes the time for an 8B model.
  const int num_layers = plan_.num_layers();
  layers_.resize(num_layers);
  std::atomic<int> next{0};
  std::mutex mu;
  absl::Status first_error;
  const int workers = std::max(
      1, std::min<int>(num_layers,
                       std::min(8u, std::thread::hardware_concurrency())));
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      cudaSetDevice(options_.device);
      for (int i = next++; i < num_layers; i = next++) {
        absl::Status status = [&]() -> absl::Status {
          HostLayerWeights host;
          PDS_RETURN_IF_ERROR(LoadLayerWeights(
              weights, plan_, plan_.shard.layer_begin + i, &host));
          DeviceLayer& d = layers_[i];
          PDS_RETURN_IF_ERROR(d.attn_norm.Upload(host.attn_norm, "attn norm"));
          PDS_RETURN_IF_ERROR(d.ffn_norm.Upload(host.ffn_norm, "ffn norm"));
          PDS_RETURN_IF_ERROR(d.wqkv.Upload(ToBf16(host.wqkv), "wqkv"));
          PDS_RETURN_IF_ERROR(d.wo.Upload(ToBf16(host.wo), "wo"));
          PDS_RETURN_IF_ERROR(
              d.w_gate_up.Upload(ToBf16(host.w_gate_up), "w_gate_up"));
          // Biases and norm weights stay f32: they are added to and scale
          // f32 activations (an empty vector uploads nothing).
          PDS_RETURN_IF_ERROR(d.qkv_bias.Upload(host.qkv_bias, "qkv bias"));
          PDS_RETURN_IF_ERROR(d.q_norm.Upload(host.q_norm, "q norm"));
          PDS_RETURN_IF_ERROR(d.k_norm.Upload(host.k_norm, "k norm"));
          PDS_RETURN_IF_ERROR(d.o_bias.Upload(host.o_bias, "o_proj bias"));
          return d.w_down.Upload(ToBf16(host.w_down), "w_down");
        }();
        if (!status.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (first_error.ok()) first_error = status;
          next = num_layers;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  PDS_RETURN_IF_ERROR(first_error);

  weight_bytes_ = embedding_.bytes() + final_norm_.bytes() + lm_head_.bytes();
  for (const DeviceLayer& d : layers_) weight_bytes_ += d.bytes();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<kv::KvPool>> CudaBackend::CreateKvPool(
    const kv::KvCacheLayout& layout, int64_t num_blocks) {
  PDS_RETURN_IF_ERROR(layout.Validate());
  if (layout.dtype != kv::KvDType::kBF16) {
    return absl::InvalidArgumentError("the CUDA backend keeps KV in bf16");
  }
  if (num_blocks < 1 || num_blocks * layout.block_size > int64_t{INT32_MAX}) {
    return absl::InvalidArgumentError(absl::StrCat(
        num_blocks, " blocks of ", layout.block_size,
        " slots: the slot index must fit in int32 (and be positive)"));
  }
  PDS_RETURN_IF_ERROR(
      CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
  const int64_t bytes = layout.block_bytes() * num_blocks;
  void* data = nullptr;
  if (cudaMalloc(&data, bytes) != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(
        "no ", bytes, " bytes of GPU memory for ", num_blocks, " KV blocks"));
  }
  if (absl::Status s = CudaStatus(cudaMemset(data, 0, bytes), "zero KV pool");
      !s.ok()) {
    cudaFree(data);
    return s;
  }
  const int device = options_.device;
  return kv::KvPool::Wrap(layout, num_blocks, data, bytes, [data, device] {
    cudaSetDevice(device);
    cudaFree(data);
  });
}

absl::Status CudaBackend::CopyBlocksFromHost(const kv::KvPool& host,
                                             std::span<const int32_t> blocks,
                                             kv::KvPool& pool) {
  PDS_RETURN_IF_ERROR(
      CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
  // A block holds every layer contiguously, so consecutive block ids are one
  // contiguous run: one copy per run.
  const int64_t bytes = pool.layout().block_bytes();
  const char* source = static_cast<const char*>(host.data());
  char* target = static_cast<char*>(pool.data());
  for (size_t i = 0; i < blocks.size();) {
    size_t j = i + 1;
    while (j < blocks.size() && blocks[j] == blocks[j - 1] + 1) ++j;
    PDS_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(target + blocks[i] * bytes, source + blocks[i] * bytes,
                        (j - i) * bytes, cudaMemcpyHostToDevice, stream_.get()),
        "copy KV blocks to the device"));
    i = j;
  }
  return CudaStatus(cudaStreamSynchronize(stream_.get()),
                    "copy KV blocks to the device");
}

absl::Status CudaBackend::CopyToHost(const kv::KvPool& pool,
                                     std::span<const kv::StridedCopy> copies,
                                     kv::KvPool& host) {
  PDS_RETURN_IF_ERROR(
      CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
  const char* source = static_cast<const char*>(pool.data());
  char* target = static_cast<char*>(host.data());
  for (const kv::StridedCopy& c : copies) {
    PDS_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpy2DAsync(target + c.offset, c.pitch, source + c.offset,
                          c.pitch, c.width, c.rows, cudaMemcpyDeviceToHost,
                          stream_.get()),
        "copy KV to the host"));
  }
  return CudaStatus(cudaStreamSynchronize(stream_.get()),
                    "copy KV to the host");
}

absl::Status CudaBackend::EnsureStepBuffers(int block_size, kv::KvPool& pool) {
  if (block_size != block_size_) {
    graphs_.clear();
    block_size_ = block_size;
    meta_layout_ = StepMetadataLayout::For(
        options_.max_tokens_per_step, options_.max_sequences,
        (max_context_ + block_size - 1) / block_size,
        PrefillTokensPerTile(attention_shape_.group));
    PDS_RETURN_IF_ERROR(meta_host_.Allocate(meta_layout_.total * 4));
    PDS_RETURN_IF_ERROR(
        meta_device_.Allocate(meta_layout_.total * 4, "step metadata"));
  }
  const kv::KvCacheLayout& layout = pool.layout();
  uint16_t* base = static_cast<uint16_t*>(pool.data());
  if (base != cache_.base) graphs_.clear();  // captured against another pool
  cache_.base = base;
  cache_.block_size = layout.block_size;
  cache_.head_dim = layout.head_dim;
  cache_.num_kv_heads = layout.num_kv_heads;
  cache_.num_layers = layout.num_layers;
  return absl::OkStatus();
}

absl::Status CudaBackend::Gemm(const uint16_t* x, int rows, int64_t in,
                               const DeviceBuffer& w, int64_t out, float* y,
                               int64_t ldy) {
  // Only 1-2 rows: the kernel re-reads every x row per weight chunk, so it
  // turns instruction-bound as rows grow (a γ=4 verify step, 5 rows, took
  // 8.7 ms with it against 6.0 ms with cuBLAS on llama-8b, H200).
  constexpr int kGemvRows = 2;
  if (options_.small_batch_gemv && rows <= kGemvRows && in % 8 == 0) {
    return cuda::LaunchSmallBatchGemv(x, rows, in, w.as<uint16_t>(), out, y,
                                      ldy, stream_.get());
  }
  // Row-major y[rows, out] = x[rows, in] · w[out, in]^T is, in cuBLAS's
  // column-major terms, y^T = w^T(op T of the [in, out] matrix) · x^T.
  const float alpha = 1.0f, beta = 0.0f;
  return CublasStatus(
      cublas_.api().gemm_ex(
          cublas_.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), rows,
          static_cast<int>(in), &alpha, w.as<void>(), CUDA_R_16BF,
          static_cast<int>(in), x, CUDA_R_16BF, static_cast<int>(in), &beta, y,
          CUDA_R_32F, static_cast<int>(ldy), CUBLAS_COMPUTE_32F,
          CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

absl::Status CudaBackend::AllReduce(float* data, int64_t count) {
  if (plan_.shard.tp_size == 1) return absl::OkStatus();
  if (nccl_ != nullptr) {
    return nccl_->EnqueueAllReduceSumDevice(data, count, stream_.get());
  }
  host_reduce_.resize(count);
  PDS_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(host_reduce_.data(), data, count * 4,
                                 cudaMemcpyDeviceToHost, stream_.get()),
                 "all-reduce staging"));
  PDS_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(stream_.get()), "all-reduce staging"));
  PDS_RETURN_IF_ERROR(communicator_->AllReduceSum(host_reduce_));
  return CudaStatus(cudaMemcpyAsync(data, host_reduce_.data(), count * 4,
                                    cudaMemcpyHostToDevice, stream_.get()),
                    "all-reduce staging");
}

CudaBackend::StepAttention CudaBackend::PlanStepAttention(
    int num_sequences, int max_queries, int num_tokens, int num_tiles,
    int longest_context) const {
  StepAttention a;
  a.plan = PlanAttention(options_.attention, num_sequences, max_queries,
                         num_tokens, attention_shape_);
  a.num_items =
      a.plan.kernel == AttentionKernel::kPrefill ? num_tiles : num_sequences;
  const bool split = num_tokens <= kSplitMaxTokens;
  a.legacy_partition = split ? split_partition_ : max_context_;
  a.legacy_partitions =
      split ? NumPartitions(longest_context, split_partition_) : 1;
  return a;
}

absl::Status CudaBackend::RunStep(int n, int num_logit_rows,
                                  const StepAttention& step_attention) {
  const model::ModelConfig& c = plan_.config;
  const int hidden = c.hidden_size;
  cudaStream_t s = stream_.get();
  float* x = x_.as<float>();
  float* proj = proj_.as<float>();
  uint16_t* normed = normed_.as<uint16_t>();
  const int32_t* positions = Meta(meta_layout_.positions);
  const int32_t* slots = Meta(meta_layout_.slots);

  if (plan_.holds_first()) {
    PDS_RETURN_IF_ERROR(cuda::LaunchEmbed(
        embedding_.as<uint16_t>(), plan_.vocab_begin, plan_.vocab_rows(),
        hidden, Meta(meta_layout_.tokens), n, x, s));
    PDS_RETURN_IF_ERROR(AllReduce(x, int64_t{n} * hidden));
  }
  cuda::AttentionArgs attention;
  attention.qkv = qkv_.as<float>();
  attention.num_tokens = n;
  attention.q_heads = plan_.q_heads;
  attention.q_head_offset = plan_.q_head_offset;
  attention.group = c.num_heads / c.num_kv_heads;
  attention.kv_head_offset = plan_.kv_head_offset;
  attention.positions = positions;
  attention.token_sequence = Meta(meta_layout_.token_sequence);
  attention.block_tables = Meta(meta_layout_.block_tables);
  attention.max_blocks_per_sequence = meta_layout_.max_blocks_per_sequence;
  attention.cache = cache_;
  attention.partition = step_attention.legacy_partition;
  attention.partitions = step_attention.legacy_partitions;
  attention.partials = partials_.as<float>();
  attention.out = attn_out_.as<uint16_t>();
  attention.header = Meta(meta_layout_.header);
  const AttentionPlan& plan = step_attention.plan;
  attention.items = Meta(plan.kernel == AttentionKernel::kPrefill
                             ? meta_layout_.attention_tiles
                             : meta_layout_.sequence_items);

  const int64_t f = plan_.ffn_rows();
  const int num_layers = plan_.num_layers();
  for (int l = 0; l < num_layers; ++l) {
    const DeviceLayer& w = layers_[l];
    // Layer 0 normalizes the incoming stream; later layers got theirs from
    // the previous layer's fused residual add.
    if (l == 0) {
      PDS_RETURN_IF_ERROR(
          cuda::LaunchRmsNorm(x, nullptr, w.attn_norm.as<float>(),
                              c.rms_norm_eps, hidden, n, normed, s));
    }
    PDS_RETURN_IF_ERROR(Gemm(normed, n, hidden, w.wqkv, plan_.qkv_rows(),
                             qkv_.as<float>(), plan_.qkv_rows()));
    cuda::QkvExtras extras;
    extras.bias = w.qkv_bias.as<float>();
    extras.q_norm = w.q_norm.as<float>();
    extras.k_norm = w.k_norm.as<float>();
    extras.eps = c.rms_norm_eps;
    PDS_RETURN_IF_ERROR(cuda::LaunchRopeWriteKv(
        qkv_.as<float>(), n, plan_.q_heads, positions, slots,
        rope_cos_.as<float>(), rope_sin_.as<float>(), cache_, l, extras, s));
    attention.layer = l;
    attention.window = c.LayerWindow(plan_.shard.layer_begin + l);
    switch (plan.kernel) {
      case AttentionKernel::kDecode:
        PDS_RETURN_IF_ERROR(cuda::LaunchDecodeAttention(
            attention, step_attention.num_items, plan.rows, plan.splits, s));
        break;
      case AttentionKernel::kPrefill:
        PDS_RETURN_IF_ERROR(cuda::LaunchPrefillAttention(
            attention, step_attention.num_items, s));
        break;
      case AttentionKernel::kLegacy:
        PDS_RETURN_IF_ERROR(cuda::LaunchPagedAttention(attention, s));
        break;
    }
    PDS_RETURN_IF_ERROR(Gemm(attn_out_.as<uint16_t>(), n, plan_.attn_width(),
                             w.wo, hidden, proj, hidden));
    PDS_RETURN_IF_ERROR(AllReduce(proj, int64_t{n} * hidden));
    // x += attention (+ the o_proj bias, after the sum so every rank adds it
    // once); normed = RMSNorm(x) for the MLP.
    const float* o_bias = w.o_bias.as<float>();
    if (options_.fuse_residual_norm) {
      PDS_RETURN_IF_ERROR(cuda::LaunchRmsNorm(x, proj, w.ffn_norm.as<float>(),
                                              c.rms_norm_eps, hidden, n, normed,
                                              s, o_bias));
    } else {
      if (o_bias != nullptr) {
        PDS_RETURN_IF_ERROR(cuda::LaunchAddRowBias(proj, o_bias, n, hidden, s));
      }
      PDS_RETURN_IF_ERROR(cuda::LaunchAdd(x, proj, int64_t{n} * hidden, s));
      PDS_RETURN_IF_ERROR(
          cuda::LaunchRmsNorm(x, nullptr, w.ffn_norm.as<float>(),
                              c.rms_norm_eps, hidden, n, normed, s));
    }
    PDS_RETURN_IF_ERROR(Gemm(normed, n, hidden, w.w_gate_up, 2 * f,
                             gate_up_.as<float>(), 2 * f));
    PDS_RETURN_IF_ERROR(
        cuda::LaunchSwiGlu(gate_up_.as<float>(), n, f, act_.as<uint16_t>(), s));
    PDS_RETURN_IF_ERROR(
        Gemm(act_.as<uint16_t>(), n, f, w.w_down, hidden, proj, hidden));
    PDS_RETURN_IF_ERROR(AllReduce(proj, int64_t{n} * hidden));
    if (l + 1 < num_layers) {
      const float* next_norm = layers_[l + 1].attn_norm.as<float>();
      if (options_.fuse_residual_norm) {
        PDS_RETURN_IF_ERROR(cuda::LaunchRmsNorm(
            x, proj, next_norm, c.rms_norm_eps, hidden, n, normed, s));
      } else {
        PDS_RETURN_IF_ERROR(cuda::LaunchAdd(x, proj, int64_t{n} * hidden, s));
        PDS_RETURN_IF_ERROR(cuda::LaunchRmsNorm(
            x, nullptr, next_norm, c.rms_norm_eps, hidden, n, normed, s));
      }
    } else {
      PDS_RETURN_IF_ERROR(cuda::LaunchAdd(x, proj, int64_t{n} * hidden, s));
    }
  }

  if (!plan_.holds_last() || num_logit_rows == 0) return absl::OkStatus();
  PDS_RETURN_IF_ERROR(NormalizeLogitRows(num_logit_rows));
  return LogitsSlice(0, std::min(num_logit_rows, max_logit_rows_));
}

absl::Status CudaBackend::NormalizeLogitRows(int num_logit_rows) {
  const model::ModelConfig& c = plan_.config;
  cudaStream_t s = stream_.get();
  float* gathered = gathered_.as<float>();
  PDS_RETURN_IF_ERROR(
      cuda::LaunchGatherRows(x_.as<float>(), Meta(meta_layout_.logit_rows),
                             num_logit_rows, c.hidden_size, gathered, s));
  return cuda::LaunchRmsNorm(gathered, nullptr, final_norm_.as<float>(),
                             c.rms_norm_eps, c.hidden_size, num_logit_rows,
                             normed_.as<uint16_t>(), s);
}

absl::Status CudaBackend::LogitsSlice(int begin, int rows) {
  const model::ModelConfig& c = plan_.config;
  cudaStream_t s = stream_.get();
  float* logits = logits_.as<float>();
  const int64_t vocab = c.vocab_size;
  if (plan_.shard.tp_size > 1) {
    // Vocab-parallel lm_head: each rank fills its columns of zeroed rows and
    // the all-reduce (a sum) gathers them.
    PDS_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(logits, 0, int64_t{rows} * vocab * 4, s),
                   "zero logits"));
  }
  PDS_RETURN_IF_ERROR(
      Gemm(normed_.as<uint16_t>() + int64_t{begin} * c.hidden_size, rows,
           c.hidden_size, lm_head_, plan_.vocab_rows(),
           logits + plan_.vocab_begin, vocab));
  PDS_RETURN_IF_ERROR(AllReduce(logits, int64_t{rows} * vocab));
  // Greedy picks on the device: a caller that needs only them copies
  // rows x 4 bytes instead of rows x vocab x 4.
  return cuda::LaunchArgmaxRows(logits, rows, c.vocab_size,
                                argmax_.as<int32_t>() + begin, s);
}

absl::StatusOr<cudaGraphExec_t> CudaBackend::GraphFor(const GraphShape& shape) {
  const auto key = std::make_pair(shape.batch, shape.tokens_per_sequence);
  if (auto it = graphs_.find(key); it != graphs_.end()) {
    return it->second->get();
  }
  const int n = shape.batch * shape.tokens_per_sequence;
  // The grid comes from the shape alone, so one graph serves every context
  // length: the legacy kernel splits for the longest context the engine
  // allows (empty partitions exit at once); the decode kernel reads each
  // replay's partition length from the metadata.
  const int tiles = shape.batch * NumPartitions(shape.tokens_per_sequence,
                                                meta_layout_.tokens_per_tile);
  const StepAttention attention = PlanStepAttention(
      shape.batch, shape.tokens_per_sequence, n, tiles, max_context_);
  cudaStream_t s = stream_.get();
  PDS_RETURN_IF_ERROR(
      CudaStatus(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal),
                 "cudaStreamBeginCapture"));
  absl::Status status = RunStep(n, n, attention);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  PDS_RETURN_IF_ERROR(status);
  PDS_RETURN_IF_ERROR(CudaStatus(end, "cudaStreamEndCapture"));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiate = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  PDS_RETURN_IF_ERROR(CudaStatus(instantiate, "cudaGraphInstantiate"));
  graphs_[key] = std::make_unique<GraphExec>(exec);
  return exec;
}

absl::Status CudaBackend::Forward(const ForwardBatch& batch, kv::KvPool& pool,
                                  ForwardResult* result) {
  PDS_RETURN_IF_ERROR(ValidateBatch(plan_, batch, pool.layout(),
                                    pool.num_blocks(), kv::KvDType::kBF16));
  PDS_RETURN_IF_ERROR(
      CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
  PDS_RETURN_IF_ERROR(EnsureStepBuffers(pool.layout().block_size, pool));
  const model::ModelConfig& c = plan_.config;
  const std::optional<GraphShape> shape = GraphShapeFor(
      batch, options_,
      graphs_enabled_ && plan_.holds_first() && plan_.holds_last(), buckets_);
  StepCounts counts;
  PDS_RETURN_IF_ERROR(FillStepMetadata(
      batch, block_size_, meta_layout_, shape,
      std::span<int32_t>(meta_host_.as<int32_t>(), meta_layout_.total),
      &counts));
  // The decode kernel's partition length: set per step, read by the kernels
  // from the metadata, so graph replays follow the context.
  const StepAttention attention =
      shape
          ? PlanStepAttention(shape->batch, shape->tokens_per_sequence,
                              counts.num_tokens, counts.num_tiles, max_context_)
          : PlanStepAttention(counts.num_sequences, counts.max_queries,
                              counts.num_tokens, counts.num_tiles,
                              counts.max_context);
  meta_host_.as<int32_t>()[meta_layout_.header + kHeaderDecodePartition] =
      DecodePartition(counts.max_context, attention.plan.splits);
  cudaStream_t s = stream_.get();
  PDS_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(meta_device_.as<void>(), meta_host_.as<void>(),
                      meta_layout_.total * 4, cudaMemcpyHostToDevice, s),
      "upload step metadata"));
  const int64_t hidden = c.hidden_size;
  if (!plan_.holds_first()) {
    PDS_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(x_.as<void>(), batch.hidden_in.data(),
                        batch.hidden_in.size() * 4, cudaMemcpyHostToDevice, s),
        "upload hidden states"));
  }
  if (shape) {
    // A graph's rows fit max_logit_rows_ (sized for the largest graph).
    PDS_ASSIGN_OR_RETURN(cudaGraphExec_t exec, GraphFor(*shape));
    PDS_RETURN_IF_ERROR(CudaStatus(cudaGraphLaunch(exec, s), "graph launch"));
  } else {
    PDS_RETURN_IF_ERROR(RunStep(counts.num_tokens,
                                plan_.holds_last() ? counts.num_logit_rows : 0,
                                attention));
  }

  result->hidden_out.clear();
  result->logits.clear();
  result->num_logit_rows = 0;
  if (!plan_.holds_last()) {
    result->hidden_out.resize(int64_t{counts.num_tokens} * hidden);
    PDS_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(result->hidden_out.data(), x_.as<void>(),
                                   result->hidden_out.size() * 4,
                                   cudaMemcpyDeviceToHost, s),
                   "download hidden states"));
  } else if (counts.real_logit_rows > 0) {
    const int rows = counts.real_logit_rows;
    result->num_logit_rows = rows;
    if (!batch.argmax_only) {
      result->logits.resize(int64_t{rows} * c.vocab_size);
    }
    // RunStep computed the first slice of max_logit_rows_ rows; an eager
    // step wanting more (a prefill chunk scoring every token) runs the
    // lm_head slice by slice, each copied out before the next overwrites
    // the buffer (stream order).
    for (int begin = 0; begin < rows; begin += max_logit_rows_) {
      const int slice = std::min(max_logit_rows_, rows - begin);
      if (begin > 0) PDS_RETURN_IF_ERROR(LogitsSlice(begin, slice));
      if (!batch.argmax_only) {
        PDS_RETURN_IF_ERROR(CudaStatus(
            cudaMemcpyAsync(
                result->logits.data() + int64_t{begin} * c.vocab_size,
                logits_.as<void>(), int64_t{slice} * c.vocab_size * 4,
                cudaMemcpyDeviceToHost, s),
            "download logits"));
      }
    }
    result->argmax.resize(rows);
    PDS_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(result->argmax.data(), argmax_.as<void>(),
                        result->argmax.size() * 4, cudaMemcpyDeviceToHost, s),
        "download argmax"));
  }
  return CudaStatus(cudaStreamSynchronize(s), "CUDA step");
}

}  // namespace

absl::StatusOr<std::unique_ptr<EngineBackend>> CreateCudaBackend(
    const model::WeightSource& weights, const EngineOptions& options,
    ShardPlan plan) {
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<CudaBackend> backend,
                       CudaBackend::Create(weights, options, std::move(plan)));
  return std::unique_ptr<EngineBackend>(std::move(backend));
}

bool CudaBackendCompiled() { return true; }

absl::StatusOr<std::unique_ptr<comm::InProcessGroup>> CreateNcclGroup(
    int size, const std::vector<int>& devices) {
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<comm::NcclGroup> group,
                       comm::NcclGroup::Create(size, devices));
  return std::unique_ptr<comm::InProcessGroup>(std::move(group));
}

}  // namespace pdserve::engine
