// Tool calls in a model's answer, read back into OpenAI's `tool_calls`. Each
// model family writes them in the format its chat template teaches:
//   kHermes     Qwen2.5/Qwen3, Hermes: <tool_call>{"name": ..., "arguments":
//               {...}}</tool_call>, any number, text around them is content.
//   kLlama3Json Llama 3.1/3.2/3.3: the whole answer is {"name": ...,
//               "parameters": {...}} (optionally after <|python_tag|>;
//               several separated by ';').
// A call that does not parse stays in the content: the client sees what the
// model wrote rather than a made-up call.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pdserve::router {

enum class ToolCallFormat { kNone, kHermes, kLlama3Json };

// "hermes", "llama3_json", "none".
const char* ToolCallFormatName(ToolCallFormat format);

// The format a chat template teaches, read from its source; kNone when it
// shows none pdserve can parse.
ToolCallFormat DetectToolCallFormat(std::string_view template_source);

struct ToolCall {
  std::string id;  // "call_" + 24 hex digits
  std::string name;
  std::string arguments;  // a JSON object, as text (OpenAI's shape)
};

struct ParsedAnswer {
  std::string content;  // the text outside the calls
  std::vector<ToolCall> tool_calls;
};

// The calls in a whole answer.
ParsedAnswer ParseToolCalls(ToolCallFormat format, std::string_view text);

// The same for a streamed answer: text that cannot belong to a call streams
// on at once; from the first sign of a call (or of a marker split across
// deltas) the text is held until Finish(), which parses the held part.
class ToolCallStream {
 public:
  explicit ToolCallStream(ToolCallFormat format) : format_(format) {}
  // The content to send now for `delta` (possibly empty).
  std::string Push(std::string_view delta);
  // The rest: held content and the calls.
  ParsedAnswer Finish();

 private:
  ToolCallFormat format_;
  std::string held_;
  bool in_call_ = false;  // a call has started: hold everything
  bool decided_ = false;  // kLlama3Json: whether the answer is a call
};

}  // namespace pdserve::router
