#include "router/tool_calls.h"

#include <cstdint>
#include <nlohmann/json.hpp>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::router {
namespace {

using json = nlohmann::ordered_json;

// std::string_view helpers (Debian's Abseil has its own string_view type).
bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' ||
         c == '\v';
}
std::string_view StripLeading(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  return s;
}
std::string_view Strip(std::string_view s) {
  s = StripLeading(s);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}
bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}
bool Contains(std::string_view s, std::string_view part) {
  return s.find(part) != std::string_view::npos;
}

constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";

std::string NewToolCallId() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrFormat("call_%016x%08x", rng(), static_cast<uint32_t>(rng()));
}

// {"name": string, <arguments_key>: object or JSON text of one} as a call.
bool ReadCall(std::string_view text, ToolCall* call) {
  json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) return false;
  auto name = parsed.find("name");
  if (name == parsed.end() || !name->is_string()) return false;
  auto args = parsed.find("arguments");
  if (args == parsed.end()) args = parsed.find("parameters");
  json arguments = json::object();
  if (args != parsed.end()) {
    if (args->is_string()) {
      arguments = json::parse(args->get<std::string>(), nullptr, false);
      if (arguments.is_discarded() || !arguments.is_object()) return false;
    } else if (args->is_object()) {
      arguments = *args;
    } else if (!args->is_null()) {
      return false;
    }
  }
  call->id = NewToolCallId();
  call->name = name->get<std::string>();
  call->arguments = arguments.dump();
  return true;
}

ParsedAnswer ParseHermes(std::string_view text) {
  ParsedAnswer out;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t open = text.find(kHermesOpen, pos);
    if (open == std::string_view::npos) break;
    const size_t body = open + kHermesOpen.size();
    const size_t close = text.find(kHermesClose, body);
    // An unclosed last call (the answer hit max_tokens): parse what is there.
    const size_t end = close == std::string_view::npos ? text.size() : close;
    ToolCall call;
    if (!ReadCall(Strip(text.substr(body, end - body)), &call)) {
      break;  // not a call after all: the rest stays content
    }
    out.content.append(text.substr(pos, open - pos));
    out.tool_calls.push_back(std::move(call));
    pos = close == std::string_view::npos ? text.size()
                                          : close + kHermesClose.size();
  }
  out.content.append(text.substr(pos));
  if (!out.tool_calls.empty()) {
    // The template's own separators around the calls are not content.
    out.content = std::string(Strip(out.content));
  }
  return out;
}

ParsedAnswer ParseLlama3(std::string_view text) {
  ParsedAnswer out;
  std::string_view body = Strip(text);
  if (StartsWith(body, kPythonTag)) {
    body = Strip(body.substr(kPythonTag.size()));
  }
  if (!StartsWith(body, "{")) {
    out.content = std::string(text);
    return out;
  }
  // One call, or several separated by ';' (each a whole JSON object).
  std::vector<ToolCall> calls;
  size_t start = 0;
  while (start < body.size()) {
    size_t end = body.find(';', start);
    // A ';' inside a JSON string: try the longest candidates that parse.
    ToolCall call;
    bool found = false;
    while (true) {
      const std::string_view piece = Strip(
          body.substr(start, end == std::string_view::npos ? body.size() - start
                                                           : end - start));
      if (ReadCall(piece, &call)) {
        found = true;
        break;
      }
      if (end == std::string_view::npos) break;
      end = body.find(';', end + 1);
    }
    if (!found) {
      out.content = std::string(text);
      return out;
    }
    calls.push_back(std::move(call));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  out.tool_calls = std::move(calls);
  return out;
}

// Length of the longest suffix of `text` that is a proper prefix of
// `marker` (a marker possibly split across deltas).
size_t PartialMarkerSuffix(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

const char* ToolCallFormatName(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return "hermes";
    case ToolCallFormat::kLlama3Json:
      return "llama3_json";
    case ToolCallFormat::kNone:
      break;
  }
  return "none";
}

ToolCallFormat DetectToolCallFormat(std::string_view source) {
  if (Contains(source, kHermesOpen)) return ToolCallFormat::kHermes;
  // Llama 3.1's template asks for {"name": ..., "parameters": ...} and marks
  // built-in tool calls with <|python_tag|>.
  if (Contains(source, "<|start_header_id|>") && Contains(source, "tools") &&
      Contains(source, "\"parameters\"")) {
    return ToolCallFormat::kLlama3Json;
  }
  return ToolCallFormat::kNone;
}

ParsedAnswer ParseToolCalls(ToolCallFormat format, std::string_view text) {
  switch (format) {
    case ToolCallFormat::kHermes:
      return ParseHermes(text);
    case ToolCallFormat::kLlama3Json:
      return ParseLlama3(text);
    case ToolCallFormat::kNone:
      break;
  }
  return ParsedAnswer{std::string(text), {}};
}

std::string ToolCallStream::Push(std::string_view delta) {
  if (format_ == ToolCallFormat::kNone) return std::string(delta);
  held_.append(delta);
  if (in_call_) return "";
  if (format_ == ToolCallFormat::kLlama3Json) {
    // The answer is a call when it starts (after spaces) with '{' or the
    // python tag; decided on its first visible character.
    if (!decided_) {
      const std::string_view visible = StripLeading(held_);
      if (visible.empty()) return "";
      if (StartsWith(visible, "{") || StartsWith(visible, kPythonTag)) {
        in_call_ = true;
        return "";
      }
      if (kPythonTag.substr(0, visible.size()) == visible) return "";
      decided_ = true;
    }
    return std::exchange(held_, "");
  }
  // Hermes: content up to the first marker; a split marker is held.
  const size_t open = held_.find(kHermesOpen);
  if (open != std::string::npos) {
    in_call_ = true;
    std::string out = held_.substr(0, open);
    held_.erase(0, open);
    return out;
  }
  const size_t keep = PartialMarkerSuffix(held_, kHermesOpen);
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

ParsedAnswer ToolCallStream::Finish() {
  if (!in_call_) return ParsedAnswer{std::exchange(held_, ""), {}};
  return ParseToolCalls(format_, std::exchange(held_, ""));
}

}  // namespace pdserve::router
