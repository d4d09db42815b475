#include "chat_template/interpreter.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "chat_template/lexer.h"
#include "chat_template/unicode.h"

namespace pdserve::chat_template::internal {
namespace {

// {% break %} / {% continue %} unwind to the innermost loop, like the
// reference's BreakControl / ContinueControl (even out of a macro body).
struct BreakSignal {};
struct ContinueSignal {};

Value MakeFunction(NativeFn fn, std::shared_ptr<void> captured = nullptr) {
  auto data = std::make_shared<FunctionData>();
  data->fn = std::move(fn);
  data->captured = std::move(captured);
  return Value::Function(std::move(data));
}

// An object from entries whose keys are known to be distinct and few.
Value NewObject(std::vector<std::pair<std::string, Value>> entries) {
  auto data = std::make_shared<ObjectData>();
  data->entries = std::move(entries);
  return Value::Object(std::move(data));
}

// JavaScript truthiness of the raw value (containers are objects: true).
bool RawTruthy(const Value& v) {
  if (v.is(Kind::kArray) || v.IsAttributeContainer() || v.is(Kind::kFunction)) {
    return true;
  }
  return v.Truthy();
}

bool IsKwargs(const Value& v) { return v.IsObject() && v.object().kwargs; }

// The keyword-arguments object a function received last, if any.
std::shared_ptr<ObjectData> PopKwargs(std::vector<Value>& args) {
  if (!args.empty() && IsKwargs(args.back())) {
    auto heap = std::static_pointer_cast<ObjectData>(args.back().heap());
    args.pop_back();
    return heap;
  }
  return nullptr;
}

const Value* Kwarg(const std::shared_ptr<ObjectData>& kwargs,
                   std::string_view name) {
  return kwargs ? kwargs->Find(name) : nullptr;
}

// `a ?? b ?? c` over optional arguments.
Value FirstOf(std::initializer_list<const Value*> candidates, Value fallback) {
  for (const Value* v : candidates) {
    if (v != nullptr) return *v;
  }
  return fallback;
}

const Value* At(const std::vector<Value>& args, size_t i) {
  return i < args.size() ? &args[i] : nullptr;
}

// parseInt(s, 10) / parseFloat(s): NaN when nothing parses.
double JsParseInt(std::string_view s) {
  s = TrimStart(s);
  size_t i = 0;
  bool negative = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  const size_t start = i;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
  if (i == start) return NAN;
  const double n =
      std::strtod(std::string(s.substr(start, i - start)).c_str(), nullptr);
  return negative ? -n : n;
}

double JsParseFloat(std::string_view s) {
  s = TrimStart(s);
  size_t i = 0;
  bool negative = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  if (s.substr(i, 8) == "Infinity") return negative ? -INFINITY : INFINITY;
  const size_t start = i;
  bool digits = false;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i, digits = true;
  if (i < s.size() && s[i] == '.') {
    size_t j = i + 1;
    bool frac = false;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j, frac = true;
    if (frac || digits) i = j;
    digits = digits || frac;
  }
  if (!digits) return NAN;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    size_t j = i + 1;
    if (j < s.size() && (s[j] == '+' || s[j] == '-')) ++j;
    const size_t exp_start = j;
    while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
    if (j > exp_start) i = j;
  }
  const double n =
      std::strtod(std::string(s.substr(start, i - start)).c_str(), nullptr);
  return negative ? -n : n;
}

// JavaScript's Array.prototype.at / String.prototype.at index rule.
std::optional<size_t> RelativeIndex(double index, size_t size) {
  if (std::isnan(index)) index = 0;
  index = std::trunc(index);
  if (index < 0) index += static_cast<double>(size);
  if (index < 0 || index >= static_cast<double>(size)) return std::nullopt;
  return static_cast<size_t>(index);
}

// The reference's slice(array, start, stop, step) (Python semantics).
std::vector<size_t> SliceIndices(size_t size, std::optional<double> start_in,
                                 std::optional<double> stop_in, double step) {
  const double n = static_cast<double>(size);
  const double direction = step > 0 ? 1 : step < 0 ? -1 : 0;
  double start, stop;
  if (direction >= 0) {
    start = start_in.value_or(0);
    start = start < 0 ? std::max(n + start, 0.0) : std::min(start, n);
    stop = stop_in.value_or(n);
    stop = stop < 0 ? std::max(n + stop, 0.0) : std::min(stop, n);
  } else {
    start = start_in.value_or(n - 1);
    start = start < 0 ? std::max(n + start, -1.0) : std::min(start, n - 1);
    stop = stop_in.value_or(-1);
    stop = stop < -1 ? std::max(n + stop, -1.0) : std::min(stop, n - 1);
  }
  std::vector<size_t> out;
  for (double i = start; direction * i < direction * stop; i += step) {
    if (i >= 0 && i < n) out.push_back(static_cast<size_t>(i));
    if (out.size() > size) break;  // Fractional steps cannot loop forever.
  }
  return out;
}

// A stable merge sort that tolerates any comparator (a throwing or
// inconsistent one cannot make it read out of bounds).
template <typename Less>
void MergeSort(std::vector<Value>& v, Less less) {
  std::vector<Value> tmp(v.size());
  for (size_t width = 1; width < v.size(); width *= 2) {
    for (size_t lo = 0; lo < v.size(); lo += 2 * width) {
      const size_t mid = std::min(lo + width, v.size());
      const size_t hi = std::min(lo + 2 * width, v.size());
      size_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi) tmp[k++] = less(v[j], v[i]) ? v[j++] : v[i++];
      while (i < mid) tmp[k++] = v[i++];
      while (j < hi) tmp[k++] = v[j++];
    }
    v.swap(tmp);
  }
}

std::string TitleCase(std::string_view s) {
  // /\b\w/g with ASCII \w: upper-case a word character after a non-word one.
  std::string out(s);
  bool prev_word = false;
  for (char& c : out) {
    const bool word = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                      (c >= '0' && c <= '9') || c == '_';
    if (word && !prev_word && c >= 'a' && c <= 'z')
      c = static_cast<char>(c - 32);
    prev_word = word;
  }
  return out;
}

// Value at a dotted attribute path ("a.b.0"), the reference's
// getAttributeValue.
Value AttributePath(const Value& item, const std::string& path) {
  Value value = item;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(
        start, dot == std::string::npos ? std::string::npos : dot - start);
    if (value.IsAttributeContainer()) {
      const Value* v = value.object().Find(part);
      value = v ? *v : Value::Undefined();
    } else if (value.is(Kind::kArray)) {
      const double index = JsParseInt(part);
      const auto& items = value.array().items;
      if (std::isnan(index) || index < 0 ||
          index >= static_cast<double>(items.size())) {
        return Value::Undefined();
      }
      value = items[static_cast<size_t>(index)];
    } else {
      return Value::Undefined();
    }
    if (dot == std::string::npos) return value;
    start = dot + 1;
  }
}

}  // namespace

// ---- Scope ----

const Value* Scope::Lookup(const std::string& name) const {
  for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
    auto it = s->vars.find(name);
    if (it != s->vars.end()) return &it->second;
  }
  return nullptr;
}

void Scope::Set(const std::string& name, Value value) {
  vars.insert_or_assign(name, std::move(value));
}

Scope::~Scope() {
  for (auto& [name, v] : vars) {
    if (auto heap = v.heap()) {
      v = Value();
      DeferRelease(std::move(heap));
    }
  }
  DeferRelease(std::move(parent));
}

// ---- Interpreter ----

class Interpreter::DepthGuard {
 public:
  explicit DepthGuard(Interpreter& in) : in_(in) {
    if (++in_.depth_ > in_.limits_.max_depth) {
      --in_.depth_;
      Exhausted(absl::StrCat("template nesting exceeds ", in_.limits_.max_depth,
                             " levels (recursive macro?)"));
    }
  }
  ~DepthGuard() { --in_.depth_; }

 private:
  Interpreter& in_;
};

Interpreter::Interpreter(const Limits& limits, std::string_view source,
                         std::string_view origin,
                         std::optional<std::tm> local_time)
    : limits_(limits),
      source_(source),
      origin_(origin),
      local_time_(local_time) {}

Interpreter::~Interpreter() {
  // Break every cycle a template could have made (a namespace holding
  // itself, a macro stored in the scope it captured), newest first so that
  // releasing one container never walks a long chain of uncleared ones.
  for (auto it = namespaces_.rbegin(); it != namespaces_.rend(); ++it) {
    if (auto ns = it->lock()) {
      std::vector<std::pair<std::string, Value>> entries;
      entries.swap(ns->entries);
      ns.reset();
      for (auto& [k, v] : entries) {
        if (auto heap = v.heap()) {
          v = Value();
          DeferRelease(std::move(heap));
        }
      }
    }
  }
  for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
    if (auto scope = it->lock()) {
      absl::flat_hash_map<std::string, Value> vars;
      vars.swap(scope->vars);
      scope.reset();
      for (auto& [k, v] : vars) {
        if (auto heap = v.heap()) {
          v = Value();
          DeferRelease(std::move(heap));
        }
      }
    }
  }
}

void Interpreter::Charge(uint64_t steps) {
  steps_ += steps;
  if (steps_ > limits_.max_steps) {
    Exhausted(absl::StrCat("template rendering exceeds ", limits_.max_steps,
                           " steps"));
  }
}

Value Interpreter::NewString(std::string s) {
  if (s.size() > limits_.max_output_bytes) {
    Exhausted(absl::StrCat("template builds a string longer than ",
                           limits_.max_output_bytes, " bytes"));
  }
  Charge(s.size() / 16);
  return Value::String(std::move(s));
}

void Interpreter::CheckItems(size_t n) {
  if (n > limits_.max_items) {
    Exhausted(absl::StrCat("template builds a list longer than ",
                           limits_.max_items, " items"));
  }
  Charge(n);
}

void Interpreter::TrackNamespace(const std::shared_ptr<ObjectData>& ns) {
  if (namespaces_.size() + scopes_.size() >= limits_.max_containers) {
    Exhausted(absl::StrCat("template creates more than ",
                           limits_.max_containers, " namespaces and macros"));
  }
  namespaces_.push_back(ns);
}

void Interpreter::TrackScope(const std::shared_ptr<Scope>& scope) {
  if (namespaces_.size() + scopes_.size() >= limits_.max_containers) {
    Exhausted(absl::StrCat("template creates more than ",
                           limits_.max_containers, " namespaces and macros"));
  }
  scopes_.push_back(scope);
}

void Interpreter::FailAt(const Node& node, const std::string& message) {
  const Position pos = PositionOf(source_, node.offset);
  Fail(absl::StrCat(std::string(origin_), ":", pos.line, ":", pos.column, ": ",
                    message));
}

void Interpreter::Append(std::string& out, std::string_view text) {
  if (out.size() + text.size() > limits_.max_output_bytes) {
    Exhausted(absl::StrCat("template output exceeds ", limits_.max_output_bytes,
                           " bytes"));
  }
  Charge(text.size() / 16);
  out.append(text);
}

std::string Interpreter::Run(const Program& program,
                             const std::shared_ptr<Scope>& global) {
  std::string out;
  try {
    RenderBlock(program.body, global, out);
  } catch (const BreakSignal&) {
    Fail("'break' outside of a loop");
  } catch (const ContinueSignal&) {
    Fail("'continue' outside of a loop");
  }
  return out;
}

std::string Interpreter::RenderBody(const std::vector<NodePtr>& body,
                                    const std::shared_ptr<Scope>& scope) {
  std::string out;
  RenderBlock(body, scope, out);
  return out;
}

void Interpreter::RenderBlock(const std::vector<NodePtr>& body,
                              const std::shared_ptr<Scope>& scope,
                              std::string& out) {
  DepthGuard guard(*this);
  for (const NodePtr& node : body) {
    Charge(1);
    switch (node->type) {
      case NodeType::kText:
        Append(out, node->str);
        break;
      case NodeType::kIf:
        RenderIf(*node, scope, out);
        break;
      case NodeType::kFor:
        RenderFor(*node, scope, out);
        break;
      case NodeType::kSet:
        ExecSet(*node, scope);
        break;
      case NodeType::kComment:
        break;
      default: {
        const Value v = Evaluate(node.get(), scope);
        if (!v.is(Kind::kNull) && !v.is(Kind::kUndefined)) {
          if (v.is(Kind::kString)) {
            Append(out, v.str());
          } else {
            Append(out, DisplayString(v));
          }
        }
      }
    }
  }
}

void Interpreter::ExecSet(const Node& node,
                          const std::shared_ptr<Scope>& scope) {
  Value rhs = node.b ? Evaluate(node.b.get(), scope)
                     : NewString(RenderBody(node.body, scope));
  const Node& target = *node.a;
  if (target.type == NodeType::kIdentifier) {
    scope->Set(target.str, std::move(rhs));
  } else if (target.type == NodeType::kTupleLiteral) {
    if (!rhs.is(Kind::kArray)) {
      FailAt(node, absl::StrCat("Cannot unpack non-iterable type in set: ",
                                rhs.TypeName()));
    }
    const auto& items = rhs.array().items;
    if (items.size() != target.args.size()) {
      FailAt(node,
             absl::StrCat("Too ",
                          target.args.size() > items.size() ? "few" : "many",
                          " items to unpack in set"));
    }
    for (size_t i = 0; i < target.args.size(); ++i) {
      if (target.args[i]->type != NodeType::kIdentifier) {
        FailAt(node, "Cannot unpack to non-identifier in set");
      }
      scope->Set(target.args[i]->str, items[i]);
    }
  } else if (target.type == NodeType::kMember) {
    const Value object = Evaluate(target.a.get(), scope);
    if (!object.is(Kind::kNamespace)) {
      FailAt(node, "cannot assign attribute on non-namespace object");
    }
    if (target.b->type != NodeType::kIdentifier) {
      FailAt(node, "Cannot assign to member with non-identifier property");
    }
    object.object().Set(target.b->str, std::move(rhs));
  } else {
    FailAt(node, "Invalid LHS inside assignment expression");
  }
}

void Interpreter::RenderIf(const Node& node,
                           const std::shared_ptr<Scope>& scope,
                           std::string& out) {
  const bool test = Evaluate(node.a.get(), scope).Truthy();
  RenderBlock(test ? node.body : node.alternate, scope, out);
}

void Interpreter::BindLoopVariable(const Node& loopvar, const Value& item,
                                   Scope& scope) {
  if (loopvar.type == NodeType::kIdentifier) {
    scope.Set(loopvar.str, item);
    return;
  }
  const auto& values = item.array().items;  // Validated by the caller.
  for (size_t j = 0; j < loopvar.args.size(); ++j) {
    if (loopvar.args[j]->type != NodeType::kIdentifier) {
      FailAt(loopvar, "Cannot unpack non-identifier type");
    }
    scope.Set(loopvar.args[j]->str,
              j < values.size() ? values[j] : Value::Undefined());
  }
}

void Interpreter::RenderFor(const Node& node,
                            const std::shared_ptr<Scope>& parent,
                            std::string& out) {
  auto scope = std::make_shared<Scope>();
  scope->parent = parent;
  const Node* test = nullptr;
  Value iterable;
  if (node.b->type == NodeType::kSelect) {
    iterable = Evaluate(node.b->a.get(), scope);
    test = node.b->b.get();
  } else {
    iterable = Evaluate(node.b.get(), scope);
  }
  std::vector<Value> candidates;
  if (iterable.is(Kind::kArray)) {
    candidates = iterable.array().items;
  } else if (iterable.IsObject()) {
    for (const auto& [k, v] : iterable.object().entries) {
      candidates.push_back(Value::String(k));
    }
  } else {
    FailAt(node,
           absl::StrCat("Expected iterable or object type in for loop: got ",
                        iterable.TypeName()));
  }
  Charge(candidates.size());
  const Node& loopvar = *node.a;
  std::vector<Value> items;
  if (loopvar.type == NodeType::kIdentifier && test == nullptr) {
    items = std::move(candidates);
  } else {
    for (const Value& current : candidates) {
      if (loopvar.type == NodeType::kTupleLiteral) {
        if (!current.is(Kind::kArray) || current.array().tuple) {
          FailAt(node, absl::StrCat("Cannot unpack non-iterable type: ",
                                    current.TypeName()));
        }
        const size_t expected = loopvar.args.size();
        const size_t actual = current.array().items.size();
        if (expected != actual) {
          FailAt(node, absl::StrCat("Too ", expected > actual ? "few" : "many",
                                    " items to unpack"));
        }
      }
      if (test != nullptr) {
        auto loop_scope = std::make_shared<Scope>();
        loop_scope->parent = scope;
        BindLoopVariable(loopvar, current, *loop_scope);
        if (!Evaluate(test, loop_scope).Truthy()) continue;
      }
      items.push_back(current);
    }
  }
  bool no_iteration = true;
  const double length = static_cast<double>(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    // An iteration builds the `loop` object: worth more than a node.
    Charge(10);
    const double index = static_cast<double>(i);
    scope->Set("loop",
               NewObject({
                   {"index", Value::Int(index + 1)},
                   {"index0", Value::Int(index)},
                   {"revindex", Value::Int(length - index)},
                   {"revindex0", Value::Int(length - index - 1)},
                   {"first", Value::Bool(i == 0)},
                   {"last", Value::Bool(i + 1 == items.size())},
                   {"length", Value::Int(length)},
                   {"previtem", i > 0 ? items[i - 1] : Value::Undefined()},
                   {"nextitem",
                    i + 1 < items.size() ? items[i + 1] : Value::Undefined()},
               }));
    BindLoopVariable(loopvar, items[i], *scope);
    try {
      RenderBlock(node.body, scope, out);
    } catch (const ContinueSignal&) {
      continue;
    } catch (const BreakSignal&) {
      break;
    }
    no_iteration = false;
  }
  if (no_iteration) RenderBlock(node.alternate, scope, out);
}

void Interpreter::BindMacroArguments(const std::string& display_name,
                                     const Node& macro,
                                     const std::vector<NodePtr>& params,
                                     std::vector<Value> args,
                                     const std::shared_ptr<Scope>& self) {
  Scope& scope = *self;
  std::shared_ptr<ObjectData> kwargs = PopKwargs(args);
  if (kwargs) {
    auto copy = std::make_shared<ObjectData>();
    for (const auto& [k, v] : kwargs->entries) copy->Set(k, v);
    kwargs = std::move(copy);
  } else {
    kwargs = std::make_shared<ObjectData>();
  }
  std::vector<const Node*> pending_defaults;
  for (size_t i = 0; i < params.size(); ++i) {
    const Node& p = *params[i];
    const std::string& name = p.str;
    const bool has_default = p.type == NodeType::kKeywordArg;
    std::optional<Value> value;
    if (i < args.size()) value = args[i];
    if (!value) {
      if (const Value* kw = kwargs->Find(name)) {
        value = *kw;
        kwargs->Erase(name);
      }
    }
    if (!value && has_default) pending_defaults.push_back(&p);
    scope.Set(name, value ? std::move(*value) : Value::Undefined());
  }
  if (macro.uses_kwargs) {
    scope.Set("kwargs", Value::Object(kwargs));
  } else if (!kwargs->entries.empty()) {
    Fail(absl::StrCat("macro ", display_name, " takes no keyword argument '",
                      kwargs->entries.front().first, "'"));
  }
  if (macro.uses_varargs) {
    std::vector<Value> rest;
    for (size_t i = params.size(); i < args.size(); ++i)
      rest.push_back(args[i]);
    scope.Set("varargs", Value::Array(std::move(rest)));
  } else if (args.size() > params.size()) {
    Fail(absl::StrCat("macro ", display_name, " takes not more than ",
                      params.size(), " argument(s)"));
  }
  // Defaults see the other parameters (bound above), not an outer scope.
  for (const Node* p : pending_defaults) {
    scope.Set(p->str, Evaluate(p->a.get(), self));
  }
}

Value Interpreter::DefineMacro(const Node& node,
                               const std::shared_ptr<Scope>& scope) {
  TrackScope(scope);
  const Node* macro = &node;
  // The macro captures its defining scope (lexical scoping, late binding),
  // through a weak pointer plus the FunctionData's strong `captured`.
  std::weak_ptr<Scope> defining = scope;
  scope->Set(
      node.str,
      MakeFunction(
          [macro, defining](Interpreter& in, std::vector<Value>& args,
                            const std::shared_ptr<Scope>& call_site) -> Value {
            std::shared_ptr<Scope> parent = defining.lock();
            if (!parent) Fail("macro called after its scope ended");
            if (macro->uses_caller) {
              Value caller;
              if (call_site && call_site->call_block) {
                auto it = call_site->vars.find("caller");
                if (it != call_site->vars.end()) caller = it->second;
              }
              auto with_caller = std::make_shared<Scope>();
              with_caller->parent = parent;
              with_caller->Set("caller", std::move(caller));
              parent = std::move(with_caller);
            }
            auto macro_scope = std::make_shared<Scope>();
            macro_scope->parent = parent;
            in.BindMacroArguments(absl::StrCat("'", macro->str, "'"), *macro,
                                  macro->args, args, macro_scope);
            return in.NewString(in.RenderBody(macro->body, macro_scope));
          },
          scope));
  return Value::Null();
}

Value Interpreter::EvalCallBlock(const Node& node,
                                 const std::shared_ptr<Scope>& scope) {
  TrackScope(scope);
  const Node* block = &node;
  std::weak_ptr<Scope> defining = scope;
  Value caller = MakeFunction(
      [block, defining](Interpreter& in, std::vector<Value>& args,
                        const std::shared_ptr<Scope>&) -> Value {
        std::shared_ptr<Scope> parent = defining.lock();
        if (!parent) Fail("caller() called after its scope ended");
        auto env = std::make_shared<Scope>();
        env->parent = parent;
        in.BindMacroArguments("None", *block, block->args, args, env);
        return in.NewString(in.RenderBody(block->body, env));
      },
      scope);
  auto [macro_args, macro_kwargs] = EvalArguments(node.a->args, scope);
  macro_kwargs->kwargs = true;
  macro_args.push_back(Value::Object(macro_kwargs));
  const Value fn = Evaluate(node.a->a.get(), scope);
  if (!fn.is(Kind::kFunction)) {
    FailAt(node,
           absl::StrCat("Cannot call something that is not a function: got ",
                        fn.TypeName()));
  }
  auto env = std::make_shared<Scope>();
  env->parent = scope;
  env->call_block = true;
  env->Set("caller", std::move(caller));
  DepthGuard guard(*this);
  return fn.function().fn(*this, macro_args, env);
}

// ---- Expressions ----

Value Interpreter::Evaluate(const Node* node,
                            const std::shared_ptr<Scope>& scope) {
  if (node == nullptr) return Value::Undefined();
  DepthGuard guard(*this);
  Charge(1);
  switch (node->type) {
    case NodeType::kIdentifier: {
      const Value* v = scope->Lookup(node->str);
      if (v != nullptr) return *v;
      return Value::Undefined();
    }
    case NodeType::kInteger:
      return Value::Int(node->number);
    case NodeType::kFloat:
      return Value::Float(node->number);
    case NodeType::kString:
      return Value::String(node->str);
    case NodeType::kBinary:
      return EvalBinary(*node, scope);
    case NodeType::kMember:
      return EvalMember(*node, scope);
    case NodeType::kCall:
      return EvalCall(*node, scope);
    case NodeType::kFilter:
      return ApplyFilter(Evaluate(node->a.get(), scope), *node->b, scope);
    case NodeType::kTest:
      return EvalTest(*node, scope);
    case NodeType::kTernary:
      return Evaluate(node->a.get(), scope).Truthy()
                 ? Evaluate(node->b.get(), scope)
                 : Evaluate(node->c.get(), scope);
    case NodeType::kUnary:
      return EvalUnary(*node, scope);
    case NodeType::kArrayLiteral:
    case NodeType::kTupleLiteral: {
      std::vector<Value> items;
      items.reserve(node->args.size());
      for (const auto& a : node->args)
        items.push_back(Evaluate(a.get(), scope));
      Value v = Value::Array(std::move(items));
      v.array().tuple = node->type == NodeType::kTupleLiteral;
      return v;
    }
    case NodeType::kObjectLiteral: {
      auto data = std::make_shared<ObjectData>();
      for (size_t i = 0; i + 1 < node->args.size(); i += 2) {
        const Value key = Evaluate(node->args[i].get(), scope);
        if (!key.is(Kind::kString)) {
          FailAt(*node, absl::StrCat("Object keys must be strings: got ",
                                     key.TypeName()));
        }
        data->Set(key.str(), Evaluate(node->args[i + 1].get(), scope));
      }
      return Value::Object(std::move(data));
    }
    case NodeType::kSelect:
      if (!Evaluate(node->b.get(), scope).Truthy()) return Value::Undefined();
      return Evaluate(node->a.get(), scope);
    case NodeType::kIf: {
      std::string out;
      RenderIf(*node, scope, out);
      return NewString(std::move(out));
    }
    case NodeType::kFor: {
      std::string out;
      RenderFor(*node, scope, out);
      return NewString(std::move(out));
    }
    case NodeType::kSet:
      ExecSet(*node, scope);
      return Value::Null();
    case NodeType::kMacro:
      return DefineMacro(*node, scope);
    case NodeType::kCallBlock:
      return EvalCallBlock(*node, scope);
    case NodeType::kFilterBlock: {
      const Value body = NewString(RenderBody(node->body, scope));
      return ApplyFilter(body, *node->a, scope);
    }
    case NodeType::kComment:
      return Value::Null();
    case NodeType::kBreak:
      throw BreakSignal();
    case NodeType::kContinue:
      throw ContinueSignal();
    case NodeType::kText:
      return Value::String(node->str);
    default:
      FailAt(*node, "unexpected syntax in this position");
  }
}

Value Interpreter::EvalBinary(const Node& node,
                              const std::shared_ptr<Scope>& scope) {
  const std::string& op = node.str;
  Value left = Evaluate(node.a.get(), scope);
  if (op == "and") return left.Truthy() ? Evaluate(node.b.get(), scope) : left;
  if (op == "or") return left.Truthy() ? left : Evaluate(node.b.get(), scope);
  Value right = Evaluate(node.b.get(), scope);
  if (op == "==") return Value::Bool(LooseEquals(left, right));
  if (op == "!=") return Value::Bool(!LooseEquals(left, right));

  const auto concat = [&](const std::string& a, const std::string& b) {
    if (a.size() + b.size() > limits_.max_output_bytes) {
      Exhausted(absl::StrCat("template builds a string longer than ",
                             limits_.max_output_bytes, " bytes"));
    }
    return NewString(a + b);
  };

  if (left.IsNumber() && right.IsNumber() && op != "~" && op != "**") {
    const double a = left.number(), b = right.number();
    const bool is_float = left.is(Kind::kFloat) || right.is(Kind::kFloat);
    const auto num = [&](double r) {
      return is_float ? Value::Float(r) : Value::Int(r);
    };
    if (op == "+") return num(a + b);
    if (op == "-") return num(a - b);
    if (op == "*") return num(a * b);
    if (op == "/") return Value::Float(a / b);
    if (op == "//") return num(std::floor(a / b));
    if (op == "%") return num(std::fmod(a, b));
    if (op == "<") return Value::Bool(a < b);
    if (op == ">") return Value::Bool(a > b);
    if (op == ">=") return Value::Bool(a >= b);
    if (op == "<=") return Value::Bool(a <= b);
  } else if (left.is(Kind::kUndefined) || right.is(Kind::kUndefined)) {
    if (right.is(Kind::kUndefined) && (op == "in" || op == "not in")) {
      return Value::Bool(op == "not in");
    }
    if (op == "~" && !left.is(Kind::kNull) && !right.is(Kind::kNull)) {
      return concat(left.is(Kind::kUndefined) ? "" : JsString(left),
                    right.is(Kind::kUndefined) ? "" : JsString(right));
    }
    FailAt(node, absl::StrCat("Cannot perform operation ", op,
                              " on undefined values"));
  } else if (left.is(Kind::kNull) || right.is(Kind::kNull)) {
    FailAt(node, "Cannot perform operation on null values");
  } else if (op == "~") {
    return concat(JsString(left), JsString(right));
  } else if (op == "**" && (left.IsNumber() || left.is(Kind::kBool)) &&
             (right.IsNumber() || right.is(Kind::kBool))) {
    const double a = left.is(Kind::kBool) ? left.boolean() : left.number();
    const double b = right.is(Kind::kBool) ? right.boolean() : right.number();
    if (a == 0 && b < 0)
      FailAt(node, "0.0 cannot be raised to a negative power");
    // JavaScript: 1 ** NaN and (-1) ** ±Infinity are NaN (C's pow says 1).
    const double result =
        (std::fabs(a) == 1 && !std::isfinite(b)) ? NAN : std::pow(a, b);
    if (!std::isfinite(result)) {
      FailAt(node, "Exponentiation result is not a finite real number");
    }
    const bool is_float =
        left.is(Kind::kFloat) || right.is(Kind::kFloat) || b < 0;
    return is_float ? Value::Float(result) : Value::Int(result);
  } else if (left.is(Kind::kArray) && right.is(Kind::kArray)) {
    if (op == "+") {
      const auto& a = left.array().items;
      const auto& b = right.array().items;
      CheckItems(a.size() + b.size());
      std::vector<Value> items(a);
      items.insert(items.end(), b.begin(), b.end());
      return Value::Array(std::move(items));
    }
  } else if (right.is(Kind::kArray)) {
    if (op == "in" || op == "not in") {
      const auto& items = right.array().items;
      Charge(items.size());
      const bool member =
          std::any_of(items.begin(), items.end(),
                      [&](const Value& x) { return StrictEquals(x, left); });
      return Value::Bool(op == "in" ? member : !member);
    }
  }
  if ((left.is(Kind::kString) || right.is(Kind::kString)) && op == "+") {
    return concat(JsString(left), JsString(right));
  }
  if (left.is(Kind::kString) && right.is(Kind::kString) &&
      (op == "in" || op == "not in")) {
    Charge(right.str().size() / 16);
    const bool found = right.str().find(left.str()) != std::string::npos;
    return Value::Bool(op == "in" ? found : !found);
  }
  if (left.is(Kind::kString) && right.IsObject() &&
      (op == "in" || op == "not in")) {
    const bool found = right.object().Find(left.str()) != nullptr;
    return Value::Bool(op == "in" ? found : !found);
  }
  FailAt(node, absl::StrCat("Unknown operator \"", op, "\" between ",
                            left.TypeName(), " and ", right.TypeName()));
}

Value Interpreter::EvalUnary(const Node& node,
                             const std::shared_ptr<Scope>& scope) {
  const Value arg = Evaluate(node.a.get(), scope);
  if (node.str == "not") return Value::Bool(!arg.Truthy());
  const double sign = node.str == "-" ? -1 : 1;
  if (arg.IsNumber() || arg.is(Kind::kBool)) {
    const double v =
        arg.is(Kind::kBool) ? (arg.boolean() ? 1 : 0) : arg.number();
    return arg.is(Kind::kFloat) ? Value::Float(sign * v) : Value::Int(sign * v);
  }
  FailAt(node, absl::StrCat("Unknown operator \"", node.str, "\" for ",
                            arg.TypeName()));
}

Value Interpreter::Property(const Value& object, const Value& property) {
  if (object.IsAttributeContainer()) {
    if (!property.is(Kind::kString)) {
      Fail(absl::StrCat("Cannot access property with non-string: got ",
                        property.TypeName()));
    }
    if (const Value* v = object.object().Find(property.str())) return *v;
    if (object.IsObject()) return ObjectMethod(*this, object, property.str());
    return Value::Undefined();
  }
  if (object.is(Kind::kArray) || object.is(Kind::kString)) {
    if (property.is(Kind::kInt)) {
      if (object.is(Kind::kArray)) {
        const auto& items = object.array().items;
        const auto i = RelativeIndex(property.number(), items.size());
        return i ? items[*i] : Value::Undefined();
      }
      const std::u16string units = ToUtf16(object.str());
      Charge(units.size() / 16);
      const auto i = RelativeIndex(property.number(), units.size());
      if (!i) return Value::Undefined();
      return Value::String(FromUtf16(std::u16string_view(&units[*i], 1)));
    }
    if (property.is(Kind::kString)) {
      if (object.is(Kind::kArray)) {
        if (property.str() == "length") {
          return Value::Int(static_cast<double>(object.array().items.size()));
        }
        return Value::Undefined();
      }
      return StringMethod(*this, object, property.str());
    }
    Fail(absl::StrCat("Cannot access property with non-string/non-number: got ",
                      property.TypeName()));
  }
  if (!property.is(Kind::kString)) {
    Fail(absl::StrCat("Cannot access property with non-string: got ",
                      property.TypeName()));
  }
  return Value::Undefined();
}

Value Interpreter::EvalMember(const Node& node,
                              const std::shared_ptr<Scope>& scope) {
  const Value object = Evaluate(node.a.get(), scope);
  Value property;
  if (node.flag) {
    if (node.b->type == NodeType::kSlice)
      return EvalSlice(object, *node.b, scope);
    property = Evaluate(node.b.get(), scope);
  } else if (node.b->type == NodeType::kInteger) {
    property = Value::Int(node.b->number);
  } else {
    property = Value::String(node.b->str);
  }
  try {
    return Property(object, property);
  } catch (TemplateError& e) {
    if (e.code == absl::StatusCode::kInvalidArgument && !e.raised &&
        e.message.rfind(origin_, 0) != 0) {
      FailAt(node, e.message);
    }
    throw;
  }
}

Value Interpreter::EvalSlice(const Value& object, const Node& slice,
                             const std::shared_ptr<Scope>& scope) {
  if (!object.is(Kind::kArray) && !object.is(Kind::kString)) {
    FailAt(slice, "Slice object must be an array or string");
  }
  const Value start = Evaluate(slice.a.get(), scope);
  const Value stop = Evaluate(slice.b.get(), scope);
  const Value step = Evaluate(slice.c.get(), scope);
  const auto part = [&](const Value& v, const char* name) {
    if (!v.is(Kind::kInt) && !v.is(Kind::kUndefined)) {
      FailAt(slice,
             absl::StrCat("Slice ", name, " must be numeric or undefined"));
    }
    return v.is(Kind::kInt) ? std::optional<double>(v.number()) : std::nullopt;
  };
  const auto a = part(start, "start");
  const auto b = part(stop, "stop");
  const auto c = part(step, "step");
  double step_value = c.value_or(1);
  if (std::isnan(step_value)) step_value = 0;
  if (object.is(Kind::kArray)) {
    const auto& items = object.array().items;
    Charge(items.size());
    std::vector<Value> out;
    for (size_t i : SliceIndices(items.size(), a, b, step_value)) {
      out.push_back(items[i]);
    }
    return Value::Array(std::move(out));
  }
  const std::vector<std::string> chars = CodePoints(object.str());
  Charge(chars.size());
  std::string out;
  for (size_t i : SliceIndices(chars.size(), a, b, step_value)) out += chars[i];
  return NewString(std::move(out));
}

std::pair<std::vector<Value>, std::shared_ptr<ObjectData>>
Interpreter::EvalArguments(const std::vector<NodePtr>& args,
                           const std::shared_ptr<Scope>& scope) {
  std::vector<Value> positional;
  auto keywords = std::make_shared<ObjectData>();
  keywords->kwargs = true;
  for (const NodePtr& arg : args) {
    if (arg->type == NodeType::kSpread) {
      const Value v = Evaluate(arg->a.get(), scope);
      if (!v.is(Kind::kArray)) {
        FailAt(*arg,
               absl::StrCat("Cannot unpack non-iterable type: ", v.TypeName()));
      }
      CheckItems(positional.size() + v.array().items.size());
      for (const Value& item : v.array().items) positional.push_back(item);
    } else if (arg->type != NodeType::kKeywordArg &&
               arg->type != NodeType::kKeywordSpread) {
      positional.push_back(Evaluate(arg.get(), scope));
    }
  }
  const auto add = [&](const Node& at, const std::string& key, Value v) {
    if (keywords->Find(key) != nullptr) {
      FailAt(at, absl::StrCat("Got multiple values for keyword argument '", key,
                              "'"));
    }
    keywords->Set(key, std::move(v));
  };
  for (const NodePtr& arg : args) {
    if (arg->type == NodeType::kKeywordArg) {
      add(*arg, arg->str, Evaluate(arg->a.get(), scope));
    } else if (arg->type == NodeType::kKeywordSpread) {
      const Value v = Evaluate(arg->a.get(), scope);
      if (!v.IsObject()) {
        FailAt(*arg, absl::StrCat("Argument after ** must be a mapping, not ",
                                  v.TypeName()));
      }
      for (const auto& [k, x] : v.object().entries) add(*arg, k, x);
    }
  }
  return {std::move(positional), std::move(keywords)};
}

std::vector<Value> Interpreter::EvalCallArguments(
    const std::vector<NodePtr>& args, const std::shared_ptr<Scope>& scope) {
  for (const NodePtr& arg : args) {
    if (arg->type == NodeType::kKeywordArg || arg->type == NodeType::kSpread ||
        arg->type == NodeType::kKeywordSpread) {
      auto [positional, keywords] = EvalArguments(args, scope);
      if (!keywords->entries.empty()) {
        positional.push_back(Value::Object(std::move(keywords)));
      }
      return positional;
    }
  }
  std::vector<Value> positional;
  positional.reserve(args.size());
  for (const NodePtr& arg : args)
    positional.push_back(Evaluate(arg.get(), scope));
  return positional;
}

Value Interpreter::EvalCall(const Node& node,
                            const std::shared_ptr<Scope>& scope) {
  std::vector<Value> args = EvalCallArguments(node.args, scope);
  const Value fn = Evaluate(node.a.get(), scope);
  if (!fn.is(Kind::kFunction)) {
    FailAt(node,
           absl::StrCat("Cannot call something that is not a function: got ",
                        fn.TypeName()));
  }
  try {
    return fn.function().fn(*this, args, scope);
  } catch (TemplateError& e) {
    // Errors of built-in functions get the call's position; raised ones
    // (raise_exception) and already-positioned ones pass through verbatim.
    if (e.code == absl::StatusCode::kInvalidArgument && !e.raised &&
        e.message.rfind(origin_, 0) != 0) {
      FailAt(node, e.message);
    }
    throw;
  }
}

Value Interpreter::EvalTest(const Node& node,
                            const std::shared_ptr<Scope>& scope) {
  const Value operand = Evaluate(node.a.get(), scope);
  if (!HasTest(node.str))
    FailAt(node, absl::StrCat("Unknown test: ", node.str));
  std::vector<Value> args;
  for (const auto& a : node.args) args.push_back(Evaluate(a.get(), scope));
  bool result;
  try {
    result = RunTest(node.str, operand, args);
  } catch (TemplateError& e) {
    FailAt(node, e.message);
  }
  return Value::Bool(node.flag ? !result : result);
}

// ---- Tests ----

namespace {

bool IsStringCase(const Value& v, bool upper) {
  if (!v.is(Kind::kString)) {
    Fail(absl::StrCat("cannot test the case of ", v.TypeName()));
  }
  return v.str() == (upper ? ToUpper(v.str()) : ToLower(v.str()));
}

}  // namespace

bool HasTest(const std::string& name) {
  static const char* const kTests[] = {
      "boolean",  "callable",    "odd",    "even",    "false",     "true",
      "none",     "string",      "number", "integer", "iterable",  "mapping",
      "sequence", "lower",       "upper",  "defined", "undefined", "equalto",
      "eq",       "divisibleby", "sameas", "ne",      "float"};
  for (const char* t : kTests) {
    if (name == t) return true;
  }
  return false;
}

bool RunTest(const std::string& name, const Value& v,
             const std::vector<Value>& args) {
  const Value arg = args.empty() ? Value::Undefined() : args[0];
  if (name == "boolean") return v.is(Kind::kBool);
  if (name == "callable") return v.is(Kind::kFunction);
  if (name == "odd" || name == "even") {
    if (!v.is(Kind::kInt))
      Fail(absl::StrCat("cannot ", name, " on ", v.TypeName()));
    const bool odd = std::fmod(v.number(), 2) != 0;
    return name == "odd" ? odd : !odd;
  }
  if (name == "false") return v.is(Kind::kBool) && !v.boolean();
  if (name == "true") return v.is(Kind::kBool) && v.boolean();
  if (name == "none") return v.is(Kind::kNull);
  if (name == "string") return v.is(Kind::kString);
  if (name == "number") return v.IsNumber();
  if (name == "integer") return v.is(Kind::kInt);
  if (name == "float") return v.is(Kind::kFloat);  // Extension (Jinja2).
  if (name == "iterable") {
    return (v.is(Kind::kArray) && !v.array().tuple) || v.is(Kind::kString);
  }
  if (name == "mapping") return v.IsObject();
  if (name == "sequence") {
    return v.is(Kind::kArray) || v.IsObject() || v.is(Kind::kString);
  }
  if (name == "lower") return IsStringCase(v, false);
  if (name == "upper") return IsStringCase(v, true);
  if (name == "defined") return !v.is(Kind::kUndefined);
  if (name == "undefined") return v.is(Kind::kUndefined);
  if (name == "equalto" || name == "eq" || name == "sameas") {
    return StrictEquals(v, arg);
  }
  if (name == "ne") return !StrictEquals(v, arg);  // Extension (Jinja2).
  if (name == "divisibleby") {                     // Extension (Jinja2).
    if (!v.IsNumber() || !arg.IsNumber()) {
      Fail("divisibleby needs two numbers");
    }
    return arg.number() != 0 && std::fmod(v.number(), arg.number()) == 0;
  }
  Fail(absl::StrCat("Unknown test: ", name));
}

int CompareValues(const Value& a, const Value& b, bool case_sensitive) {
  if (a.is(Kind::kNull) && b.is(Kind::kNull)) return 0;
  if (a.is(Kind::kNull) || b.is(Kind::kNull)) {
    Fail(absl::StrCat("Cannot compare ", a.TypeName(), " with ", b.TypeName()));
  }
  if (a.is(Kind::kUndefined) && b.is(Kind::kUndefined)) return 0;
  if (a.is(Kind::kUndefined) || b.is(Kind::kUndefined)) {
    Fail(absl::StrCat("Cannot compare ", a.TypeName(), " with ", b.TypeName()));
  }
  const auto numeric = [](const Value& v) {
    return v.IsNumber() || v.is(Kind::kBool);
  };
  if (numeric(a) && numeric(b)) {
    const double x = a.is(Kind::kBool) ? a.boolean() : a.number();
    const double y = b.is(Kind::kBool) ? b.boolean() : b.number();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.kind() != b.kind() ||
      std::string_view(a.TypeName()) != std::string_view(b.TypeName())) {
    Fail(absl::StrCat("Cannot compare different types: ", a.TypeName(), " and ",
                      b.TypeName()));
  }
  if (!a.is(Kind::kString)) {
    Fail(absl::StrCat("Cannot compare type: ", a.TypeName()));
  }
  // JavaScript compares strings by UTF-16 code units.
  const std::u16string x = ToUtf16(case_sensitive ? a.str() : ToLower(a.str()));
  const std::u16string y = ToUtf16(case_sensitive ? b.str() : ToLower(b.str()));
  return x < y ? -1 : x > y ? 1 : 0;
}

// ---- Built-in methods ----

Value StringMethod(Interpreter& in, const Value& self,
                   const std::string& name) {
  const std::string& s = self.str();
  if (name == "length") {
    return Value::Int(static_cast<double>(Utf16Length(s)));
  }
  const auto method = [&](auto body) {
    return MakeFunction([self, body](Interpreter& in, std::vector<Value>& args,
                                     const std::shared_ptr<Scope>&) -> Value {
      in.Charge(self.str().size() / 16);
      return body(in, self.str(), args);
    });
  };
  using Args = std::vector<Value>;
  if (name == "upper") {
    return method([](Interpreter& in, const std::string& s, Args&) {
      return in.NewString(ToUpper(s));
    });
  }
  if (name == "lower") {
    return method([](Interpreter& in, const std::string& s, Args&) {
      return in.NewString(ToLower(s));
    });
  }
  // Like the reference, strip/lstrip/rstrip ignore their argument and strip
  // whitespace.
  if (name == "strip") {
    return method([](Interpreter& in, const std::string& s, Args&) {
      return in.NewString(std::string(Trim(s)));
    });
  }
  if (name == "lstrip") {
    return method([](Interpreter& in, const std::string& s, Args&) {
      return in.NewString(std::string(TrimStart(s)));
    });
  }
  if (name == "rstrip") {
    return method([](Interpreter& in, const std::string& s, Args&) {
      return in.NewString(std::string(TrimEnd(s)));
    });
  }
  if (name == "title") {
    return method([](Interpreter& in, const std::string& s, Args&) {
      return in.NewString(TitleCase(s));
    });
  }
  if (name == "capitalize") {
    return method([](Interpreter& in, const std::string& s, Args&) {
      // charAt(0).toUpperCase() + slice(1): only the first UTF-16 unit.
      if (s.empty()) return in.NewString("");
      size_t pos = 0;
      const uint32_t cp = DecodeUtf8(s, pos);
      if (cp >= 0x10000) return in.NewString(s);
      return in.NewString(ToUpper(s.substr(0, pos)) + s.substr(pos));
    });
  }
  if (name == "startswith" || name == "endswith") {
    const bool starts = name == "startswith";
    return method([starts](Interpreter&, const std::string& s, Args& args) {
      const char* fn = starts ? "startswith" : "endswith";
      if (args.empty()) {
        Fail(absl::StrCat(fn, "() requires at least one argument"));
      }
      const auto test = [&](const std::string& p) {
        return starts ? s.compare(0, p.size(), p) == 0 && s.size() >= p.size()
                      : s.size() >= p.size() &&
                            s.compare(s.size() - p.size(), p.size(), p) == 0;
      };
      if (args[0].is(Kind::kString)) return Value::Bool(test(args[0].str()));
      if (args[0].is(Kind::kArray)) {
        for (const Value& item : args[0].array().items) {
          if (!item.is(Kind::kString)) {
            Fail(absl::StrCat(fn, "() tuple elements must be strings"));
          }
          if (test(item.str())) return Value::Bool(true);
        }
        return Value::Bool(false);
      }
      Fail(
          absl::StrCat(fn, "() argument must be a string or tuple of strings"));
    });
  }
  if (name == "split") {
    return method([](Interpreter& in, const std::string& s, Args& args) {
      const Value sep = args.size() > 0 ? args[0] : Value::Null();
      if (!sep.is(Kind::kString) && !sep.is(Kind::kNull)) {
        Fail("sep argument must be a string or null");
      }
      const Value maxsplit_v = args.size() > 1 ? args[1] : Value::Int(-1);
      if (!maxsplit_v.is(Kind::kInt))
        Fail("maxsplit argument must be a number");
      const double maxsplit = maxsplit_v.number();
      std::vector<Value> out;
      if (sep.is(Kind::kNull)) {
        const std::string_view text = TrimStart(s);
        size_t pos = 0;
        while (pos < text.size()) {
          while (size_t n = JsWhitespaceAt(text, pos)) pos += n;
          if (pos >= text.size()) break;
          size_t end = pos;
          while (end < text.size() && JsWhitespaceAt(text, end) == 0) {
            DecodeUtf8(text, end);
          }
          if (maxsplit >= 0 && static_cast<double>(out.size()) >= maxsplit) {
            out.push_back(in.NewString(std::string(text.substr(pos))));
            break;
          }
          out.push_back(in.NewString(std::string(text.substr(pos, end - pos))));
          pos = end;
        }
      } else {
        const std::string& d = sep.str();
        if (d.empty()) Fail("empty separator");
        std::vector<std::string> parts;
        size_t start = 0;
        while (true) {
          const size_t hit = s.find(d, start);
          if (hit == std::string::npos) break;
          parts.push_back(s.substr(start, hit - start));
          start = hit + d.size();
        }
        parts.push_back(s.substr(start));
        if (maxsplit >= 0 && static_cast<double>(parts.size()) > maxsplit) {
          const size_t keep = static_cast<size_t>(maxsplit);
          std::string rest;
          for (size_t i = keep; i < parts.size(); ++i) {
            if (i > keep) rest += d;
            rest += parts[i];
          }
          parts.resize(keep);
          parts.push_back(std::move(rest));
        }
        for (auto& p : parts) out.push_back(in.NewString(std::move(p)));
      }
      in.CheckItems(out.size());
      return Value::Array(std::move(out));
    });
  }
  if (name == "replace") {
    return method([](Interpreter& in, const std::string& s, Args& args) {
      if (args.size() < 2) Fail("replace() requires at least two arguments");
      const Value& old_v = args[0];
      const Value& new_v = args[1];
      if (!old_v.is(Kind::kString) || !new_v.is(Kind::kString)) {
        Fail("replace() arguments must be strings");
      }
      Value count = Value::Null();
      if (args.size() > 2) {
        if (IsKwargs(args[2])) {
          const Value* c = args[2].object().Find("count");
          count = c ? *c : Value::Null();
        } else {
          count = args[2];
        }
      }
      if (!count.is(Kind::kInt) && !count.is(Kind::kNull)) {
        Fail("replace() count argument must be a number or null");
      }
      if (count.is(Kind::kInt) && count.number() == 0) return in.NewString(s);
      double remaining = (count.is(Kind::kNull) || count.number() < 0)
                             ? INFINITY
                             : count.number();
      const std::string& from = old_v.str();
      const std::string& to = new_v.str();
      std::string out;
      const auto grow = [&](std::string_view piece) {
        if (out.size() + piece.size() > in.limits().max_output_bytes) {
          Exhausted("replace() builds a string that is too long");
        }
        out.append(piece);
      };
      if (from.empty()) {
        // An empty pattern matches before every code point and at the end.
        size_t pos = 0;
        while (true) {
          if (remaining > 0) {
            grow(to);
            --remaining;
          }
          if (pos >= s.size()) break;
          const size_t start = pos;
          DecodeUtf8(s, pos);
          grow(std::string_view(s).substr(start, pos - start));
        }
      } else {
        size_t start = 0;
        while (remaining > 0) {
          const size_t hit = s.find(from, start);
          if (hit == std::string::npos) break;
          grow(std::string_view(s).substr(start, hit - start));
          grow(to);
          start = hit + from.size();
          --remaining;
        }
        grow(std::string_view(s).substr(start));
      }
      return in.NewString(std::move(out));
    });
  }
  return Value::Undefined();
}

Value ObjectMethod(Interpreter& in, const Value& self,
                   const std::string& name) {
  const auto method = [&](auto body) {
    return MakeFunction([self, body](Interpreter& in, std::vector<Value>& args,
                                     const std::shared_ptr<Scope>&) -> Value {
      in.Charge(self.object().entries.size());
      return body(in, self.object(), args);
    });
  };
  using Args = std::vector<Value>;
  if (name == "get") {
    return method([](Interpreter&, ObjectData& obj, Args& args) {
      if (args.empty() || !args[0].is(Kind::kString)) {
        Fail(
            absl::StrCat("Object key must be a string: got ",
                         args.empty() ? "UndefinedValue" : args[0].TypeName()));
      }
      if (const Value* v = obj.Find(args[0].str())) return *v;
      return args.size() > 1 ? args[1] : Value::Null();
    });
  }
  if (name == "items") {
    return method([](Interpreter&, ObjectData& obj, Args&) {
      std::vector<Value> out;
      for (const auto& [k, v] : obj.entries) {
        out.push_back(Value::Array({Value::String(k), v}));
      }
      return Value::Array(std::move(out));
    });
  }
  if (name == "keys") {
    return method([](Interpreter&, ObjectData& obj, Args&) {
      std::vector<Value> out;
      for (const auto& [k, v] : obj.entries) out.push_back(Value::String(k));
      return Value::Array(std::move(out));
    });
  }
  if (name == "values") {
    return method([](Interpreter&, ObjectData& obj, Args&) {
      std::vector<Value> out;
      for (const auto& [k, v] : obj.entries) out.push_back(v);
      return Value::Array(std::move(out));
    });
  }
  if (name == "dictsort") {
    return method([](Interpreter&, ObjectData& obj, Args& args) {
      std::shared_ptr<ObjectData> kwargs = PopKwargs(args);
      const Value case_sensitive = FirstOf(
          {At(args, 0), Kwarg(kwargs, "case_sensitive")}, Value::Bool(false));
      if (!case_sensitive.is(Kind::kBool))
        Fail("case_sensitive must be a boolean");
      const Value by =
          FirstOf({At(args, 1), Kwarg(kwargs, "by")}, Value::String("key"));
      if (!by.is(Kind::kString)) Fail("by must be a string");
      if (by.str() != "key" && by.str() != "value") {
        Fail("by must be either 'key' or 'value'");
      }
      const Value reverse =
          FirstOf({At(args, 2), Kwarg(kwargs, "reverse")}, Value::Bool(false));
      if (!reverse.is(Kind::kBool)) Fail("reverse must be a boolean");
      std::vector<Value> items;
      for (const auto& [k, v] : obj.entries) {
        items.push_back(Value::Array({Value::String(k), v}));
      }
      const size_t index = by.str() == "key" ? 0 : 1;
      const bool cs = case_sensitive.boolean();
      const bool rev = reverse.boolean();
      MergeSort(items, [&](const Value& a, const Value& b) {
        const int r =
            CompareValues(a.array().items[index], b.array().items[index], cs);
        return (rev ? -r : r) < 0;
      });
      return Value::Array(std::move(items));
    });
  }
  return Value::Undefined();
}

// ---- Filters ----

Value Interpreter::ApplyFilter(const Value& operand, const Node& filter,
                               const std::shared_ptr<Scope>& scope) {
  if (filter.type == NodeType::kCall) {
    return ApplyFilterCall(operand, filter, scope);
  }
  const std::string& name = filter.str;
  const auto fail = [&](const std::string& message) {
    FailAt(filter, message);
  };
  if (name == "safe") return operand;
  if (name == "tojson") {
    try {
      return NewString(ToJson(operand, JsonOptions{}, true,
                              limits_.max_json_depth,
                              limits_.max_output_bytes));
    } catch (TemplateError& e) {
      if (e.code != absl::StatusCode::kInvalidArgument) throw;
      fail(e.message);
    }
  }
  if (operand.is(Kind::kArray)) {
    const auto& items = operand.array().items;
    Charge(items.size());
    if (name == "list") return operand;
    if (name == "first") return items.empty() ? Value::Undefined() : items[0];
    if (name == "last")
      return items.empty() ? Value::Undefined() : items.back();
    if (name == "length") return Value::Int(static_cast<double>(items.size()));
    if (name == "reverse") {
      return Value::Array(std::vector<Value>(items.rbegin(), items.rend()));
    }
    if (name == "sort") {
      std::vector<Value> sorted = items;
      try {
        MergeSort(sorted, [](const Value& a, const Value& b) {
          return CompareValues(a, b, false) < 0;
        });
      } catch (TemplateError& e) {
        fail(e.message);
      }
      return Value::Array(std::move(sorted));
    }
    if (name == "join") {
      std::string out;
      for (const Value& v : items) {
        out += JoinString(v);
        if (out.size() > limits_.max_output_bytes) {
          Exhausted("join builds a string that is too long");
        }
      }
      return NewString(std::move(out));
    }
    if (name == "string") {
      return NewString(ToJson(operand, JsonOptions{}, false,
                              limits_.max_json_depth,
                              limits_.max_output_bytes));
    }
    if (name == "unique") {
      std::vector<Value> out;
      for (const Value& v : items) {
        // SameValueZero: like ===, but NaN equals NaN.
        const bool seen =
            std::any_of(out.begin(), out.end(), [&](const Value& o) {
              if (o.IsNumber() && v.IsNumber() && std::isnan(o.number()) &&
                  std::isnan(v.number())) {
                return true;
              }
              return StrictEquals(o, v);
            });
        Charge(out.size());
        if (!seen) out.push_back(v);
      }
      return Value::Array(std::move(out));
    }
    fail(absl::StrCat("Unknown ArrayValue filter: ", name));
  }
  if (operand.is(Kind::kString)) {
    const std::string& s = operand.str();
    Charge(s.size() / 16);
    if (name == "length" || name == "upper" || name == "lower" ||
        name == "title" || name == "capitalize") {
      Value builtin = StringMethod(*this, operand, name);
      if (builtin.is(Kind::kInt)) return builtin;
      std::vector<Value> no_args;
      return builtin.function().fn(*this, no_args, scope);
    }
    if (name == "trim") return NewString(std::string(Trim(s)));
    if (name == "indent") {
      std::string out;
      size_t start = 0;
      bool first = true;
      while (true) {
        const size_t nl = s.find('\n', start);
        const std::string_view line = std::string_view(s).substr(
            start, nl == std::string::npos ? std::string::npos : nl - start);
        if (!first) out.push_back('\n');
        if (!first && !line.empty()) out += "    ";
        out += line;
        first = false;
        if (nl == std::string::npos) break;
        start = nl + 1;
      }
      return NewString(std::move(out));
    }
    if (name == "join" || name == "string") return operand;
    if (name == "int") {
      const double v = JsParseInt(s);
      return Value::Int(std::isnan(v) ? 0 : v);
    }
    if (name == "float") {
      const double v = JsParseFloat(s);
      return Value::Float(std::isnan(v) ? 0 : v);
    }
    fail(absl::StrCat("Unknown StringValue filter: ", name));
  }
  if (operand.IsNumber()) {
    if (name == "abs") {
      return operand.is(Kind::kInt) ? Value::Int(std::fabs(operand.number()))
                                    : Value::Float(std::fabs(operand.number()));
    }
    if (name == "int") return Value::Int(std::trunc(operand.number()) + 0);
    if (name == "float") return Value::Float(operand.number());
    if (name == "string") return NewString(DisplayString(operand));
    fail(absl::StrCat("Unknown NumericValue filter: ", name));
  }
  if (operand.IsObject()) {
    if (name == "items") {
      std::vector<Value> no_args;
      return ObjectMethod(*this, operand, "items")
          .function()
          .fn(*this, no_args, scope);
    }
    if (name == "length") {
      return Value::Int(static_cast<double>(operand.object().entries.size()));
    }
    Value builtin = ObjectMethod(*this, operand, name);
    if (builtin.is(Kind::kFunction)) {
      std::vector<Value> no_args;
      try {
        return builtin.function().fn(*this, no_args, scope);
      } catch (TemplateError& e) {
        if (e.code != absl::StatusCode::kInvalidArgument) throw;
        fail(e.message);
      }
    }
    fail(absl::StrCat("Unknown ObjectValue filter: ", name));
  }
  if (operand.is(Kind::kBool)) {
    const bool b = operand.boolean();
    if (name == "bool") return Value::Bool(b);
    if (name == "int") return Value::Int(b ? 1 : 0);
    if (name == "float") return Value::Float(b ? 1 : 0);
    if (name == "string") return Value::String(b ? "true" : "false");
    fail(absl::StrCat("Unknown BooleanValue filter: ", name));
  }
  fail(absl::StrCat("Cannot apply filter \"", name,
                    "\" to type: ", operand.TypeName()));
  return Value();
}

Value Interpreter::ApplyFilterCall(const Value& operand, const Node& filter,
                                   const std::shared_ptr<Scope>& scope) {
  const auto fail = [&](const std::string& message) {
    FailAt(filter, message);
  };
  if (filter.a->type != NodeType::kIdentifier) fail("Unknown filter");
  const std::string& name = filter.a->str;
  const auto& arg_nodes = filter.args;

  if (name == "tojson") {
    auto [args, kwargs] = EvalArguments(arg_nodes, scope);
    JsonOptions options;
    const Value* indent = kwargs->Find("indent");
    if (indent && !indent->is(Kind::kNull)) {
      if (!indent->is(Kind::kInt)) fail("If set, indent must be a number");
      options.indent = indent->number();
    }
    const Value* ascii = kwargs->Find("ensure_ascii");
    if (ascii) {
      if (!ascii->is(Kind::kBool))
        fail("If set, ensure_ascii must be a boolean");
      options.ensure_ascii = ascii->boolean();
    }
    const Value* sort = kwargs->Find("sort_keys");
    if (sort) {
      if (!sort->is(Kind::kBool)) fail("If set, sort_keys must be a boolean");
      options.sort_keys = sort->boolean();
    }
    const Value* seps = kwargs->Find("separators");
    if (seps && !seps->is(Kind::kNull)) {
      if (!seps->is(Kind::kArray)) {
        fail("If set, separators must be a tuple of two strings");
      }
      const auto& items = seps->array().items;
      if (items.size() != 2 || !items[0].is(Kind::kString) ||
          !items[1].is(Kind::kString)) {
        fail("separators must be a tuple of two strings");
      }
      options.separators = {items[0].str(), items[1].str()};
    }
    try {
      return NewString(ToJson(operand, options, true, limits_.max_json_depth,
                              limits_.max_output_bytes));
    } catch (TemplateError& e) {
      if (e.code != absl::StatusCode::kInvalidArgument) throw;
      fail(e.message);
    }
  }
  if (name == "join") {
    std::vector<std::string> parts;
    if (operand.is(Kind::kString)) {
      parts = CodePoints(operand.str());
    } else if (operand.is(Kind::kArray)) {
      for (const Value& v : operand.array().items)
        parts.push_back(JoinString(v));
    } else {
      fail(absl::StrCat("Cannot apply filter \"join\" to type: ",
                        operand.TypeName()));
    }
    Charge(parts.size());
    auto [args, kwargs] = EvalArguments(arg_nodes, scope);
    const Value sep =
        FirstOf({At(args, 0), Kwarg(kwargs, "separator")}, Value::String(""));
    if (!sep.is(Kind::kString)) fail("separator must be a string");
    std::string out;
    for (size_t i = 0; i < parts.size(); ++i) {
      if (i > 0) out += sep.str();
      out += parts[i];
      if (out.size() > limits_.max_output_bytes) {
        Exhausted("join builds a string that is too long");
      }
    }
    return NewString(std::move(out));
  }
  if (name == "int" || name == "float") {
    const bool is_int = name == "int";
    auto [args, kwargs] = EvalArguments(arg_nodes, scope);
    const Value fallback = FirstOf({At(args, 0), Kwarg(kwargs, "default")},
                                   is_int ? Value::Int(0) : Value::Float(0));
    if (operand.is(Kind::kString)) {
      const double v =
          is_int ? JsParseInt(operand.str()) : JsParseFloat(operand.str());
      if (std::isnan(v)) return fallback;
      return is_int ? Value::Int(v) : Value::Float(v);
    }
    if (operand.IsNumber()) {
      return is_int ? Value::Int(std::trunc(operand.number()) + 0)
                    : Value::Float(operand.number());
    }
    if (operand.is(Kind::kBool)) {
      return is_int ? Value::Int(operand.boolean() ? 1 : 0)
                    : Value::Float(operand.boolean() ? 1 : 0);
    }
    fail(absl::StrCat("Cannot apply filter \"", name,
                      "\" to type: ", operand.TypeName()));
  }
  if (name == "default") {
    auto [args, kwargs] = EvalArguments(arg_nodes, scope);
    const Value fallback = FirstOf({At(args, 0)}, Value::String(""));
    const Value boolean =
        FirstOf({At(args, 1), Kwarg(kwargs, "boolean")}, Value::Bool(false));
    if (!boolean.is(Kind::kBool))
      fail("`default` filter flag must be a boolean");
    if (operand.is(Kind::kUndefined) ||
        (boolean.boolean() && !operand.Truthy())) {
      return fallback;
    }
    return operand;
  }

  if (operand.is(Kind::kArray)) {
    const auto& items = operand.array().items;
    Charge(items.size());
    if (name == "sort") {
      auto [args, kwargs] = EvalArguments(arg_nodes, scope);
      const Value reverse =
          FirstOf({At(args, 0), Kwarg(kwargs, "reverse")}, Value::Bool(false));
      if (!reverse.is(Kind::kBool)) fail("reverse must be a boolean");
      const Value cs = FirstOf({At(args, 1), Kwarg(kwargs, "case_sensitive")},
                               Value::Bool(false));
      if (!cs.is(Kind::kBool)) fail("case_sensitive must be a boolean");
      const Value attribute =
          FirstOf({At(args, 2), Kwarg(kwargs, "attribute")}, Value::Null());
      if (!attribute.is(Kind::kString) && !attribute.is(Kind::kInt) &&
          !attribute.is(Kind::kNull)) {
        fail("attribute must be a string, integer, or null");
      }
      const auto key = [&](const Value& item) {
        if (attribute.is(Kind::kNull)) return item;
        return AttributePath(item, attribute.is(Kind::kInt)
                                       ? JsNumber(attribute.number())
                                       : attribute.str());
      };
      std::vector<Value> sorted = items;
      try {
        MergeSort(sorted, [&](const Value& a, const Value& b) {
          const int r = CompareValues(key(a), key(b), cs.boolean());
          return (reverse.boolean() ? -r : r) < 0;
        });
      } catch (TemplateError& e) {
        fail(e.message);
      }
      return Value::Array(std::move(sorted));
    }
    if (name == "selectattr" || name == "rejectattr") {
      const bool select = name == "selectattr";
      for (const Value& item : items) {
        if (!item.IsAttributeContainer()) {
          fail(absl::StrCat("`", name,
                            "` can only be applied to array of objects"));
        }
      }
      for (const auto& a : arg_nodes) {
        if (a->type != NodeType::kString) {
          fail(absl::StrCat("arguments of `", name, "` must be strings"));
        }
      }
      if (arg_nodes.empty())
        fail(absl::StrCat("`", name, "` needs an attribute"));
      const std::string& attr = arg_nodes[0]->str;
      const std::string* test =
          arg_nodes.size() > 1 ? &arg_nodes[1]->str : nullptr;
      std::vector<Value> test_args;
      if (arg_nodes.size() > 2)
        test_args.push_back(Value::String(arg_nodes[2]->str));
      if (test && !HasTest(*test)) fail(absl::StrCat("Unknown test: ", *test));
      std::vector<Value> out;
      for (const Value& item : items) {
        const Value* a = item.object().Find(attr);
        bool result = false;
        if (a != nullptr) {
          try {
            result = test ? RunTest(*test, *a, test_args) : a->Truthy();
          } catch (TemplateError& e) {
            fail(e.message);
          }
        }
        if (result == select) out.push_back(item);
      }
      return Value::Array(std::move(out));
    }
    if (name == "map") {
      auto [args, kwargs] = EvalArguments(arg_nodes, scope);
      const Value* attr = kwargs->Find("attribute");
      if (attr == nullptr) {
        fail(
            "`map` expressions without `attribute` set are not currently "
            "supported.");
      }
      if (!attr->is(Kind::kString)) fail("attribute must be a string");
      const Value* fallback = kwargs->Find("default");
      std::vector<Value> out;
      for (const Value& item : items) {
        if (!item.IsAttributeContainer())
          fail("items in map must be an object");
        Value v = AttributePath(item, attr->str());
        if (v.is(Kind::kUndefined) && fallback) v = *fallback;
        out.push_back(std::move(v));
      }
      return Value::Array(std::move(out));
    }
    fail(absl::StrCat("Unknown ArrayValue filter: ", name));
  }
  if (operand.is(Kind::kString)) {
    if (name == "indent") {
      auto [args, kwargs] = EvalArguments(arg_nodes, scope);
      const Value width =
          FirstOf({At(args, 0), Kwarg(kwargs, "width")}, Value::Int(4));
      if (!width.is(Kind::kInt) && !width.is(Kind::kString)) {
        fail("width must be an integer or a string");
      }
      const Value first =
          FirstOf({At(args, 1), Kwarg(kwargs, "first")}, Value::Bool(false));
      const Value blank =
          FirstOf({At(args, 2), Kwarg(kwargs, "blank")}, Value::Bool(false));
      std::string indent;
      if (width.is(Kind::kString)) {
        indent = width.str();
      } else {
        const double n = std::max(0.0, width.number());
        if (n > 1024) Exhausted("indent width larger than 1024");
        indent.assign(static_cast<size_t>(n), ' ');
      }
      // The reference tests the raw JavaScript value of these.
      const bool first_b = RawTruthy(first);
      const bool blank_b = RawTruthy(blank);
      const std::string& s = operand.str();
      std::string out;
      size_t start = 0;
      for (size_t i = 0;; ++i) {
        const size_t nl = s.find('\n', start);
        const std::string_view line = std::string_view(s).substr(
            start, nl == std::string::npos ? std::string::npos : nl - start);
        if (i > 0) out.push_back('\n');
        if (!((!first_b && i == 0) || (!blank_b && line.empty())))
          out += indent;
        out += line;
        if (out.size() > limits_.max_output_bytes) {
          Exhausted("indent builds a string that is too long");
        }
        if (nl == std::string::npos) break;
        start = nl + 1;
      }
      return NewString(std::move(out));
    }
    if (name == "replace") {
      auto [args, kwargs] = EvalArguments(arg_nodes, scope);
      args.push_back(Value::Object(kwargs));
      Value fn = StringMethod(*this, operand, "replace");
      try {
        return fn.function().fn(*this, args, scope);
      } catch (TemplateError& e) {
        if (e.code != absl::StatusCode::kInvalidArgument) throw;
        fail(e.message);
      }
    }
    fail(absl::StrCat("Unknown StringValue filter: ", name));
  }
  if (operand.IsObject()) {
    Value builtin = ObjectMethod(*this, operand, name);
    if (builtin.is(Kind::kFunction)) {
      std::vector<Value> args = EvalCallArguments(arg_nodes, scope);
      try {
        return builtin.function().fn(*this, args, scope);
      } catch (TemplateError& e) {
        if (e.code != absl::StatusCode::kInvalidArgument) throw;
        fail(e.message);
      }
    }
    fail(absl::StrCat("Unknown ObjectValue filter: ", name));
  }
  fail(absl::StrCat("Cannot apply filter \"", name,
                    "\" to type: ", operand.TypeName()));
  return Value();
}

// ---- Globals ----

namespace {

// namespace(dict?, **kwargs): a mutable attribute bag.
Value NamespaceBuiltin(Interpreter& in, std::vector<Value>& args) {
  std::shared_ptr<ObjectData> kwargs = PopKwargs(args);
  if (args.size() > 1) {
    Fail(absl::StrCat("namespace expected at most 1 argument, got ",
                      args.size()));
  }
  auto entries = std::make_shared<ObjectData>();
  if (args.size() == 1) {
    const Value& source = args[0];
    if (source.IsObject()) {
      for (const auto& [k, v] : source.object().entries) entries->Set(k, v);
    } else if (source.is(Kind::kArray)) {
      for (const Value& pair : source.array().items) {
        std::vector<Value> kv;
        if (pair.is(Kind::kArray)) {
          kv = pair.array().items;
        } else if (pair.is(Kind::kString)) {
          for (auto& c : CodePoints(pair.str())) kv.push_back(Value::String(c));
        }
        if (kv.size() != 2) {
          Fail(
              "namespace expected an object or an iterable of [key, value] "
              "pairs");
        }
        if (!kv[0].is(Kind::kString)) Fail("namespace keys must be strings");
        entries->Set(kv[0].str(), kv[1]);
      }
    } else {
      Fail(absl::StrCat("'", source.TypeName(), "' object is not iterable"));
    }
  }
  if (kwargs) {
    for (const auto& [k, v] : kwargs->entries) entries->Set(k, v);
  }
  in.Charge(entries->entries.size());
  in.TrackNamespace(entries);
  return Value::Namespace(std::move(entries));
}

// Python's range() as the reference implements it.
Value RangeBuiltin(Interpreter& in, std::vector<Value>& args) {
  const auto number = [](const Value& v) -> std::optional<double> {
    if (v.IsNumber()) return v.number();
    if (v.is(Kind::kBool)) return v.boolean() ? 1 : 0;
    if (v.is(Kind::kUndefined)) return std::nullopt;
    Fail(absl::StrCat("range() arguments must be numbers, got ", v.TypeName()));
  };
  if (args.empty()) Fail("range expected at least 1 argument, got 0");
  std::optional<double> start = number(args[0]);
  std::optional<double> stop =
      args.size() > 1 ? number(args[1]) : std::optional<double>();
  std::optional<double> step_arg =
      args.size() > 2 ? number(args[2]) : std::optional<double>();
  if (!stop) {
    stop = start;
    start = 0;
  }
  if (!start) start = NAN;
  const double step = step_arg.value_or(1);
  if (step == 0) Fail("range() step must not be zero");
  std::vector<Value> out;
  const auto push = [&](double i) {
    if (out.size() >= in.limits().max_items) in.CheckItems(out.size() + 1);
    in.Charge(1);
    out.push_back(std::floor(i) == i ? Value::Int(i) : Value::Float(i));
  };
  if (step > 0) {
    for (double i = *start; i < *stop; i += step) push(i);
  } else {
    for (double i = *start; i > *stop; i += step) push(i);
  }
  return Value::Array(std::move(out));
}

// The reference's strftime: %Y %m %d %b %B %H %M %% in local time, English
// month names; other directives stay as written.
Value StrftimeNow(Interpreter& in, std::vector<Value>& args) {
  if (args.empty() || !args[0].is(Kind::kString)) {
    Fail("strftime_now() expects a format string");
  }
  std::tm tm{};
  if (in.local_time()) {
    tm = *in.local_time();
  } else {
    const std::time_t now = std::time(nullptr);
    localtime_r(&now, &tm);
  }
  static const char* const kMonths[] = {
      "January", "February", "March",     "April",   "May",      "June",
      "July",    "August",   "September", "October", "November", "December"};
  const int month = std::clamp(tm.tm_mon, 0, 11);
  const auto pad2 = [](int n) {
    return n < 10 ? absl::StrCat("0", n) : absl::StrCat(n);
  };
  const std::string& format = args[0].str();
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%' || i + 1 >= format.size()) {
      out.push_back(format[i]);
      continue;
    }
    const char d = format[i + 1];
    switch (d) {
      case 'Y':
        out += absl::StrCat(tm.tm_year + 1900);
        break;
      case 'm':
        out += pad2(month + 1);
        break;
      case 'd':
        out += pad2(tm.tm_mday);
        break;
      case 'b':
        out += std::string(kMonths[month]).substr(0, 3);
        break;
      case 'B':
        out += kMonths[month];
        break;
      case 'H':
        out += pad2(tm.tm_hour);
        break;
      case 'M':
        out += pad2(tm.tm_min);
        break;
      case '%':
        out += "%";
        break;
      default:
        out.push_back('%');
        continue;  // The next character is copied as it is.
    }
    ++i;
  }
  return in.NewString(std::move(out));
}

}  // namespace

std::shared_ptr<Scope> Interpreter::MakeGlobals() {
  auto global = std::make_shared<Scope>();
  global->Set("false", Value::Bool(false));
  global->Set("true", Value::Bool(true));
  global->Set("none", Value::Null());
  global->Set("False", Value::Bool(false));
  global->Set("True", Value::Bool(true));
  global->Set("None", Value::Null());
  global->Set("namespace",
              MakeFunction([](Interpreter& in, std::vector<Value>& args,
                              const std::shared_ptr<Scope>&) {
                return NamespaceBuiltin(in, args);
              }));
  global->Set("raise_exception",
              MakeFunction([](Interpreter&, std::vector<Value>& args,
                              const std::shared_ptr<Scope>&) -> Value {
                // new Error(arg): the message is the argument's string form.
                TemplateError e;
                e.raised = true;
                if (!args.empty() && !args[0].is(Kind::kUndefined)) {
                  e.message = JsString(args[0]);
                }
                throw e;
              }));
  global->Set("range",
              MakeFunction([](Interpreter& in, std::vector<Value>& args,
                              const std::shared_ptr<Scope>&) {
                return RangeBuiltin(in, args);
              }));
  global->Set("strftime_now",
              MakeFunction([](Interpreter& in, std::vector<Value>& args,
                              const std::shared_ptr<Scope>&) {
                return StrftimeNow(in, args);
              }));
  return global;
}

}  // namespace pdserve::chat_template::internal
