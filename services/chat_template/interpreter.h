// Evaluates a parsed template: a port of @huggingface/jinja's Interpreter
// with every unbounded resource counted (steps, nesting, output and string
// sizes) so that no template and no context can hang or crash the caller.
#pragma once

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "chat_template/ast.h"
#include "chat_template/value.h"

namespace pdserve::chat_template::internal {

struct Limits {
  size_t max_output_bytes = size_t{16} << 20;  // Also the largest string.
  uint64_t max_steps = 10'000'000;
  int max_depth = 400;  // Nested evaluation (expressions, blocks, calls).
  size_t max_items = size_t{1} << 20;  // Largest list a template builds.
  size_t max_containers = 200'000;     // Namespaces + macros per render.
  int max_json_depth = 256;            // Nesting of values printed/read.
};

// A variable scope (the reference's Environment).
struct Scope {
  std::shared_ptr<Scope> parent;
  absl::flat_hash_map<std::string, Value> vars;
  // Set on the scope a {% call %} block passes to its macro.
  bool call_block = false;

  const Value* Lookup(const std::string& name) const;
  void Set(const std::string& name, Value value);
  ~Scope();
};

class Interpreter {
 public:
  Interpreter(const Limits& limits, std::string_view source,
              std::string_view origin, std::optional<std::tm> local_time);
  ~Interpreter();
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  // The global scope with the reference's globals (true/false/none, range,
  // raise_exception, strftime_now, namespace) declared.
  std::shared_ptr<Scope> MakeGlobals();

  // Throws TemplateError.
  std::string Run(const Program& program, const std::shared_ptr<Scope>& global);

  // ---- used by native functions ----
  const Limits& limits() const { return limits_; }
  void Charge(uint64_t steps);
  Value NewString(std::string s);
  void CheckItems(size_t n);
  std::string RenderBody(const std::vector<NodePtr>& body,
                         const std::shared_ptr<Scope>& scope);
  Value Evaluate(const Node* node, const std::shared_ptr<Scope>& scope);
  void BindMacroArguments(const std::string& display_name, const Node& macro,
                          const std::vector<NodePtr>& params,
                          std::vector<Value> args,
                          const std::shared_ptr<Scope>& scope);
  // Remembers a mutable container that may end up in a reference cycle; it
  // is emptied when the render ends.
  void TrackNamespace(const std::shared_ptr<ObjectData>& ns);
  void TrackScope(const std::shared_ptr<Scope>& scope);
  std::optional<std::tm> local_time() const { return local_time_; }

 private:
  class DepthGuard;

  void RenderBlock(const std::vector<NodePtr>& body,
                   const std::shared_ptr<Scope>& scope, std::string& out);
  void Append(std::string& out, std::string_view text);
  void ExecSet(const Node& node, const std::shared_ptr<Scope>& scope);
  void RenderIf(const Node& node, const std::shared_ptr<Scope>& scope,
                std::string& out);
  void RenderFor(const Node& node, const std::shared_ptr<Scope>& scope,
                 std::string& out);
  void BindLoopVariable(const Node& loopvar, const Value& item, Scope& scope);
  Value DefineMacro(const Node& node, const std::shared_ptr<Scope>& scope);
  Value EvalCallBlock(const Node& node, const std::shared_ptr<Scope>& scope);
  Value EvalBinary(const Node& node, const std::shared_ptr<Scope>& scope);
  Value EvalUnary(const Node& node, const std::shared_ptr<Scope>& scope);
  Value EvalMember(const Node& node, const std::shared_ptr<Scope>& scope);
  Value EvalSlice(const Value& object, const Node& slice,
                  const std::shared_ptr<Scope>& scope);
  Value EvalCall(const Node& node, const std::shared_ptr<Scope>& scope);
  Value EvalTest(const Node& node, const std::shared_ptr<Scope>& scope);
  Value ApplyFilter(const Value& operand, const Node& filter,
                    const std::shared_ptr<Scope>& scope);
  Value ApplyFilterCall(const Value& operand, const Node& filter,
                        const std::shared_ptr<Scope>& scope);
  // Positional arguments, then keyword arguments.
  std::pair<std::vector<Value>, std::shared_ptr<ObjectData>> EvalArguments(
      const std::vector<NodePtr>& args, const std::shared_ptr<Scope>& scope);
  // The calling convention of functions: positional arguments followed by one
  // keyword-arguments object when there are any.
  std::vector<Value> EvalCallArguments(const std::vector<NodePtr>& args,
                                       const std::shared_ptr<Scope>& scope);
  Value Property(const Value& object, const Value& property);
  [[noreturn]] void FailAt(const Node& node, const std::string& message);

  Limits limits_;
  std::string_view source_;
  std::string_view origin_;
  std::optional<std::tm> local_time_;
  uint64_t steps_ = 0;
  int depth_ = 0;
  std::vector<std::weak_ptr<ObjectData>> namespaces_;
  std::vector<std::weak_ptr<Scope>> scopes_;
};

// Value built-in methods and tests, shared with the filters.
Value StringMethod(Interpreter& in, const Value& str, const std::string& name);
Value ObjectMethod(Interpreter& in, const Value& obj, const std::string& name);
bool RunTest(const std::string& name, const Value& operand,
             const std::vector<Value>& args);
bool HasTest(const std::string& name);
// The reference's compareRuntimeValues (sorting).
int CompareValues(const Value& a, const Value& b, bool case_sensitive);

}  // namespace pdserve::chat_template::internal
