#include "planner/perf_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace pdserve::planner {
namespace {

// A gang point's share must be one processor sharing gives, (0, 1], and its
// exponent in [min_exponent, 4]; `name` says which point in the error.
absl::Status CheckGangPoint(const PerfModel::GangPoint& p,
                            const std::string& name, double min_exponent) {
  if (!(p.share > 0) || p.share > 1 || !(p.exponent >= min_exponent) ||
      p.exponent > 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "perf model: ", name, " needs a share in (0, 1] and an exponent in [",
        min_exponent, ", 4], got ", p.share, " and ", p.exponent));
  }
  return absl::OkStatus();
}

// A TTFT offset's scatter: finite seconds within a minute either way,
// ascending; `name` says which offset in the error.
absl::Status CheckScatter(const LinearCost& cost, const std::string& name) {
  for (size_t i = 0; i < cost.scatter.size(); ++i) {
    const double s = cost.scatter[i];
    if (!(std::abs(s) <= 60) || (i > 0 && !(s >= cost.scatter[i - 1]))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "perf model: ", name,
          ".scatter must be ascending seconds within ±60, got ", s, " at ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<const StepCost*> PerfModel::Step(ComputeConfig config) const {
  auto it = steps.find(config);
  if (it != steps.end()) return &it->second;
  std::vector<std::string> have;
  for (const auto& [c, _] : steps) {
    have.push_back(absl::StrCat("tp", c.tp, "x", c.threads_per_rank, "t"));
  }
  return absl::NotFoundError(
      absl::StrCat("no step cost profiled for tp ", config.tp, " × ",
                   config.threads_per_rank, " threads per rank (profiled: ",
                   have.empty() ? "none" : absl::StrJoin(have, ", "), ")"));
}

double PerfModel::BusyCores(ComputeConfig config) const {
  auto it = busy_cores.find(config);
  return it != busy_cores.end() ? it->second : config.threads();
}

double PerfModel::StepOverhead(ComputeConfig config) const {
  auto it = calibrated.find(config);
  return it != calibrated.end() ? it->second.step_overhead_seconds
                                : decode_step_overhead_seconds;
}

double LinearCost::ScatterAt(double u) const {
  return EvenQuantileAt(scatter, u, 0.0);
}

LinearCost PerfModel::ColocatedTtft(ComputeConfig config) const {
  auto it = calibrated.find(config);
  return it != calibrated.end() ? it->second.colocated_ttft : colocated_ttft;
}

int PerfModel::LocalPrefillCrossover(ComputeConfig decode, ComputeConfig stage,
                                     int max_prompt_tokens) const {
  auto decode_cost = steps.find(decode);
  auto stage_cost = steps.find(stage);
  if (decode_cost == steps.end() || stage_cost == steps.end()) return 0;
  const LinearCost colocated = ColocatedTtft(decode);
  int crossover = 0;
  for (int tokens = block_size; tokens <= max_prompt_tokens;
       tokens += block_size) {
    const StepShape prompt{tokens, 1, AttendedPositions(0, tokens)};
    const double local =
        colocated.At(tokens) + decode_cost->second.Seconds(prompt);
    const double remote = disaggregated_ttft.At(tokens) +
                          stage_cost->second.Seconds(prompt) + handoff_seconds;
    if (local > remote) break;
    crossover = tokens;
  }
  return crossover;
}

nlohmann::json PerfModel::ToJson() const {
  nlohmann::json configs = nlohmann::json::array();
  for (const auto& [c, cost] : steps) {
    nlohmann::json entry = {{"tp", c.tp},
                            {"threads_per_rank", c.threads_per_rank},
                            {"step", cost.ToJson()}};
    if (auto busy = busy_cores.find(c); busy != busy_cores.end()) {
      entry["busy_cores"] = busy->second;
    }
    configs.push_back(std::move(entry));
  }
  auto linear = [](const LinearCost& l) {
    nlohmann::json json = {{"base", l.base},
                           {"per_prompt_token", l.per_prompt_token}};
    if (!l.scatter.empty()) json["scatter"] = l.scatter;
    return json;
  };
  nlohmann::json calibrations = nlohmann::json::array();
  for (const auto& [c, cal] : calibrated) {
    calibrations.push_back(
        {{"tp", c.tp},
         {"threads_per_rank", c.threads_per_rank},
         {"step_overhead_seconds", cal.step_overhead_seconds},
         {"colocated_ttft", linear(cal.colocated_ttft)}});
  }
  nlohmann::json co_running_json = {{"prefill_stage", co_running.prefill_stage},
                                    {"decode_step", co_running.decode_step}};
  if (co_running.decode_beside_decode) {
    co_running_json["decode_beside_decode"] = *co_running.decode_beside_decode;
  }
  if (co_running.prefill_beside_prefill) {
    co_running_json["prefill_beside_prefill"] =
        *co_running.prefill_beside_prefill;
  }
  nlohmann::json gang_points = nlohmann::json::array();
  for (const GangPoint& p : gang_sharing_points) {
    gang_points.push_back({{"share", p.share}, {"exponent", p.exponent}});
  }
  nlohmann::json json = {
      {"model", model},
      {"num_layers", num_layers},
      {"block_size", block_size},
      {"cores", cores},
      {"configs", configs},
      {"colocated_ttft", linear(colocated_ttft)},
      {"disaggregated_ttft", linear(disaggregated_ttft)},
      {"handoff_seconds", handoff_seconds},
      {"decode_step_overhead_seconds", decode_step_overhead_seconds},
      {"delivery_cpu_seconds", delivery_cpu_seconds},
      {"co_running", co_running_json},
      {"gang_sharing_exponent", gang_sharing_exponent},
      {"gang_sharing_points", gang_points},
      {"kv_bytes_per_token", kv_bytes_per_token},
      {"activation_bytes_per_token", activation_bytes_per_token},
      {"calibrated", calibrations}};
  if (gang_beside_gang) {
    json["gang_beside_gang"] = {{"share", gang_beside_gang->share},
                                {"exponent", gang_beside_gang->exponent}};
  }
  return json;
}

absl::StatusOr<PerfModel> PerfModel::FromJson(const nlohmann::json& json) {
  PerfModel m;
  try {
    m.model = json.at("model").get<std::string>();
    m.num_layers = json.at("num_layers").get<int>();
    m.block_size = json.at("block_size").get<int>();
    m.cores = json.at("cores").get<int>();
    for (const auto& c : json.at("configs")) {
      ComputeConfig config{c.at("tp").get<int>(),
                           c.at("threads_per_rank").get<int>()};
      if (config.tp < 1 || config.threads_per_rank < 1) {
        return absl::InvalidArgumentError(
            "perf model: tp and threads_per_rank must be ≥ 1");
      }
      auto cost = StepCost::FromJson(c.at("step"));
      if (!cost.ok()) return cost.status();
      m.steps[config] = *std::move(cost);
      if (c.contains("busy_cores")) {
        const double busy = c.at("busy_cores").get<double>();
        if (!(busy > 0) || busy > config.threads()) {
          return absl::InvalidArgumentError(
              absl::StrCat("perf model: busy_cores of tp ", config.tp, " x ",
                           config.threads_per_rank, " threads must be in (0, ",
                           config.threads(), "], got ", busy));
        }
        m.busy_cores[config] = busy;
      }
    }
    // Profiles from before the scatter was measured have none.
    auto linear = [](const nlohmann::json& j) {
      return LinearCost{j.at("base").get<double>(),
                        j.at("per_prompt_token").get<double>(),
                        j.value("scatter", std::vector<double>{})};
    };
    m.colocated_ttft = linear(json.at("colocated_ttft"));
    m.disaggregated_ttft = linear(json.at("disaggregated_ttft"));
    m.handoff_seconds = json.at("handoff_seconds").get<double>();
    m.decode_step_overhead_seconds =
        json.at("decode_step_overhead_seconds").get<double>();
    m.delivery_cpu_seconds = json.value("delivery_cpu_seconds", 0.0);
    // Profiles from before the co-running calibration have none.
    if (json.contains("co_running")) {
      const nlohmann::json& c = json.at("co_running");
      m.co_running.prefill_stage = c.at("prefill_stage").get<double>();
      m.co_running.decode_step = c.at("decode_step").get<double>();
      // Profiles from before the same-kind pairs were measured have neither.
      if (c.contains("decode_beside_decode")) {
        m.co_running.decode_beside_decode =
            c.at("decode_beside_decode").get<double>();
      }
      if (c.contains("prefill_beside_prefill")) {
        m.co_running.prefill_beside_prefill =
            c.at("prefill_beside_prefill").get<double>();
      }
    }
    m.gang_sharing_exponent = json.value("gang_sharing_exponent", 0.5);
    for (const auto& p :
         json.value("gang_sharing_points", nlohmann::json::array())) {
      m.gang_sharing_points.push_back(
          {p.at("share").get<double>(), p.at("exponent").get<double>()});
    }
    if (json.contains("gang_beside_gang")) {
      const nlohmann::json& p = json.at("gang_beside_gang");
      m.gang_beside_gang = GangPoint{p.at("share").get<double>(),
                                     p.at("exponent").get<double>()};
    }
    // Profiles from before multi-node planning have neither.
    m.kv_bytes_per_token = json.value("kv_bytes_per_token", 0.0);
    m.activation_bytes_per_token =
        json.value("activation_bytes_per_token", 0.0);
    for (const auto& c : json.value("calibrated", nlohmann::json::array())) {
      const ComputeConfig config{c.at("tp").get<int>(),
                                 c.at("threads_per_rank").get<int>()};
      m.calibrated[config] = {c.at("step_overhead_seconds").get<double>(),
                              linear(c.at("colocated_ttft"))};
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("perf model: ", e.what()));
  }
  if (!(m.delivery_cpu_seconds >= 0) || !(m.handoff_seconds >= 0)) {
    return absl::InvalidArgumentError(
        "perf model: handoff_seconds and delivery_cpu_seconds must be ≥ 0");
  }
  if (!(m.co_running.prefill_stage >= 0) || !(m.co_running.decode_step >= 0) ||
      !(m.co_running.DecodeBesideDecode() >= 0) ||
      !(m.co_running.PrefillBesidePrefill() >= 0)) {
    return absl::InvalidArgumentError(
        "perf model: co_running slow-downs must be ≥ 0");
  }
  if (!(m.gang_sharing_exponent >= 0) || m.gang_sharing_exponent > 4) {
    return absl::InvalidArgumentError(
        "perf model: gang_sharing_exponent must be in [0, 4]");
  }
  for (size_t i = 0; i < m.gang_sharing_points.size(); ++i) {
    const GangPoint& p = m.gang_sharing_points[i];
    PDS_RETURN_IF_ERROR(
        CheckGangPoint(p, absl::StrCat("gang_sharing_points[", i, "]"), 0));
    if (i > 0 && !(p.share < m.gang_sharing_points[i - 1].share)) {
      return absl::InvalidArgumentError(
          "perf model: gang_sharing_points must be ordered by share, "
          "descending, each share once");
    }
  }
  PDS_RETURN_IF_ERROR(CheckScatter(m.colocated_ttft, "colocated_ttft"));
  PDS_RETURN_IF_ERROR(CheckScatter(m.disaggregated_ttft, "disaggregated_ttft"));
  for (const auto& [c, cal] : m.calibrated) {
    PDS_RETURN_IF_ERROR(
        CheckScatter(cal.colocated_ttft,
                     absl::StrCat("calibrated tp ", c.tp, " x ",
                                  c.threads_per_rank, " colocated_ttft")));
  }
  // Beside gangs the exponent may be negative (PerfModel::gang_beside_gang),
  // down to a TP 2 gang's full speed.
  if (m.gang_beside_gang) {
    PDS_RETURN_IF_ERROR(
        CheckGangPoint(*m.gang_beside_gang, "gang_beside_gang", -1));
  }
  if (!(m.kv_bytes_per_token >= 0) || !(m.activation_bytes_per_token >= 0)) {
    return absl::InvalidArgumentError(
        "perf model: kv_bytes_per_token and activation_bytes_per_token must "
        "be ≥ 0");
  }
  if (m.num_layers < 1 || m.block_size < 1 || m.cores < 1) {
    return absl::InvalidArgumentError(
        "perf model: num_layers, block_size and cores must be ≥ 1");
  }
  if (m.steps.empty()) {
    return absl::InvalidArgumentError(
        "perf model: no compute configuration was profiled");
  }
  return m;
}

double PerfModel::GangExponentAt(double share, bool beside_gangs_only) const {
  if (beside_gangs_only && gang_beside_gang) return gang_beside_gang->exponent;
  const std::vector<GangPoint>& points = gang_sharing_points;
  if (points.empty()) return gang_sharing_exponent;
  if (share >= points.front().share) return points.front().exponent;
  for (size_t i = 1; i < points.size(); ++i) {
    if (share >= points[i].share) {
      const GangPoint& hi = points[i - 1];
      const GangPoint& lo = points[i];
      const double t = (share - lo.share) / (hi.share - lo.share);
      return lo.exponent + t * (hi.exponent - lo.exponent);
    }
  }
  return points.back().exponent;
}

absl::StatusOr<PerfModel> PerfModel::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  auto json = nlohmann::json::parse(text.str(), nullptr,
                                    /*allow_exceptions=*/false);
  if (json.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not JSON"));
  }
  auto model = FromJson(json);
  if (!model.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", model.status().message()));
  }
  return model;
}

absl::Status PerfModel::Save(const std::string& path) const {
  std::ofstream out(path);
  out << ToJson().dump(2) << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace pdserve::planner
