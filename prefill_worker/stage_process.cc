#include "prefill_worker/stage_process.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve::prefill {

absl::StatusOr<std::unique_ptr<StageProcess>> StageProcess::Create(
    const model::WeightSource& weights, const StageProcessOptions& options) {
  if (options.num_stages < 1 || options.stage < 0 ||
      options.stage >= options.num_stages) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stage ", options.stage, " is not in [0, ", options.num_stages, ")"));
  }
  auto process =
      std::unique_ptr<StageProcess>(new StageProcess(weights, options));
  PDS_ASSIGN_OR_RETURN(process->link_worker_,
                       transport::UcxWorker::Create(options.ucx));
  PDS_ASSIGN_OR_RETURN(process->kv_worker_,
                       transport::UcxWorker::Create(options.ucx));
  if (options.stage > 0) {
    // Listening before anyone learns the address: the first microbatch may
    // follow the wiring at once.
    process->receiver_ =
        std::make_unique<UcxStageReceiver>(process->link_worker_.get());
  }
  return process;
}

StageProcess::~StageProcess() {
  Shutdown();
  std::unique_ptr<UcxKvOutput> output;
  std::unique_ptr<PipelineStage> stage;
  std::unique_ptr<transport::KvSource> source;
  {
    absl::MutexLock lock(&mu_);
    output = std::move(kv_output_);
    stage = std::move(stage_);
    source = std::move(source_);
  }
  // The output's completion thread calls into the stage: it goes first.
  output.reset();
  stage.reset();
  source.reset();
  receiver_.reset();
}

void StageProcess::Shutdown() {
  if (receiver_ != nullptr) receiver_->Close();
  PipelineStage* stage = nullptr;
  {
    absl::MutexLock lock(&mu_);
    stage = stage_.get();
  }
  if (stage != nullptr) stage->Join();
}

bool StageProcess::wired() const {
  absl::MutexLock lock(&mu_);
  return wired_;
}

absl::Status StageProcess::Wire(const std::string& next,
                                const std::string& coordinator) {
  if (options_.stage == 0) {
    return absl::FailedPreconditionError("stage 0 is wired with WireFirst");
  }
  {
    absl::MutexLock lock(&mu_);
    if (wired_) {
      return absl::FailedPreconditionError(
          absl::StrCat("stage ", options_.stage, " is already wired"));
    }
    PDS_ASSIGN_OR_RETURN(auto back, link_worker_->Connect(coordinator));
    event_sender_ = std::make_unique<UcxEventSender>(std::move(back));
  }
  StageEventSink* events = nullptr;
  {
    absl::MutexLock lock(&mu_);
    events = event_sender_.get();
  }
  return Build(receiver_.get(), next, events);
}

absl::Status StageProcess::WireFirst(StageReceiver* in, const std::string& next,
                                     StageEventSink* events) {
  if (options_.stage != 0) {
    return absl::FailedPreconditionError(
        "only stage 0 is wired with WireFirst");
  }
  {
    absl::MutexLock lock(&mu_);
    if (wired_) return absl::FailedPreconditionError("stage 0 is wired");
  }
  return Build(in, next, events);
}

absl::Status StageProcess::Build(StageReceiver* in, const std::string& next,
                                 StageEventSink* events) {
  const bool last = options_.stage + 1 == options_.num_stages;
  if (last != next.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage ", options_.stage, " of ", options_.num_stages,
                     last ? " is the last and takes no next stage"
                          : " needs the next stage's address"));
  }
  absl::MutexLock lock(&mu_);
  if (!next.empty()) {
    PDS_ASSIGN_OR_RETURN(auto forward, link_worker_->Connect(next));
    sender_ = std::make_unique<UcxStageSender>(std::move(forward));
  }
  PipelineStageOptions stage_options;
  stage_options.stage_index = options_.stage;
  stage_options.num_stages = options_.num_stages;
  stage_options.shard = options_.shard;
  stage_options.block_size = options_.block_size;
  stage_options.num_blocks = options_.num_blocks;
  stage_options.threads = options_.threads;
  stage_options.observer = options_.observer;
  stage_options.backend = options_.backend;
  stage_options.cuda = options_.cuda;
  stage_options.structured_output = options_.structured_output;
  stage_options.kv_dtype = options_.kv_dtype;
  stage_options.quantized_matmul = options_.quantized_matmul;
  PDS_ASSIGN_OR_RETURN(
      stage_, PipelineStage::Create(weights_, stage_options, in, sender_.get(),
                                    events, nullptr));
  const model::ModelConfig& config = weights_.config();
  // The dtype the stage's engine keeps KV in (f32 on the CPU, bf16 on GPUs).
  const transport::KvModelSpec spec{
      config.Identity(),   stage_->mutable_pool()->layout().dtype,
      options_.block_size, config.head_dim,
      config.num_layers,   config.num_kv_heads};
  PDS_ASSIGN_OR_RETURN(
      source_, transport::KvSource::Create(kv_worker_.get(),
                                           stage_->mutable_pool(), spec));
  kv_output_ =
      std::make_unique<UcxKvOutput>(source_.get(), options_.kv_write_timeout,
                                    options_.observer.on_kv_transfer);
  stage_->set_kv_output(kv_output_.get());
  stage_->Start();
  wired_ = true;
  return absl::OkStatus();
}

absl::Status StageProcess::ConnectSinks(
    const std::vector<std::string>& descriptors) {
  transport::KvSource* source = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (!wired_) {
      return absl::FailedPreconditionError(
          absl::StrCat("stage ", options_.stage, " is not wired yet"));
    }
    source = source_.get();
  }
  absl::MutexLock lock(&connect_mu_);
  for (const std::string& descriptor : descriptors) {
    if (connected_.contains(descriptor)) continue;
    if (auto id = source->Connect(descriptor); !id.ok()) {
      return absl::Status(
          id.status().code(),
          absl::StrCat("prefill stage ", options_.stage,
                       ": decode rank: ", id.status().message()));
    }
    connected_.insert(descriptor);
  }
  return absl::OkStatus();
}

absl::Status StageProcess::AddGrants(const std::vector<std::string>& grants) {
  UcxKvOutput* output = nullptr;
  {
    absl::MutexLock lock(&mu_);
    output = kv_output_.get();
  }
  if (output == nullptr) {
    return absl::FailedPreconditionError("stage is not wired yet");
  }
  return output->AddGrants(grants);
}

void StageProcess::ForgetGrants(uint64_t request_id) {
  absl::MutexLock lock(&mu_);
  if (kv_output_ != nullptr) kv_output_->Forget(request_id);
}

void StageProcess::CancelKv(const std::vector<uint64_t>& request_ids) {
  UcxKvOutput* output = nullptr;
  {
    absl::MutexLock lock(&mu_);
    output = kv_output_.get();
    if (stage_ != nullptr) {
      for (uint64_t id : request_ids) stage_->Forget(id);
    }
  }
  if (output == nullptr) return;
  // NOT_FOUND (this stage never saw the request's grants) is expected: the
  // tombstone still keeps a straggler chunk from writing.
  for (uint64_t id : request_ids) (void)output->Cancel(id);
}

void StageProcess::CancelKvWithGrants(uint64_t request_id,
                                      const std::vector<std::string>& grants) {
  UcxKvOutput* output = nullptr;
  {
    absl::MutexLock lock(&mu_);
    output = kv_output_.get();
    if (stage_ != nullptr) stage_->Forget(request_id);
  }
  if (output != nullptr) (void)output->Cancel(request_id, grants);
}

StageStats StageProcess::stats() const {
  absl::MutexLock lock(&mu_);
  return stage_ != nullptr ? stage_->stats() : StageStats{};
}

}  // namespace pdserve::prefill
