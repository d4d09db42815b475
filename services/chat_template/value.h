// Runtime values of the template interpreter, modelled on @huggingface/jinja's
// runtime values so that conversions, truthiness, equality and JSON output
// come out byte for byte the same.
//
// Numbers are doubles, as in JavaScript: an "integer" is a double with an
// integral value created as an integer (literal, JSON integer, arithmetic on
// integers), so it prints as `1` where a float prints as `1.0`.
//
// Containers are reference types (shared), as in JavaScript: `==` on two lists
// compares identity. Destroying a container never recurses: its children go
// to a per-thread release queue (see DeferRelease), so no input, however
// deeply nested, can overflow the stack on destruction.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

namespace pdserve::chat_template::internal {

// Errors inside the library are thrown as TemplateError and turned into an
// absl::Status at the API edge (ChatTemplate::Parse / Render). The
// interpreter is a direct port of the reference's control flow, which throws.
struct TemplateError {
  absl::StatusCode code = absl::StatusCode::kInvalidArgument;
  std::string message;
  // Raised by the template itself (raise_exception): the message is the
  // template's text, verbatim.
  bool raised = false;
};
[[noreturn]] void Fail(std::string message);
[[noreturn]] void Exhausted(std::string message);

// Releases `p` without recursion (see the file comment).
void DeferRelease(std::shared_ptr<void>&& p);

enum class Kind : uint8_t {
  kUndefined,
  kNull,
  kBool,
  kInt,
  kFloat,
  kString,
  kArray,
  kObject,
  kNamespace,
  kFunction,
};

struct ArrayData;
struct ObjectData;
struct FunctionData;

class Value {
 public:
  Value() = default;
  static Value Undefined() { return Value(); }
  static Value Null() { return Value(Kind::kNull); }
  static Value Bool(bool b) {
    Value v(Kind::kBool);
    v.b_ = b;
    return v;
  }
  static Value Int(double n) {
    Value v(Kind::kInt);
    v.num_ = n;
    return v;
  }
  static Value Float(double n) {
    Value v(Kind::kFloat);
    v.num_ = n;
    return v;
  }
  static Value String(std::string s);
  static Value Shared(Kind kind, std::shared_ptr<void> heap) {
    Value v(kind);
    v.heap_ = std::move(heap);
    return v;
  }
  static Value Array(std::vector<Value> items);
  static Value Object(std::shared_ptr<ObjectData> object);
  static Value Namespace(std::shared_ptr<ObjectData> object);
  static Value Function(std::shared_ptr<FunctionData> fn);

  Kind kind() const { return kind_; }
  bool is(Kind k) const { return kind_ == k; }
  bool IsNumber() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat; }
  // ObjectValue in the reference (dicts, loop, keyword arguments).
  bool IsObject() const { return kind_ == Kind::kObject; }
  // Objects and namespaces: what attribute access reads entries from.
  bool IsAttributeContainer() const {
    return kind_ == Kind::kObject || kind_ == Kind::kNamespace;
  }
  bool boolean() const { return b_; }
  double number() const { return num_; }
  const std::string& str() const {
    return *static_cast<const std::string*>(heap_.get());
  }
  ArrayData& array() const { return *static_cast<ArrayData*>(heap_.get()); }
  ObjectData& object() const { return *static_cast<ObjectData*>(heap_.get()); }
  FunctionData& function() const {
    return *static_cast<FunctionData*>(heap_.get());
  }
  const void* identity() const { return heap_.get(); }
  std::shared_ptr<void> heap() const { return heap_; }

  // The reference's __bool__.
  bool Truthy() const;
  // The reference's type names ("StringValue", ...), for error messages.
  const char* TypeName() const;

 private:
  explicit Value(Kind k) : kind_(k) {}
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;
  double num_ = 0;
  std::shared_ptr<void> heap_;
};

struct ArrayData {
  std::vector<Value> items;
  // A tuple literal's value (the reference's TupleValue): usable as a list,
  // but neither printable nor "iterable" there.
  bool tuple = false;
  ~ArrayData();
};

// Insertion-ordered string-keyed map (JavaScript Map semantics: setting an
// existing key keeps its position).
struct ObjectData {
  std::vector<std::pair<std::string, Value>> entries;
  // Keyword arguments of a call travel as a trailing object with this set.
  bool kwargs = false;

  const Value* Find(std::string_view key) const;
  void Set(std::string key, Value value);
  void Erase(std::string_view key);
  ~ObjectData();

 private:
  // Built once a map outgrows a linear scan.
  absl::flat_hash_map<std::string, size_t> index_;
};

class Interpreter;
struct Scope;
using NativeFn = std::function<Value(Interpreter&, std::vector<Value>& args,
                                     const std::shared_ptr<Scope>& call_site)>;

struct FunctionData {
  NativeFn fn;
  // What the function keeps alive (a macro's defining scope).
  std::shared_ptr<void> captured;
  ~FunctionData();
};

// ---- Conversions that must match JavaScript / the reference exactly ----

// Number.prototype.toString().
std::string JsNumber(double n);
// The value's JavaScript `value.toString()` (used by `~`, `+` on strings).
std::string JsString(const Value& v);
// RuntimeValue.toString(): how `{{ v }}` prints.
std::string DisplayString(const Value& v);
// Array.prototype.join on the raw values (join filter).
std::string JoinString(const Value& v);

struct JsonOptions {
  std::optional<double> indent;
  bool ensure_ascii = false;
  std::optional<std::pair<std::string, std::string>> separators;
  bool sort_keys = false;
};
// The reference's toJSON; throws on functions and on nesting deeper than
// `max_depth` (a namespace can contain itself).
std::string ToJson(const Value& v, const JsonOptions& options,
                   bool undefined_to_null, int max_depth, size_t max_bytes);
// JSON.stringify(string).
void AppendJsonQuoted(std::string_view s, bool ensure_ascii, std::string& out);

// `left.value == right.value` (JavaScript loose equality).
bool LooseEquals(const Value& a, const Value& b);
// `left.value === right.value`.
bool StrictEquals(const Value& a, const Value& b);

}  // namespace pdserve::chat_template::internal
