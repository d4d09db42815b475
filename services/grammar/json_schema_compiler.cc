#include "grammar/json_schema_compiler.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "grammar/regex_compiler.h"
#include "nlohmann/json.hpp"

namespace pdserve::grammar::internal {
namespace {

using Json = nlohmann::ordered_json;

// Keywords that only annotate: they never change which values validate.
bool IsAnnotation(const std::string& key) {
  static const std::set<std::string> kAnnotations = {
      "title",   "description", "$schema",    "$id",      "$comment",
      "default", "examples",    "deprecated", "readOnly", "writeOnly",
      "$defs",   "definitions", "strict"};
  return kAnnotations.contains(key);
}

std::string ChildPath(const std::string& path, std::string_view key) {
  return absl::StrCat(path, ".", std::string(key));
}

// String formats as regexes: each produces a subset of what ajv-formats
// ("full" mode) accepts — days valid in every year (no Feb 29), times with
// an explicit zone, lowercase UUIDs, dotted e-mail domains.
const std::string* FormatRegex(const std::string& format) {
  static const auto* kFormats = new std::map<std::string, std::string>{
      {"date",
       "[0-9]{4}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|"
       "(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)"},
      {"time",
       "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?"
       "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"},
      {"uuid", "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"},
      {"email",
       "[a-z0-9_+-]{1,20}(?:\\.[a-z0-9_+-]{1,20}){0,2}@"
       "(?:[a-z0-9](?:[a-z0-9-]{0,20}[a-z0-9])?\\.){1,3}[a-z]{2,10}"},
      {"ipv4",
       "(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}"
       "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"}};
  if (format == "date-time") {
    static const std::string kDateTime =
        kFormats->at("date") + "T" + kFormats->at("time");
    return &kDateTime;
  }
  auto it = kFormats->find(format);
  return it == kFormats->end() ? nullptr : &it->second;
}

bool ValueHasType(const Json& value, const std::string& type) {
  if (type == "string") return value.is_string();
  if (type == "integer") {
    if (value.is_number_integer()) return true;
    if (value.is_number_float()) {
      const double d = value.get<double>();
      return d == static_cast<double>(static_cast<int64_t>(d));
    }
    return false;
  }
  if (type == "number") return value.is_number();
  if (type == "boolean") return value.is_boolean();
  if (type == "null") return value.is_null();
  if (type == "object") return value.is_object();
  if (type == "array") return value.is_array();
  return false;
}

class JsonSchemaCompiler {
 public:
  JsonSchemaCompiler(const JsonGrammarOptions& options, GrammarBuilder* builder)
      : options_(options), b_(*builder) {
    ByteSet ws;
    for (char c : {' ', '\t', '\n', '\r'}) ws.set(static_cast<uint8_t>(c));
    ws_ = b_.Repeat(b_.Bytes(ws), 0, options_.max_whitespace);
  }

  absl::StatusOr<int32_t> CompileSchema(std::string_view text) {
    if (static_cast<int64_t>(text.size()) > options_.max_schema_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("JSON schema is ", text.size(), " bytes; the limit is ",
                       options_.max_schema_bytes));
    }
    // nlohmann's parser recurses; bound the nesting before anything walks it.
    int depth = 0, max_depth = 0;
    bool in_string = false, escaped = false;
    for (char c : text) {
      if (in_string) {
        if (escaped) {
          escaped = false;
        } else if (c == '\\') {
          escaped = true;
        } else if (c == '"') {
          in_string = false;
        }
        continue;
      }
      if (c == '"') in_string = true;
      if (c == '{' || c == '[') max_depth = std::max(max_depth, ++depth);
      if (c == '}' || c == ']') --depth;
    }
    if (max_depth > 4 * options_.max_schema_depth) {
      return absl::InvalidArgumentError(absl::StrCat(
          "JSON schema nests ", max_depth, " levels of JSON; the limit is ",
          4 * options_.max_schema_depth));
    }
    Json parsed = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) {
      return absl::InvalidArgumentError(
          "JSON schema is not valid JSON (it must be one JSON object)");
    }
    root_ = std::move(parsed);
    PDS_ASSIGN_OR_RETURN(Symbol value, Value(root_, "$", 0));
    return Finish(value);
  }

  absl::StatusOr<int32_t> CompileAnyObject() {
    return Finish(Symbol{true, AnyObject()});
  }

 private:
  absl::StatusOr<int32_t> Finish(Symbol value) {
    const int32_t root = b_.NewRule();
    b_.AddAlternative(root, {ws_, value, ws_});
    if (!b_.status().ok()) return b_.status();
    return root;
  }

  absl::Status Unsupported(const std::string& keyword, const std::string& path,
                           const std::string& why = "") {
    return absl::InvalidArgumentError(absl::StrCat(
        "JSON schema keyword '", keyword, "' at ", path, " is not supported",
        why.empty() ? "" : " (", why, why.empty() ? "" : ")"));
  }
  absl::Status Invalid(const std::string& path, const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("JSON schema at ", path, ": ", what));
  }

  // ---- fixed pieces --------------------------------------------------------

  Symbol Lit(std::string_view s) {
    Sequence seq;
    b_.AppendLiteral(s, &seq);
    return b_.Wrap(seq);
  }

  Symbol Char() {
    if (char_rule_ < 0) {
      CodePointSet all;
      all.Add(0, 0x10FFFF);
      char_rule_ = JsonStringCharacters(all, &b_).index;
    }
    return GrammarBuilder::Ref(char_rule_);
  }

  Symbol String(int64_t min_length, int64_t max_length) {
    if (min_length == 0 && max_length < 0) {
      if (string_rule_ < 0) {
        string_rule_ = b_.NewRule();
        b_.AddAlternative(string_rule_,
                          {Lit("\""), b_.Repeat(Char(), 0, -1), Lit("\"")});
      }
      return GrammarBuilder::Ref(string_rule_);
    }
    return b_.Wrap(
        {Lit("\""), b_.Repeat(Char(), min_length, max_length), Lit("\"")});
  }

  // Digits are bounded so that a model cannot loop on them: up to 16 integer
  // digits, 16 fraction digits and 2 exponent digits (so no value overflows a
  // double: |x| < 1e16 * 1e99).
  Symbol Integer() {
    if (integer_rule_ < 0) {
      integer_rule_ = b_.NewRule();
      Symbol digits = b_.Repeat(b_.ByteRange('0', '9'), 0, 15);
      Symbol magnitude = Symbol{
          true, b_.Choice({{b_.Byte('0')}, {b_.ByteRange('1', '9'), digits}})};
      b_.AddAlternative(integer_rule_,
                        {b_.Repeat(b_.Byte('-'), 0, 1), magnitude});
    }
    return GrammarBuilder::Ref(integer_rule_);
  }
  Symbol Number() {
    if (number_rule_ < 0) {
      number_rule_ = b_.NewRule();
      Symbol fraction =
          b_.Wrap({b_.Byte('.'), b_.Repeat(b_.ByteRange('0', '9'), 1, 16)});
      ByteSet e, sign;
      e.set('e'), e.set('E'), sign.set('+'), sign.set('-');
      Symbol exponent = b_.Wrap({b_.Bytes(e), b_.Repeat(b_.Bytes(sign), 0, 1),
                                 b_.Repeat(b_.ByteRange('0', '9'), 1, 2)});
      b_.AddAlternative(number_rule_, {Integer(), b_.Repeat(fraction, 0, 1),
                                       b_.Repeat(exponent, 0, 1)});
    }
    return GrammarBuilder::Ref(number_rule_);
  }

  int32_t AnyValue() {
    if (any_value_rule_ >= 0) return any_value_rule_;
    any_value_rule_ = b_.NewRule();
    const Symbol v = GrammarBuilder::Ref(any_value_rule_);
    // any object
    any_object_rule_ = b_.NewRule();
    const Symbol member = b_.Wrap({String(0, -1), ws_, Lit(":"), ws_, v});
    b_.AddAlternative(any_object_rule_, {Lit("{"), ws_, Lit("}")});
    b_.AddAlternative(any_object_rule_,
                      {Lit("{"), ws_, member,
                       b_.Repeat(b_.Wrap({ws_, Lit(","), ws_, member}), 0, -1),
                       ws_, Lit("}")});
    const int32_t array = b_.NewRule();
    b_.AddAlternative(array, {Lit("["), ws_, Lit("]")});
    b_.AddAlternative(
        array,
        {Lit("["), ws_, v, b_.Repeat(b_.Wrap({ws_, Lit(","), ws_, v}), 0, -1),
         ws_, Lit("]")});
    for (Symbol s :
         {GrammarBuilder::Ref(any_object_rule_), GrammarBuilder::Ref(array),
          String(0, -1), Number(), Lit("true"), Lit("false"), Lit("null")}) {
      b_.AddAlternative(any_value_rule_, {s});
    }
    return any_value_rule_;
  }
  int32_t AnyObject() {
    AnyValue();
    return any_object_rule_;
  }

  // ---- schemas -------------------------------------------------------------

  absl::StatusOr<Symbol> Value(const Json& schema, const std::string& path,
                               int depth) {
    if (depth > options_.max_schema_depth) {
      return Invalid(path, absl::StrCat("subschemas nest deeper than ",
                                        options_.max_schema_depth, " levels"));
    }
    if (++subschemas_ > options_.max_subschemas) {
      return Invalid(path, absl::StrCat("more than ", options_.max_subschemas,
                                        " subschemas"));
    }
    if (!b_.status().ok()) return b_.status();
    if (schema.is_boolean()) {
      if (schema.get<bool>()) return GrammarBuilder::Ref(AnyValue());
      return Invalid(path, "the schema false accepts no value");
    }
    if (!schema.is_object()) {
      return Invalid(path, "a schema must be a JSON object or a boolean");
    }
    if (schema.contains("$ref")) return Ref(schema, path, depth);
    ref_chain_.clear();  // content follows: a $ref cycle through here is fine

    for (const char* unsupported : {"oneOf",
                                    "not",
                                    "if",
                                    "then",
                                    "else",
                                    "dependentSchemas",
                                    "dependentRequired",
                                    "patternProperties",
                                    "propertyNames",
                                    "minProperties",
                                    "maxProperties",
                                    "unevaluatedProperties",
                                    "unevaluatedItems",
                                    "prefixItems",
                                    "contains",
                                    "minContains",
                                    "maxContains",
                                    "multipleOf",
                                    "contentEncoding",
                                    "contentMediaType",
                                    "$anchor",
                                    "$dynamicRef",
                                    "$dynamicAnchor",
                                    "$recursiveRef",
                                    "additionalItems",
                                    "dependencies"}) {
      if (schema.contains(unsupported)) return Unsupported(unsupported, path);
    }
    if (schema.contains("uniqueItems") &&
        !(schema["uniqueItems"].is_boolean() &&
          !schema["uniqueItems"].get<bool>())) {
      return Unsupported("uniqueItems", path, "only false is");
    }

    if (schema.contains("allOf")) {
      const Json& all = schema["allOf"];
      if (!all.is_array() || all.size() != 1 || schema.size() != 1) {
        return Unsupported("allOf", path,
                           "only an allOf of one schema with no sibling "
                           "keywords is");
      }
      return Value(all[0], ChildPath(path, "allOf[0]"), depth + 1);
    }
    if (schema.contains("anyOf")) return AnyOf(schema, path, depth);
    if (schema.contains("enum") || schema.contains("const")) {
      return Enum(schema, path);
    }

    std::vector<std::string> types;
    if (schema.contains("type")) {
      const Json& type = schema["type"];
      if (type.is_string()) {
        types.push_back(type.get<std::string>());
      } else if (type.is_array() && !type.empty()) {
        for (const Json& t : type) {
          if (!t.is_string()) {
            return Invalid(ChildPath(path, "type"),
                           "type names must be strings");
          }
          types.push_back(t.get<std::string>());
        }
      } else {
        return Invalid(ChildPath(path, "type"),
                       "type must be a string or a non-empty array");
      }
    } else {
      // Inferred from the keywords present; none: any JSON value.
      if (schema.contains("properties") || schema.contains("required") ||
          schema.contains("additionalProperties")) {
        types.push_back("object");
      }
      if (schema.contains("items") || schema.contains("minItems") ||
          schema.contains("maxItems")) {
        types.push_back("array");
      }
      if (schema.contains("pattern") || schema.contains("minLength") ||
          schema.contains("maxLength")) {
        types.push_back("string");
      }
      // Numeric bounds alone: integers in range (a subset of the numbers
      // they allow, so every output validates).
      if (schema.contains("minimum") || schema.contains("maximum") ||
          schema.contains("exclusiveMinimum") ||
          schema.contains("exclusiveMaximum")) {
        types.push_back("integer");
      }
    }
    // Every keyword left must belong to one of the types.
    static const std::map<std::string, std::string> kKeywordType = {
        {"properties", "object"},
        {"required", "object"},
        {"additionalProperties", "object"},
        {"items", "array"},
        {"minItems", "array"},
        {"maxItems", "array"},
        {"uniqueItems", "array"},
        {"pattern", "string"},
        {"minLength", "string"},
        {"maxLength", "string"},
        {"format", "string"},
        {"minimum", "integer"},
        {"maximum", "integer"},
        {"exclusiveMinimum", "integer"},
        {"exclusiveMaximum", "integer"},
        {"type", ""}};
    for (const auto& [key, unused] : schema.items()) {
      if (IsAnnotation(key)) continue;
      auto it = kKeywordType.find(key);
      if (it == kKeywordType.end()) return Unsupported(key, path);
      if (it->second == "integer" &&
          std::find(types.begin(), types.end(), "number") != types.end()) {
        return Unsupported(key, path, "only on type integer");
      }
      if (!it->second.empty() &&
          std::find(types.begin(), types.end(), it->second) == types.end()) {
        return Invalid(path, absl::StrCat("keyword '", key, "' needs type '",
                                          it->second, "'"));
      }
    }
    if (types.empty()) return GrammarBuilder::Ref(AnyValue());

    std::vector<Sequence> alternatives;
    for (const std::string& type : types) {
      PDS_ASSIGN_OR_RETURN(Symbol s, Typed(schema, type, path, depth));
      alternatives.push_back({s});
    }
    if (alternatives.size() == 1) return alternatives[0][0];
    return Symbol{true, b_.Choice(alternatives)};
  }

  absl::StatusOr<Symbol> Typed(const Json& schema, const std::string& type,
                               const std::string& path, int depth) {
    if (type == "object") return Object(schema, path, depth);
    if (type == "array") return Array(schema, path, depth);
    if (type == "string") return StringSchema(schema, path);
    if (type == "integer") return IntegerSchema(schema, path);
    if (type == "number") return Number();
    if (type == "boolean") {
      return Symbol{true, b_.Choice({{Lit("true")}, {Lit("false")}})};
    }
    if (type == "null") return Lit("null");
    return Invalid(ChildPath(path, "type"),
                   absl::StrCat("unknown type '", type, "'"));
  }

  // Integers within minimum/maximum (exclusive ones too), at most 16 digits
  // as every integer here.
  absl::StatusOr<Symbol> IntegerSchema(const Json& schema,
                                       const std::string& path) {
    constexpr double kLimit = 9999999999999999.0;  // 16 digits
    int64_t lo = -static_cast<int64_t>(kLimit),
            hi = static_cast<int64_t>(kLimit);
    bool bounded = false;
    for (const char* key :
         {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
      if (!schema.contains(key)) continue;
      const Json& v = schema[key];
      if (!v.is_number() || std::isnan(v.get<double>()) ||
          std::abs(v.get<double>()) > kLimit) {
        return Invalid(ChildPath(path, key),
                       "must be a number of at most 16 integer digits");
      }
      bounded = true;
      const double x = v.get<double>();
      const std::string k = key;
      if (k == "minimum") lo = std::max(lo, static_cast<int64_t>(std::ceil(x)));
      if (k == "exclusiveMinimum") {
        lo = std::max(lo, static_cast<int64_t>(std::floor(x)) + 1);
      }
      if (k == "maximum")
        hi = std::min(hi, static_cast<int64_t>(std::floor(x)));
      if (k == "exclusiveMaximum") {
        hi = std::min(hi, static_cast<int64_t>(std::ceil(x)) - 1);
      }
    }
    if (!bounded) return Integer();
    if (lo > hi) return Invalid(path, "no integer satisfies the bounds");
    std::vector<Sequence> alternatives;
    if (lo < 0) {  // "-" and magnitudes max(1, -hi) .. -lo
      std::vector<Sequence> magnitudes;
      DigitRanges(std::max<int64_t>(1, hi < 0 ? -hi : 1), -lo, &magnitudes);
      for (Sequence& m : magnitudes) {
        m.insert(m.begin(), b_.Byte('-'));
        alternatives.push_back(std::move(m));
      }
    }
    if (hi >= 0) DigitRanges(std::max<int64_t>(lo, 0), hi, &alternatives);
    return Symbol{true, b_.Choice(alternatives)};
  }

  // Decimal spellings (no leading zeros) of lo..hi, 0 <= lo <= hi, as
  // sequences of digit ranges.
  void DigitRanges(int64_t lo, int64_t hi, std::vector<Sequence>* out) {
    int64_t power = 1;  // 10^(digits - 1)
    for (int digits = 1; digits <= 16; ++digits, power *= 10) {
      const int64_t first = digits == 1 ? 0 : power;
      if (first > hi) break;
      const int64_t last = power * 10 - 1;
      const int64_t a = std::max(lo, first), z = std::min(hi, last);
      if (a > z) continue;
      SameLength(std::to_string(a), std::to_string(z), {}, out);
    }
  }
  // Strings of a's length between a and z (same length), after `prefix`.
  void SameLength(const std::string& a, const std::string& z, Sequence prefix,
                  std::vector<Sequence>* out) {
    if (a.empty()) {
      out->push_back(std::move(prefix));
      return;
    }
    if (a[0] == z[0]) {
      prefix.push_back(b_.Byte(a[0]));
      SameLength(a.substr(1), z.substr(1), std::move(prefix), out);
      return;
    }
    const size_t rest = a.size() - 1;
    const bool low_full = a.find_first_not_of('0', 1) == std::string::npos;
    const bool high_full = z.find_first_not_of('9', 1) == std::string::npos;
    if (!low_full) {
      Sequence p = prefix;
      p.push_back(b_.Byte(a[0]));
      SameLength(a.substr(1), std::string(rest, '9'), std::move(p), out);
    }
    const char from = low_full ? a[0] : a[0] + 1;
    const char to = high_full ? z[0] : z[0] - 1;
    if (from <= to) {
      Sequence p = prefix;
      p.push_back(b_.ByteRange(from, to));
      for (size_t k = 0; k < rest; ++k) p.push_back(b_.ByteRange('0', '9'));
      out->push_back(std::move(p));
    }
    if (!high_full) {
      Sequence p = prefix;
      p.push_back(b_.Byte(z[0]));
      SameLength(std::string(rest, '0'), z.substr(1), std::move(p), out);
    }
  }

  absl::StatusOr<int64_t> Count(const Json& schema, const char* key,
                                const std::string& path, int64_t fallback) {
    if (!schema.contains(key)) return fallback;
    const Json& v = schema[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) {
      return Invalid(ChildPath(path, key), "must be a non-negative integer");
    }
    return v.get<int64_t>();
  }

  absl::StatusOr<Symbol> StringSchema(const Json& schema,
                                      const std::string& path) {
    PDS_ASSIGN_OR_RETURN(int64_t min, Count(schema, "minLength", path, 0));
    PDS_ASSIGN_OR_RETURN(int64_t max, Count(schema, "maxLength", path, -1));
    if (max >= 0 && max < min) {
      return Invalid(path, "maxLength is smaller than minLength");
    }
    if (schema.contains("format")) {
      if (schema.contains("pattern") || schema.contains("minLength") ||
          schema.contains("maxLength")) {
        return Unsupported("format", path,
                           "not together with pattern/minLength/maxLength");
      }
      const Json& format = schema["format"];
      const std::string* regex =
          format.is_string() ? FormatRegex(format.get<std::string>()) : nullptr;
      if (regex == nullptr) {
        return Unsupported(
            "format", path,
            absl::StrCat("format ", format.dump(),
                         "; supported: date-time, date, time, uuid, email, "
                         "ipv4"));
      }
      RegexOptions regex_options;
      regex_options.json_string_contents = true;
      PDS_ASSIGN_OR_RETURN(Symbol body,
                           CompileRegex(*regex, regex_options, &b_));
      return b_.Wrap({Lit("\""), body, Lit("\"")});
    }
    if (schema.contains("pattern")) {
      if (schema.contains("minLength") || schema.contains("maxLength")) {
        return Unsupported("pattern", path,
                           "not together with minLength/maxLength");
      }
      const Json& pattern = schema["pattern"];
      if (!pattern.is_string()) {
        return Invalid(ChildPath(path, "pattern"), "must be a string");
      }
      RegexOptions regex_options;
      regex_options.json_string_contents = true;
      absl::StatusOr<Symbol> body =
          CompileRegex(pattern.get<std::string>(), regex_options, &b_);
      if (!body.ok()) {
        return Invalid(ChildPath(path, "pattern"),
                       std::string(body.status().message()));
      }
      return b_.Wrap({Lit("\""), *body, Lit("\"")});
    }
    return String(min, max);
  }

  absl::StatusOr<Symbol> Array(const Json& schema, const std::string& path,
                               int depth) {
    PDS_ASSIGN_OR_RETURN(int64_t min, Count(schema, "minItems", path, 0));
    PDS_ASSIGN_OR_RETURN(int64_t max, Count(schema, "maxItems", path, -1));
    if (max >= 0 && max < min) {
      return Invalid(path, "maxItems is smaller than minItems");
    }
    Symbol item = GrammarBuilder::Ref(AnyValue());
    if (schema.contains("items")) {
      PDS_ASSIGN_OR_RETURN(
          item, Value(schema["items"], ChildPath(path, "items"), depth + 1));
    }
    const int32_t rule = b_.NewRule();
    if (min == 0) b_.AddAlternative(rule, {Lit("["), ws_, Lit("]")});
    if (max != 0) {
      Symbol more =
          b_.Repeat(b_.Wrap({ws_, Lit(","), ws_, item}),
                    std::max<int64_t>(min - 1, 0), max < 0 ? -1 : max - 1);
      b_.AddAlternative(rule, {Lit("["), ws_, item, more, ws_, Lit("]")});
    }
    return GrammarBuilder::Ref(rule);
  }

  absl::StatusOr<Symbol> Object(const Json& schema, const std::string& path,
                                int depth) {
    const bool has_properties = schema.contains("properties");
    if (has_properties && !schema["properties"].is_object()) {
      return Invalid(ChildPath(path, "properties"), "must be an object");
    }
    std::set<std::string> required;
    if (schema.contains("required")) {
      const Json& r = schema["required"];
      if (!r.is_array()) {
        return Invalid(ChildPath(path, "required"), "must be an array");
      }
      for (const Json& name : r) {
        if (!name.is_string()) {
          return Invalid(ChildPath(path, "required"),
                         "must list property names (strings)");
        }
        if (!has_properties ||
            !schema["properties"].contains(name.get<std::string>())) {
          return Invalid(
              ChildPath(path, "required"),
              absl::StrCat("required property '", name.get<std::string>(),
                           "' is not in properties"));
        }
        required.insert(name.get<std::string>());
      }
    }
    bool additional_allowed = true;
    const Json* additional_schema = nullptr;
    if (schema.contains("additionalProperties")) {
      const Json& a = schema["additionalProperties"];
      if (a.is_boolean()) {
        additional_allowed = a.get<bool>();
      } else if (a.is_object()) {
        if (has_properties) {
          return Unsupported("additionalProperties", path,
                             "a schema is supported only without properties");
        }
        additional_schema = &a;
      } else {
        return Invalid(ChildPath(path, "additionalProperties"),
                       "must be a boolean or a schema");
      }
    }
    if (additional_schema != nullptr) {
      // A map: any keys, values of the schema.
      PDS_ASSIGN_OR_RETURN(
          Symbol value,
          Value(*additional_schema, ChildPath(path, "additionalProperties"),
                depth + 1));
      const Symbol member = b_.Wrap({String(0, -1), ws_, Lit(":"), ws_, value});
      const int32_t rule = b_.NewRule();
      b_.AddAlternative(rule, {Lit("{"), ws_, Lit("}")});
      b_.AddAlternative(
          rule, {Lit("{"), ws_, member,
                 b_.Repeat(b_.Wrap({ws_, Lit(","), ws_, member}), 0, -1), ws_,
                 Lit("}")});
      return GrammarBuilder::Ref(rule);
    }
    if (!has_properties && additional_allowed) {
      return GrammarBuilder::Ref(AnyObject());
    }
    // Declared properties, in declared order; extra ones are never produced
    // (valid whether or not additionalProperties allows them).
    struct Member {
      Symbol symbol;
      bool required;
    };
    std::vector<Member> members;
    if (has_properties) {
      const std::string properties_path = ChildPath(path, "properties");
      for (const auto& [name, property] : schema["properties"].items()) {
        PDS_ASSIGN_OR_RETURN(
            Symbol value,
            Value(property, ChildPath(properties_path, name), depth + 1));
        const std::string key = Json(name).dump();
        members.push_back({b_.Wrap({Lit(key), ws_, Lit(":"), ws_, value}),
                           required.contains(name)});
      }
    }
    // first[i]: members i.. when none was written yet; next[i]: after one.
    const size_t n = members.size();
    std::vector<int32_t> first(n + 1), next(n + 1);
    first[n] = b_.Choice({{}});
    next[n] = first[n];
    for (size_t i = n; i-- > 0;) {
      const Member& m = members[i];
      next[i] = b_.NewRule();
      b_.AddAlternative(next[i], {ws_, Lit(","), ws_, m.symbol,
                                  GrammarBuilder::Ref(next[i + 1])});
      if (!m.required) {
        b_.AddAlternative(next[i], {GrammarBuilder::Ref(next[i + 1])});
      }
      first[i] = b_.NewRule();
      b_.AddAlternative(first[i],
                        {ws_, m.symbol, GrammarBuilder::Ref(next[i + 1])});
      if (!m.required) {
        b_.AddAlternative(first[i], {GrammarBuilder::Ref(first[i + 1])});
      }
    }
    return b_.Wrap({Lit("{"), GrammarBuilder::Ref(first[0]), ws_, Lit("}")});
  }

  absl::StatusOr<Symbol> AnyOf(const Json& schema, const std::string& path,
                               int depth) {
    for (const auto& [key, unused] : schema.items()) {
      if (key != "anyOf" && !IsAnnotation(key)) {
        return Unsupported("anyOf", path,
                           absl::StrCat("not with the sibling keyword '", key,
                                        "'; move it into each branch"));
      }
    }
    const Json& branches = schema["anyOf"];
    if (!branches.is_array() || branches.empty()) {
      return Invalid(ChildPath(path, "anyOf"), "must be a non-empty array");
    }
    std::vector<Sequence> alternatives;
    for (size_t i = 0; i < branches.size(); ++i) {
      PDS_ASSIGN_OR_RETURN(
          Symbol s,
          Value(branches[i], absl::StrCat(path, ".anyOf[", i, "]"), depth + 1));
      alternatives.push_back({s});
    }
    return Symbol{true, b_.Choice(alternatives)};
  }

  absl::StatusOr<Symbol> Enum(const Json& schema, const std::string& path) {
    std::vector<std::string> types;
    for (const auto& [key, value] : schema.items()) {
      if (IsAnnotation(key) || key == "enum" || key == "const") continue;
      if (key == "type") {
        if (value.is_string()) {
          types.push_back(value.get<std::string>());
        } else if (value.is_array()) {
          for (const Json& t : value) {
            if (t.is_string()) types.push_back(t.get<std::string>());
          }
        }
        continue;
      }
      return Unsupported(key, path, "not together with enum/const");
    }
    std::vector<Json> values;
    if (schema.contains("const")) values.push_back(schema["const"]);
    if (schema.contains("enum")) {
      const Json& e = schema["enum"];
      if (!e.is_array() || e.empty()) {
        return Invalid(ChildPath(path, "enum"), "must be a non-empty array");
      }
      if (schema.contains("const")) {
        return Unsupported("enum", path, "not together with const");
      }
      for (const Json& v : e) values.push_back(v);
    }
    std::vector<Sequence> alternatives;
    for (const Json& v : values) {
      if (!types.empty() &&
          std::none_of(types.begin(), types.end(), [&](const std::string& t) {
            return ValueHasType(v, t);
          })) {
        continue;  // fails `type`: never valid
      }
      Sequence seq;
      b_.AppendLiteral(
          v.dump(-1, ' ', false, nlohmann::detail::error_handler_t::strict),
          &seq);
      alternatives.push_back(seq);
    }
    if (alternatives.empty()) {
      return Invalid(path, "no enum/const value has the schema's type");
    }
    return Symbol{true, b_.Choice(alternatives)};
  }

  absl::StatusOr<Symbol> Ref(const Json& schema, const std::string& path,
                             int depth) {
    for (const auto& [key, unused] : schema.items()) {
      if (key != "$ref" && !IsAnnotation(key)) {
        return Unsupported(
            "$ref", path,
            absl::StrCat("not with the sibling keyword '", key, "'"));
      }
    }
    const Json& ref = schema["$ref"];
    if (!ref.is_string()) {
      return Invalid(ChildPath(path, "$ref"), "must be a string");
    }
    const std::string pointer = ref.get<std::string>();
    if (pointer.empty() || pointer[0] != '#') {
      return Unsupported("$ref", path,
                         absl::StrCat("only references inside the schema "
                                      "('#/$defs/…') are, not '",
                                      pointer, "'"));
    }
    auto it = ref_rules_.find(pointer);
    if (it != ref_rules_.end()) {
      if (std::find(ref_chain_.begin(), ref_chain_.end(), pointer) !=
          ref_chain_.end()) {
        return Invalid(ChildPath(path, "$ref"),
                       absl::StrCat("'", pointer,
                                    "' refers to itself without any content "
                                    "in between"));
      }
      return GrammarBuilder::Ref(it->second);
    }
    const Json* target = &root_;
    if (pointer.size() > 1) {
      if (pointer[1] != '/') {
        return Unsupported("$ref", path,
                           absl::StrCat("anchors ('", pointer, "') are not"));
      }
      const std::vector<std::string> parts =
          absl::StrSplit(pointer.substr(2), '/', absl::AllowEmpty());
      for (const std::string& escaped : parts) {
        // JSON pointer escapes: ~1 is '/', ~0 is '~'.
        std::string part;
        for (size_t k = 0; k < escaped.size(); ++k) {
          if (escaped[k] == '~' && k + 1 < escaped.size() &&
              (escaped[k + 1] == '0' || escaped[k + 1] == '1')) {
            part.push_back(escaped[k + 1] == '0' ? '~' : '/');
            ++k;
          } else {
            part.push_back(escaped[k]);
          }
        }
        if (target->is_object() && target->contains(part)) {
          target = &(*target)[part];
        } else if (target->is_array() && !part.empty() &&
                   std::all_of(part.begin(), part.end(), ::isdigit) &&
                   part.size() < 9 && std::stoul(part) < target->size()) {
          target = &(*target)[std::stoul(part)];
        } else {
          return Invalid(ChildPath(path, "$ref"),
                         absl::StrCat("'", pointer, "' points nowhere"));
        }
      }
    }
    const int32_t rule = b_.NewRule();
    ref_rules_[pointer] = rule;
    ref_chain_.push_back(pointer);
    absl::StatusOr<Symbol> body = Value(*target, pointer, depth + 1);
    if (!body.ok()) return body.status();
    b_.AddAlternative(rule, {*body});
    return GrammarBuilder::Ref(rule);
  }

  const JsonGrammarOptions& options_;
  GrammarBuilder& b_;
  Json root_;
  Symbol ws_;
  int32_t char_rule_ = -1;
  int32_t string_rule_ = -1;
  int32_t integer_rule_ = -1;
  int32_t number_rule_ = -1;
  int32_t any_value_rule_ = -1;
  int32_t any_object_rule_ = -1;
  int subschemas_ = 0;
  absl::flat_hash_map<std::string, int32_t> ref_rules_;
  // $refs followed since the last schema with content of its own.
  std::vector<std::string> ref_chain_;
};

}  // namespace

absl::StatusOr<int32_t> CompileJsonSchema(std::string_view schema,
                                          const JsonGrammarOptions& options,
                                          GrammarBuilder* builder) {
  JsonSchemaCompiler compiler(options, builder);
  return compiler.CompileSchema(schema);
}

absl::StatusOr<int32_t> CompileAnyJsonObject(const JsonGrammarOptions& options,
                                             GrammarBuilder* builder) {
  JsonSchemaCompiler compiler(options, builder);
  return compiler.CompileAnyObject();
}

}  // namespace pdserve::grammar::internal
