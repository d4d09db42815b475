// Chat templates: the Jinja2 subset model chat templates use, rendered byte
// for byte like @huggingface/jinja (the renderer transformers.js uses) with
// transformers' settings (trim_blocks, lstrip_blocks). README.md lists the
// subset, the limits and the few deliberate differences.
//
//   PDS_ASSIGN_OR_RETURN(ChatTemplate t,
//                        ChatTemplate::Parse(source, "tokenizer_config.json"));
//   PDS_ASSIGN_OR_RETURN(std::string prompt, t.Render(context));
//
// Thread-safety: a ChatTemplate is immutable after Parse; Render may be
// called from any number of threads at once. Copies share the parsed tree.
#pragma once

#include <ctime>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::chat_template {

namespace internal {
struct Program;
}  // namespace internal

// Bounds on one render; exceeding one is RESOURCE_EXHAUSTED.
struct RenderLimits {
  size_t max_output_bytes = size_t{16} << 20;  // Also the longest string.
  uint64_t max_steps = 10'000'000;     // Interpreted nodes + per-item work.
  int max_depth = 400;                 // Nested evaluation incl. macro calls.
  size_t max_items = size_t{1} << 20;  // Longest list a template builds.
  int max_context_depth = 256;         // Nesting of the context JSON / tojson.
};

struct RenderOptions {
  RenderLimits limits;
  // The local date and time strftime_now() formats; the system clock
  // (local time zone) when unset.
  std::optional<std::tm> local_time;
};

class ChatTemplate {
 public:
  // Parses `source`. Errors are INVALID_ARGUMENT naming `origin` (e.g. the
  // file), the line and column, and what is wrong. Sources over 1 MiB are
  // refused.
  [[nodiscard]] static absl::StatusOr<ChatTemplate> Parse(
      std::string_view source, std::string_view origin);

  // Renders with the variables of `context` (a JSON object: `messages`,
  // `tools`, `add_generation_prompt`, `bos_token`, `eos_token`, and any
  // template kwargs such as `enable_thinking`). Object key order matters to
  // `tojson` and `items()`: prefer the ordered_json overload, which keeps the
  // request's order as transformers does.
  // Errors: INVALID_ARGUMENT (the template failed; for raise_exception the
  // message is exactly the template's text, see IsRaisedByTemplate),
  // RESOURCE_EXHAUSTED (a limit of `options.limits` was hit).
  [[nodiscard]] absl::StatusOr<std::string> Render(
      const nlohmann::ordered_json& context,
      const RenderOptions& options = {}) const;
  [[nodiscard]] absl::StatusOr<std::string> Render(
      const nlohmann::json& context, const RenderOptions& options = {}) const;

  const std::string& origin() const { return origin_; }
  const std::string& source() const { return *source_; }

 private:
  ChatTemplate() = default;
  template <typename Json>
  absl::StatusOr<std::string> RenderImpl(const Json& context,
                                         const RenderOptions& options) const;

  std::string origin_;
  std::shared_ptr<const std::string> source_;
  std::shared_ptr<const internal::Program> program_;
};

// True when `status` came from the template's own raise_exception(): its
// message is then the template's text, fit to return to a client as is.
bool IsRaisedByTemplate(const absl::Status& status);

// The chat template(s) and special tokens of a Hugging Face
// tokenizer_config.json.
struct TokenizerConfigTemplates {
  // "default" for a plain string template; else the names of the list.
  std::map<std::string, std::string> templates;
  std::string bos_token;  // Empty when absent or null.
  std::string eos_token;

  bool empty() const { return templates.empty(); }
  // transformers' choice: "tool_use" when the request has tools and the
  // config names one, else "default"; nullptr when neither exists.
  const std::string* Select(bool has_tools) const;
};

// Reads `chat_template` (a string or a list of {name, template}) and
// `bos_token`/`eos_token` (strings or {content: ...} objects). A config
// without a template gives an empty `templates`. A malformed one is
// INVALID_ARGUMENT naming `origin` and the key.
[[nodiscard]] absl::StatusOr<TokenizerConfigTemplates> ReadTokenizerConfig(
    const nlohmann::ordered_json& config, std::string_view origin);
[[nodiscard]] absl::StatusOr<TokenizerConfigTemplates> ReadTokenizerConfigFile(
    const std::string& path);

}  // namespace pdserve::chat_template
