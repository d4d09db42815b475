#include "chat_template/value.h"

#include <unicode/ucol.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "chat_template/unicode.h"

namespace pdserve::chat_template::internal {

void Fail(std::string message) {
  throw TemplateError{absl::StatusCode::kInvalidArgument, std::move(message)};
}

void Exhausted(std::string message) {
  throw TemplateError{absl::StatusCode::kResourceExhausted, std::move(message)};
}

// ---- Non-recursive release ----

namespace {
thread_local std::vector<std::shared_ptr<void>> release_queue;
thread_local bool draining = false;
}  // namespace

void DeferRelease(std::shared_ptr<void>&& p) {
  if (!p) return;
  if (p.use_count() > 1) {
    // Not the last owner: dropping it destroys nothing.
    p.reset();
    return;
  }
  release_queue.push_back(std::move(p));
  if (draining) return;
  draining = true;
  while (!release_queue.empty()) {
    std::shared_ptr<void> last = std::move(release_queue.back());
    release_queue.pop_back();
    last.reset();  // May push this object's children; the loop takes them.
  }
  draining = false;
}

ArrayData::~ArrayData() {
  for (Value& v : items) {
    if (auto heap = v.heap()) {
      v = Value();
      DeferRelease(std::move(heap));
    }
  }
}

ObjectData::~ObjectData() {
  for (auto& [key, v] : entries) {
    if (auto heap = v.heap()) {
      v = Value();
      DeferRelease(std::move(heap));
    }
  }
}

FunctionData::~FunctionData() { DeferRelease(std::move(captured)); }

// ---- Value ----

Value Value::String(std::string s) {
  return Shared(Kind::kString, std::make_shared<std::string>(std::move(s)));
}

Value Value::Array(std::vector<Value> items) {
  auto data = std::make_shared<ArrayData>();
  data->items = std::move(items);
  return Shared(Kind::kArray, std::move(data));
}

Value Value::Object(std::shared_ptr<ObjectData> object) {
  return Shared(Kind::kObject, std::move(object));
}

Value Value::Namespace(std::shared_ptr<ObjectData> object) {
  return Shared(Kind::kNamespace, std::move(object));
}

Value Value::Function(std::shared_ptr<FunctionData> fn) {
  return Shared(Kind::kFunction, std::move(fn));
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNull:
      return false;
    case Kind::kBool:
      return b_;
    case Kind::kInt:
    case Kind::kFloat:
      return num_ != 0 && !std::isnan(num_);
    case Kind::kString:
      return !str().empty();
    case Kind::kArray:
      return !array().items.empty();
    case Kind::kObject:
      return !object().entries.empty();
    case Kind::kNamespace:  // A Map object: always truthy in the reference.
    case Kind::kFunction:
      return true;
  }
  return false;
}

const char* Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "UndefinedValue";
    case Kind::kNull:
      return "NullValue";
    case Kind::kBool:
      return "BooleanValue";
    case Kind::kInt:
      return "IntegerValue";
    case Kind::kFloat:
      return "FloatValue";
    case Kind::kString:
      return "StringValue";
    case Kind::kArray:
      return array().tuple ? "TupleValue" : "ArrayValue";
    case Kind::kObject:
      return object().kwargs ? "KeywordArgumentsValue" : "ObjectValue";
    case Kind::kNamespace:
      return "NamespaceValue";
    case Kind::kFunction:
      return "FunctionValue";
  }
  return "?";
}

// ---- ObjectData ----

namespace {
constexpr size_t kLinearScanLimit = 16;
}  // namespace

const Value* ObjectData::Find(std::string_view key) const {
  if (entries.size() <= kLinearScanLimit || index_.size() != entries.size()) {
    for (const auto& [k, v] : entries) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  auto it = index_.find(absl::string_view(key.data(), key.size()));
  return it == index_.end() ? nullptr : &entries[it->second].second;
}

void ObjectData::Set(std::string key, Value value) {
  if (Value* existing = const_cast<Value*>(Find(key))) {
    *existing = std::move(value);
    return;
  }
  entries.emplace_back(std::move(key), std::move(value));
  if (entries.size() == kLinearScanLimit + 1) {
    for (size_t i = 0; i < entries.size(); ++i) index_[entries[i].first] = i;
  } else if (entries.size() > kLinearScanLimit + 1) {
    index_[entries.back().first] = entries.size() - 1;
  }
}

void ObjectData::Erase(std::string_view key) {
  auto it = std::find_if(entries.begin(), entries.end(),
                         [&](const auto& e) { return e.first == key; });
  if (it == entries.end()) return;
  entries.erase(it);
  index_.clear();
  if (entries.size() > kLinearScanLimit) {
    for (size_t i = 0; i < entries.size(); ++i) index_[entries[i].first] = i;
  }
}

// ---- Numbers ----

std::string JsNumber(double n) {
  if (std::isnan(n)) return "NaN";
  if (std::isinf(n)) return n > 0 ? "Infinity" : "-Infinity";
  if (n == 0) return "0";
  if (n < 0) return "-" + JsNumber(-n);
  char buf[64];
  auto res =
      std::to_chars(buf, buf + sizeof(buf), n, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));
  const size_t e_pos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e_pos)) {
    if (c != '.') digits.push_back(c);
  }
  const int exp10 = std::atoi(std::string(sci.substr(e_pos + 1)).c_str());
  const int k = static_cast<int>(digits.size());
  const int point = exp10 + 1;  // ECMAScript's n.
  if (k <= point && point <= 21) return digits + std::string(point - k, '0');
  if (0 < point && point <= 21) {
    return digits.substr(0, point) + "." + digits.substr(point);
  }
  if (-6 < point && point <= 0) {
    return "0." + std::string(-point, '0') + digits;
  }
  const int e = point - 1;
  std::string out(1, digits[0]);
  if (k > 1) absl::StrAppend(&out, ".", digits.substr(1));
  absl::StrAppend(&out, "e", e >= 0 ? "+" : "-", std::abs(e));
  return out;
}

namespace {

// Number.prototype.toFixed(1) for an integral value.
std::string ToFixed1(double n) {
  if (std::fabs(n) >= 1e21) return JsNumber(n);
  char buf[400];
  std::snprintf(buf, sizeof(buf), "%.1f", n);
  return buf;
}

}  // namespace

std::string JsString(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "undefined";
    case Kind::kNull:
      return "null";
    case Kind::kBool:
      return v.boolean() ? "true" : "false";
    case Kind::kInt:
    case Kind::kFloat:
      return JsNumber(v.number());
    case Kind::kString:
      return v.str();
    case Kind::kArray: {
      std::string out;
      bool first = true;
      for (const Value& item : v.array().items) {
        if (!first) out.push_back(',');
        first = false;
        out += DisplayString(item);
      }
      return out;
    }
    case Kind::kObject:
    case Kind::kNamespace:
      return "[object Map]";
    case Kind::kFunction:
      return "function";
  }
  return "";
}

std::string DisplayString(const Value& v) {
  switch (v.kind()) {
    case Kind::kFloat: {
      const double n = v.number();
      if (n == 0 && std::signbit(n)) return "-0.0";
      if (std::isfinite(n) && std::floor(n) == n) return ToFixed1(n);
      return JsNumber(n);
    }
    case Kind::kArray:
    case Kind::kObject:
    case Kind::kNamespace:
      return ToJson(v, JsonOptions{}, /*undefined_to_null=*/false, 512,
                    size_t{1} << 30);
    default:
      return JsString(v);
  }
}

std::string JoinString(const Value& v) {
  if (v.is(Kind::kUndefined) || v.is(Kind::kNull)) return "";
  return JsString(v);
}

// ---- JSON ----

void AppendJsonQuoted(std::string_view s, bool ensure_ascii, std::string& out) {
  static constexpr char kHex[] = "0123456789abcdef";
  auto append_u = [&](uint32_t unit) {
    out += "\\u";
    out.push_back(kHex[(unit >> 12) & 0xF]);
    out.push_back(kHex[(unit >> 8) & 0xF]);
    out.push_back(kHex[(unit >> 4) & 0xF]);
    out.push_back(kHex[unit & 0xF]);
  };
  out.push_back('"');
  size_t pos = 0;
  while (pos < s.size()) {
    const auto c = static_cast<unsigned char>(s[pos]);
    if (c < 0x80) {
      ++pos;
      switch (c) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\b':
          out += "\\b";
          break;
        case '\f':
          out += "\\f";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\r':
          out += "\\r";
          break;
        case '\t':
          out += "\\t";
          break;
        default:
          if (c < 0x20 || (ensure_ascii && c == 0x7F)) {
            append_u(c);
          } else {
            out.push_back(static_cast<char>(c));
          }
      }
      continue;
    }
    const uint32_t cp = DecodeUtf8(s, pos);
    if (cp >= 0xD800 && cp < 0xE000) {
      append_u(cp);  // Lone surrogate: JSON.stringify escapes it.
    } else if (ensure_ascii) {
      if (cp >= 0x10000) {
        append_u(0xD800 + ((cp - 0x10000) >> 10));
        append_u(0xDC00 + ((cp - 0x10000) & 0x3FF));
      } else {
        append_u(cp);
      }
    } else {
      AppendUtf8(cp, out);
    }
  }
  out.push_back('"');
}

namespace {

// String.prototype.localeCompare (ICU root collation, as Node uses).
int LocaleCompare(const std::string& a, const std::string& b) {
  UErrorCode status = U_ZERO_ERROR;
  UCollator* coll = ucol_open("", &status);
  if (U_FAILURE(status) || coll == nullptr) return a.compare(b);
  const UCollationResult r =
      ucol_strcollUTF8(coll, a.data(), static_cast<int32_t>(a.size()), b.data(),
                       static_cast<int32_t>(b.size()), &status);
  ucol_close(coll);
  if (U_FAILURE(status)) return a.compare(b);
  return r == UCOL_LESS ? -1 : r == UCOL_GREATER ? 1 : 0;
}

struct JsonWriter {
  const JsonOptions& options;
  bool undefined_to_null;
  int max_depth;
  size_t max_bytes;
  std::string item_sep;
  std::string key_sep;
  std::string indent_unit;
  std::string out;

  void Check() {
    if (out.size() > max_bytes) {
      Exhausted(absl::StrCat("tojson output exceeds ", max_bytes, " bytes"));
    }
  }

  std::string Padding(int depth) {
    std::string pad = "\n";
    for (int i = 0; i < depth; ++i) pad += indent_unit;
    return pad;
  }

  void Write(const Value& v, int depth) {
    if (depth > max_depth) {
      Fail(absl::StrCat("cannot convert to JSON: nested deeper than ",
                        max_depth, " levels"));
    }
    switch (v.kind()) {
      case Kind::kNull:
        out += "null";
        return;
      case Kind::kUndefined:
        out += undefined_to_null ? "null" : "undefined";
        return;
      case Kind::kBool:
        out += v.boolean() ? "true" : "false";
        return;
      case Kind::kInt:
      case Kind::kFloat:
        out += std::isfinite(v.number()) ? JsNumber(v.number()) : "null";
        return;
      case Kind::kString:
        AppendJsonQuoted(v.str(), options.ensure_ascii, out);
        Check();
        return;
      case Kind::kArray: {
        if (v.array().tuple) Fail("Cannot convert to JSON: TupleValue");
        const auto& items = v.array().items;
        const bool pretty = !indent_unit.empty() && !items.empty();
        const std::string base = pretty ? Padding(depth) : "";
        const std::string child = pretty ? base + indent_unit : "";
        out.push_back('[');
        for (size_t i = 0; i < items.size(); ++i) {
          if (i > 0) out += item_sep;
          out += child;
          Write(items[i], depth + 1);
          Check();
        }
        out += base;
        out.push_back(']');
        return;
      }
      case Kind::kObject:
      case Kind::kNamespace: {
        std::vector<const std::pair<std::string, Value>*> entries;
        for (const auto& e : v.object().entries) entries.push_back(&e);
        if (options.sort_keys) {
          std::stable_sort(entries.begin(), entries.end(),
                           [](const auto* a, const auto* b) {
                             return LocaleCompare(a->first, b->first) < 0;
                           });
        }
        const bool pretty = !indent_unit.empty() && !entries.empty();
        const std::string base = pretty ? Padding(depth) : "";
        const std::string child = pretty ? base + indent_unit : "";
        out.push_back('{');
        for (size_t i = 0; i < entries.size(); ++i) {
          if (i > 0) out += item_sep;
          out += child;
          AppendJsonQuoted(entries[i]->first, options.ensure_ascii, out);
          out += key_sep;
          Write(entries[i]->second, depth + 1);
          Check();
        }
        out += base;
        out.push_back('}');
        return;
      }
      case Kind::kFunction:
        Fail("Cannot convert to JSON: FunctionValue");
    }
  }
};

}  // namespace

std::string ToJson(const Value& v, const JsonOptions& options,
                   bool undefined_to_null, int max_depth, size_t max_bytes) {
  JsonWriter w{options, undefined_to_null, max_depth, max_bytes, "", "", "",
               ""};
  const double indent = options.indent.value_or(0);
  if (options.separators) {
    w.item_sep = options.separators->first;
    w.key_sep = options.separators->second;
  } else if (indent != 0) {
    w.item_sep = ",";
    w.key_sep = ": ";
  } else {
    w.item_sep = ", ";
    w.key_sep = ": ";
  }
  if (indent != 0) {
    if (indent < 0) Fail("Invalid count value: " + JsNumber(indent));
    if (indent > 1024) Exhausted("tojson indent larger than 1024");
    w.indent_unit.assign(static_cast<size_t>(indent), ' ');
  }
  w.Write(v, 0);
  return std::move(w.out);
}

// ---- Equality ----

namespace {

// StringToNumber (ECMAScript), enough for comparisons with strings.
double JsStringToNumber(std::string_view s) {
  s = Trim(s);
  if (s.empty()) return 0;
  if (s.size() > 2 && s[0] == '0' &&
      (s[1] == 'x' || s[1] == 'X' || s[1] == 'o' || s[1] == 'O' ||
       s[1] == 'b' || s[1] == 'B')) {
    const int base = (s[1] == 'x' || s[1] == 'X')   ? 16
                     : (s[1] == 'o' || s[1] == 'O') ? 8
                                                    : 2;
    double n = 0;
    for (char c : s.substr(2)) {
      int d = -1;
      if (c >= '0' && c <= '9') d = c - '0';
      if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
      if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
      if (d < 0 || d >= base) return NAN;
      n = n * base + d;
    }
    return n;
  }
  std::string_view body = s;
  bool negative = false;
  if (body[0] == '+' || body[0] == '-') {
    negative = body[0] == '-';
    body.remove_prefix(1);
  }
  if (body == "Infinity") return negative ? -INFINITY : INFINITY;
  // Only decimal literals from here: digits, '.', exponent.
  size_t i = 0;
  bool digits = false;
  while (i < body.size() && body[i] >= '0' && body[i] <= '9')
    ++i, digits = true;
  if (i < body.size() && body[i] == '.') {
    ++i;
    while (i < body.size() && body[i] >= '0' && body[i] <= '9') {
      ++i, digits = true;
    }
  }
  if (!digits) return NAN;
  if (i < body.size() && (body[i] == 'e' || body[i] == 'E')) {
    ++i;
    if (i < body.size() && (body[i] == '+' || body[i] == '-')) ++i;
    const size_t start = i;
    while (i < body.size() && body[i] >= '0' && body[i] <= '9') ++i;
    if (i == start) return NAN;
  }
  if (i != body.size()) return NAN;
  return std::strtod(std::string(s).c_str(), nullptr);
}

enum class JsType { kUndefined, kNull, kBoolean, kNumber, kString, kObject };

JsType TypeOf(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return JsType::kUndefined;
    case Kind::kNull:
      return JsType::kNull;
    case Kind::kBool:
      return JsType::kBoolean;
    case Kind::kInt:
    case Kind::kFloat:
      return JsType::kNumber;
    case Kind::kString:
      return JsType::kString;
    default:
      return JsType::kObject;
  }
}

}  // namespace

bool StrictEquals(const Value& a, const Value& b) {
  const JsType ta = TypeOf(a);
  if (ta != TypeOf(b)) return false;
  switch (ta) {
    case JsType::kUndefined:
    case JsType::kNull:
      return true;
    case JsType::kBoolean:
      return a.boolean() == b.boolean();
    case JsType::kNumber:
      return a.number() == b.number();
    case JsType::kString:
      return a.str() == b.str();
    case JsType::kObject:
      return a.identity() == b.identity();
  }
  return false;
}

bool LooseEquals(const Value& a, const Value& b) {
  const JsType ta = TypeOf(a);
  const JsType tb = TypeOf(b);
  if (ta == tb) return StrictEquals(a, b);
  const auto nullish = [](JsType t) {
    return t == JsType::kUndefined || t == JsType::kNull;
  };
  if (nullish(ta) || nullish(tb)) return nullish(ta) && nullish(tb);
  if (ta == JsType::kBoolean) {
    return LooseEquals(Value::Int(a.boolean() ? 1 : 0), b);
  }
  if (tb == JsType::kBoolean) {
    return LooseEquals(a, Value::Int(b.boolean() ? 1 : 0));
  }
  if (ta == JsType::kNumber && tb == JsType::kString) {
    return a.number() == JsStringToNumber(b.str());
  }
  if (ta == JsType::kString && tb == JsType::kNumber) {
    return JsStringToNumber(a.str()) == b.number();
  }
  // An object against a primitive compares its string form.
  if (ta == JsType::kObject) return LooseEquals(Value::String(JsString(a)), b);
  if (tb == JsType::kObject) return LooseEquals(a, Value::String(JsString(b)));
  return false;
}

}  // namespace pdserve::chat_template::internal
