#include "chat_template/parser.h"

#include <cstdlib>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "chat_template/value.h"

namespace pdserve::chat_template::internal {
namespace {

class Parser {
 public:
  Parser(const std::vector<Token>& tokens, std::string_view source,
         std::string_view origin)
      : tokens_(tokens), source_(source), origin_(origin) {}

  Program Run() {
    Program program;
    while (current_ < tokens_.size()) program.body.push_back(ParseAny());
    return program;
  }

 private:
  // ---- helpers ----
  class DepthGuard {
   public:
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxParseDepth) {
        p_.Error(
            absl::StrCat("nesting deeper than ", kMaxParseDepth, " levels"));
      }
    }
    ~DepthGuard() { --p_.depth_; }

   private:
    Parser& p_;
  };

  // Left-folded chains (a + b + c, a.b.c, x|f|g) nest one level per step.
  class ChainDepth {
   public:
    explicit ChainDepth(Parser& p) : p_(p) {}
    void Step() {
      ++steps_;
      if (++p_.depth_ > kMaxParseDepth) {
        p_.Error(
            absl::StrCat("nesting deeper than ", kMaxParseDepth, " levels"));
      }
    }
    ~ChainDepth() { p_.depth_ -= steps_; }

   private:
    Parser& p_;
    int steps_ = 0;
  };

  [[noreturn]] void Error(const std::string& what) const {
    const uint32_t offset = current_ < tokens_.size()
                                ? tokens_[current_].offset
                                : static_cast<uint32_t>(source_.size());
    const Position pos = PositionOf(source_, offset);
    Fail(absl::StrCat(std::string(origin_), ":", pos.line, ":", pos.column,
                      ": syntax error: ", what));
  }

  const Token& Peek() const {
    if (current_ >= tokens_.size()) Error("unexpected end of template");
    return tokens_[current_];
  }
  const Token& Next() {
    const Token& t = Peek();
    ++current_;
    return t;
  }

  const Token& Expect(TokenType type, const std::string& what) {
    if (current_ >= tokens_.size()) {
      Error(absl::StrCat(what, ", got the end of the template"));
    }
    const Token& t = tokens_[current_];
    if (t.type != type) {
      Error(absl::StrCat(what, ", got ", TokenTypeName(t.type), " '", t.value,
                         "'"));
    }
    ++current_;
    return t;
  }

  void ExpectIdentifier(const char* name) {
    if (!IsIdentifier(name)) Error(absl::StrCat("expected '", name, "'"));
    ++current_;
  }

  bool Is(TokenType type) const {
    return current_ < tokens_.size() && tokens_[current_].type == type;
  }
  bool Is(TokenType a, TokenType b) const {
    return current_ + 1 < tokens_.size() && tokens_[current_].type == a &&
           tokens_[current_ + 1].type == b;
  }
  bool IsIdentifier(std::string_view name, size_t ahead = 0) const {
    return current_ + ahead < tokens_.size() &&
           tokens_[current_ + ahead].type == TokenType::kIdentifier &&
           tokens_[current_ + ahead].value == name;
  }
  template <typename... Names>
  bool IsStatement(Names... names) const {
    if (current_ + 1 >= tokens_.size() ||
        tokens_[current_].type != TokenType::kOpenStatement ||
        tokens_[current_ + 1].type != TokenType::kIdentifier) {
      return false;
    }
    const std::string& v = tokens_[current_ + 1].value;
    return ((v == names) || ...);
  }
  // The loops that collect a block body until its end tag: running out of
  // tokens names the missing tag.
  template <typename... Names>
  void ParseBodyUntil(std::vector<NodePtr>& body, const char* end_tag,
                      Names... names) {
    while (!IsStatement(names...)) {
      if (current_ >= tokens_.size()) {
        Error(absl::StrCat("missing {% ", end_tag, " %}"));
      }
      body.push_back(ParseAny());
    }
  }

  NodePtr Make(NodeType type, uint32_t offset) {
    auto n = std::make_unique<Node>();
    n->type = type;
    n->offset = offset;
    return n;
  }
  uint32_t Offset() const {
    return current_ < tokens_.size() ? tokens_[current_].offset
                                     : static_cast<uint32_t>(source_.size());
  }

  // ---- statements ----
  NodePtr ParseAny() {
    DepthGuard guard(*this);
    const Token& t = Peek();
    switch (t.type) {
      case TokenType::kComment: {
        ++current_;
        auto n = Make(NodeType::kComment, t.offset);
        return n;
      }
      case TokenType::kText: {
        ++current_;
        auto n = Make(NodeType::kText, t.offset);
        n->str = t.value;
        return n;
      }
      case TokenType::kOpenStatement:
        return ParseStatement();
      case TokenType::kOpenExpression: {
        ++current_;
        NodePtr e = ParseExpression();
        Expect(TokenType::kCloseExpression, "expected '}}'");
        return e;
      }
      default:
        Error(absl::StrCat("unexpected ", TokenTypeName(t.type), " '", t.value,
                           "'"));
    }
  }

  NodePtr ParseStatement() {
    Expect(TokenType::kOpenStatement, "expected '{%'");
    const Token& name_token = Peek();
    if (name_token.type != TokenType::kIdentifier) {
      Error(absl::StrCat("expected a statement name, got ",
                         TokenTypeName(name_token.type)));
    }
    const std::string& name = name_token.value;
    const uint32_t offset = name_token.offset;
    NodePtr result;
    if (name == "set") {
      ++current_;
      result = ParseSet(offset);
    } else if (name == "if") {
      ++current_;
      result = ParseIf(offset);
      CloseBlock("endif");
    } else if (name == "macro") {
      ++current_;
      result = ParseMacro(offset);
      CloseBlock("endmacro");
    } else if (name == "for") {
      ++current_;
      result = ParseFor(offset);
      CloseBlock("endfor");
    } else if (name == "call") {
      ++current_;
      result = Make(NodeType::kCallBlock, offset);
      if (Is(TokenType::kOpenParen)) {
        result->flag = true;
        ParseArgs(result->args, /*parameters=*/true);
      }
      NodePtr callee = ParsePrimary();
      if (callee->type != NodeType::kIdentifier) {
        Error("expected an identifier after 'call'");
      }
      auto call = Make(NodeType::kCall, callee->offset);
      call->a = std::move(callee);
      ParseArgs(call->args, /*parameters=*/false);
      result->a = std::move(call);
      Expect(TokenType::kCloseStatement, "expected '%}'");
      ParseBodyUntil(result->body, "endcall", "endcall");
      CloseBlock("endcall");
      NoteSpecialArguments(*result);
    } else if (name == "break" || name == "continue") {
      ++current_;
      Expect(TokenType::kCloseStatement, "expected '%}'");
      result = Make(name == "break" ? NodeType::kBreak : NodeType::kContinue,
                    offset);
    } else if (name == "filter") {
      ++current_;
      result = Make(NodeType::kFilterBlock, offset);
      NodePtr filter = ParsePrimary();
      if (filter->type == NodeType::kIdentifier && Is(TokenType::kOpenParen)) {
        filter = ParseCall(std::move(filter));
      }
      result->a = std::move(filter);
      Expect(TokenType::kCloseStatement, "expected '%}'");
      ParseBodyUntil(result->body, "endfilter", "endfilter");
      CloseBlock("endfilter");
    } else {
      Error(absl::StrCat("unknown statement '", name, "'"));
    }
    return result;
  }

  void CloseBlock(const char* end_name) {
    if (current_ >= tokens_.size()) {
      Error(absl::StrCat("missing {% ", end_name, " %}"));
    }
    Expect(TokenType::kOpenStatement,
           absl::StrCat("expected {% ", end_name, " %}"));
    ExpectIdentifier(end_name);
    Expect(TokenType::kCloseStatement, "expected '%}'");
  }

  NodePtr ParseSet(uint32_t offset) {
    auto n = Make(NodeType::kSet, offset);
    n->a = ParseExpressionSequence(false);
    if (Is(TokenType::kEquals)) {
      ++current_;
      n->b = ParseExpressionSequence(false);
    } else {
      Expect(TokenType::kCloseStatement, "expected '=' or '%}' after set");
      ParseBodyUntil(n->body, "endset", "endset");
      Expect(TokenType::kOpenStatement, "expected {% endset %}");
      ExpectIdentifier("endset");
    }
    Expect(TokenType::kCloseStatement, "expected '%}'");
    return n;
  }

  NodePtr ParseIf(uint32_t offset) {
    DepthGuard guard(*this);
    auto n = Make(NodeType::kIf, offset);
    n->a = ParseExpression();
    Expect(TokenType::kCloseStatement, "expected '%}'");
    ParseBodyUntil(n->body, "endif", "elif", "else", "endif");
    if (IsStatement("elif")) {
      const uint32_t elif_offset = tokens_[current_ + 1].offset;
      current_ += 2;
      n->alternate.push_back(ParseIf(elif_offset));
    } else if (IsStatement("else")) {
      current_ += 2;
      Expect(TokenType::kCloseStatement, "expected '%}'");
      ParseBodyUntil(n->alternate, "endif", "endif");
    }
    return n;
  }

  NodePtr ParseMacro(uint32_t offset) {
    auto n = Make(NodeType::kMacro, offset);
    NodePtr name = ParsePrimary();
    if (name->type != NodeType::kIdentifier) {
      Error("expected an identifier after 'macro'");
    }
    n->str = name->str;
    ParseArgs(n->args, /*parameters=*/true);
    Expect(TokenType::kCloseStatement, "expected '%}'");
    ParseBodyUntil(n->body, "endmacro", "endmacro");
    NoteSpecialArguments(*n);
    return n;
  }

  NodePtr ParseFor(uint32_t offset) {
    auto n = Make(NodeType::kFor, offset);
    n->a = ParseExpressionSequence(true);
    if (n->a->type != NodeType::kIdentifier &&
        n->a->type != NodeType::kTupleLiteral) {
      Error("expected an identifier or tuple for the loop variable");
    }
    if (!IsIdentifier("in")) Error("expected 'in' after the loop variable");
    ++current_;
    n->b = ParseExpression();
    Expect(TokenType::kCloseStatement, "expected '%}'");
    ParseBodyUntil(n->body, "endfor", "endfor", "else");
    if (IsStatement("else")) {
      current_ += 2;
      Expect(TokenType::kCloseStatement, "expected '%}'");
      ParseBodyUntil(n->alternate, "endfor", "endfor");
    }
    return n;
  }

  // Marks which of caller/kwargs/varargs a macro body reads (the reference
  // binds them only then).
  void NoteSpecialArguments(Node& macro) {
    std::set<std::string> params;
    for (const auto& p : macro.args) {
      params.insert(p->type == NodeType::kKeywordArg ? p->str : p->str);
    }
    struct Walker {
      Node& macro;
      const std::set<std::string>& params;
      void Visit(const Node* n) {
        if (n == nullptr) return;
        if (n->type == NodeType::kIdentifier && !params.count(n->str)) {
          if (n->str == "caller") macro.uses_caller = true;
          if (n->str == "kwargs") macro.uses_kwargs = true;
          if (n->str == "varargs") macro.uses_varargs = true;
        }
        Visit(n->a.get());
        Visit(n->b.get());
        Visit(n->c.get());
        for (const auto& x : n->args) Visit(x.get());
        for (const auto& x : n->body) Visit(x.get());
        for (const auto& x : n->alternate) Visit(x.get());
      }
    } walker{macro, params};
    for (const auto& x : macro.body) walker.Visit(x.get());
  }

  // ---- expressions ----
  NodePtr ParseExpressionSequence(bool primary) {
    const uint32_t offset = Offset();
    std::vector<NodePtr> items;
    items.push_back(primary ? ParsePrimary() : ParseExpression());
    const bool is_tuple = Is(TokenType::kComma);
    while (is_tuple) {
      ++current_;
      items.push_back(primary ? ParsePrimary() : ParseExpression());
      if (!Is(TokenType::kComma)) break;
    }
    if (!is_tuple) return std::move(items[0]);
    auto n = Make(NodeType::kTupleLiteral, offset);
    n->args = std::move(items);
    return n;
  }

  NodePtr ParseExpression() {
    DepthGuard guard(*this);
    return ParseIfExpression();
  }

  NodePtr ParseIfExpression() {
    NodePtr a = ParseOr();
    if (IsIdentifier("if")) {
      const uint32_t offset = Next().offset;
      NodePtr test = ParseOr();
      if (IsIdentifier("else")) {
        ++current_;
        DepthGuard guard(*this);
        auto n = Make(NodeType::kTernary, offset);
        n->a = std::move(test);
        n->b = std::move(a);
        n->c = ParseIfExpression();
        return n;
      }
      auto n = Make(NodeType::kSelect, offset);
      n->a = std::move(a);
      n->b = std::move(test);
      return n;
    }
    return a;
  }

  NodePtr Binary(const Token& op, NodePtr left, NodePtr right) {
    auto n = Make(NodeType::kBinary, op.offset);
    n->str = op.value;
    n->a = std::move(left);
    n->b = std::move(right);
    return n;
  }

  NodePtr ParseOr() {
    NodePtr left = ParseAnd();
    ChainDepth chain(*this);
    while (IsIdentifier("or")) {
      chain.Step();
      const Token& op = Next();
      left = Binary(op, std::move(left), ParseAnd());
    }
    return left;
  }

  NodePtr ParseAnd() {
    NodePtr left = ParseNot();
    ChainDepth chain(*this);
    while (IsIdentifier("and")) {
      chain.Step();
      const Token& op = Next();
      left = Binary(op, std::move(left), ParseNot());
    }
    return left;
  }

  NodePtr ParseNot() {
    NodePtr right;
    while (IsIdentifier("not")) {
      DepthGuard guard(*this);
      const Token& op = Next();
      auto n = Make(NodeType::kUnary, op.offset);
      n->str = "not";
      n->a = ParseNot();
      right = std::move(n);
    }
    return right ? std::move(right) : ParseComparison();
  }

  NodePtr ParseComparison() {
    NodePtr left = ParseAdditive();
    ChainDepth chain(*this);
    while (true) {
      chain.Step();
      Token op;
      if (IsIdentifier("not") && IsIdentifier("in", 1)) {
        op = Token{TokenType::kIdentifier, "not in", tokens_[current_].offset};
        current_ += 2;
      } else if (IsIdentifier("in")) {
        op = Next();
      } else if (Is(TokenType::kComparisonBinaryOperator)) {
        op = Next();
      } else {
        break;
      }
      left = Binary(op, std::move(left), ParseAdditive());
    }
    return left;
  }

  NodePtr ParseAdditive() {
    NodePtr left = ParseMultiplicative();
    ChainDepth chain(*this);
    while (Is(TokenType::kAdditiveBinaryOperator)) {
      chain.Step();
      const Token& op = Next();
      left = Binary(op, std::move(left), ParseMultiplicative());
    }
    return left;
  }

  NodePtr ParseMultiplicative() {
    NodePtr left = ParsePower();
    ChainDepth chain(*this);
    while (Is(TokenType::kMultiplicativeBinaryOperator)) {
      chain.Step();
      const Token& op = Next();
      left = Binary(op, std::move(left), ParsePower());
    }
    return left;
  }

  NodePtr ParsePower() {
    NodePtr left = ParseTest();
    ChainDepth chain(*this);
    while (Is(TokenType::kExponentiationBinaryOperator)) {
      chain.Step();
      const Token& op = Next();
      left = Binary(op, std::move(left), ParseTest());
    }
    return left;
  }

  NodePtr ParseTest() {
    NodePtr operand = ParseFilter();
    ChainDepth chain(*this);
    while (IsIdentifier("is")) {
      chain.Step();
      const uint32_t offset = Next().offset;
      const bool negate = IsIdentifier("not");
      if (negate) ++current_;
      NodePtr test = ParsePrimary();
      if (test->type != NodeType::kIdentifier) {
        Error("expected an identifier for the test");
      }
      auto n = Make(NodeType::kTest, offset);
      n->a = std::move(operand);
      n->str = test->str;
      n->flag = negate;
      // Extension: Jinja2's tests with arguments, `x is divisibleby(3)`.
      if (Is(TokenType::kOpenParen)) ParseArgs(n->args, false);
      operand = std::move(n);
    }
    return operand;
  }

  NodePtr ParseFilter() {
    NodePtr operand = ParseUnarySign();
    ChainDepth chain(*this);
    while (Is(TokenType::kPipe)) {
      chain.Step();
      const uint32_t offset = Next().offset;
      NodePtr filter = ParsePrimary();
      if (filter->type != NodeType::kIdentifier) {
        Error("expected an identifier for the filter");
      }
      if (Is(TokenType::kOpenParen)) filter = ParseCall(std::move(filter));
      auto n = Make(NodeType::kFilter, offset);
      n->a = std::move(operand);
      n->b = std::move(filter);
      operand = std::move(n);
    }
    return operand;
  }

  NodePtr ParseUnarySign() {
    if (current_ < tokens_.size()) {
      const Token& t = tokens_[current_];
      if ((t.type == TokenType::kUnaryOperator ||
           t.type == TokenType::kAdditiveBinaryOperator) &&
          (t.value == "-" || t.value == "+")) {
        DepthGuard guard(*this);
        ++current_;
        auto n = Make(NodeType::kUnary, t.offset);
        n->str = t.value;
        n->a = ParseUnarySign();
        return n;
      }
    }
    return ParseCallMember();
  }

  NodePtr ParseCallMember() {
    NodePtr member = ParseMember(ParsePrimary());
    if (Is(TokenType::kOpenParen)) return ParseCall(std::move(member));
    return member;
  }

  NodePtr ParseCall(NodePtr callee) {
    // Iterative form of the reference's recursion for `f()()()`.
    ChainDepth chain(*this);
    while (true) {
      chain.Step();
      auto n = Make(NodeType::kCall, callee->offset);
      n->a = std::move(callee);
      ParseArgs(n->args, false);
      callee = ParseMember(std::move(n));
      if (!Is(TokenType::kOpenParen)) return callee;
    }
  }

  void ParseArgs(std::vector<NodePtr>& args, bool parameters) {
    Expect(TokenType::kOpenParen, "expected '('");
    std::set<std::string> names;
    bool saw_keyword = false;
    bool saw_spread = false;
    while (!Is(TokenType::kCloseParen)) {
      if (current_ >= tokens_.size()) Error("expected ')'");
      const bool kw_spread = Is(TokenType::kExponentiationBinaryOperator);
      const bool spread = Is(TokenType::kMultiplicativeBinaryOperator) &&
                          tokens_[current_].value == "*";
      if (parameters && (kw_spread || spread)) {
        Error("argument unpacking is not allowed in parameter declarations");
      }
      if (kw_spread) {
        auto n = Make(NodeType::kKeywordSpread, Next().offset);
        n->a = ParseExpression();
        args.push_back(std::move(n));
        if (Is(TokenType::kComma)) ++current_;
        if (!Is(TokenType::kCloseParen)) {
          Error("'**' must be applied to the final argument");
        }
        break;
      }
      NodePtr argument;
      if (spread) {
        if (saw_spread) Error("only one '*' argument unpacking is allowed");
        saw_spread = true;
        auto n = Make(NodeType::kSpread, Next().offset);
        n->a = ParseExpression();
        argument = std::move(n);
      } else {
        argument = ParseExpression();
        if (Is(TokenType::kEquals)) {
          ++current_;
          if (argument->type != NodeType::kIdentifier) {
            Error(parameters ? "expected an identifier for a parameter"
                             : "expected an identifier for a keyword argument");
          }
          auto n = Make(NodeType::kKeywordArg, argument->offset);
          n->str = argument->str;
          n->a = ParseExpression();
          argument = std::move(n);
        }
        if (parameters) {
          if (argument->type != NodeType::kIdentifier &&
              argument->type != NodeType::kKeywordArg) {
            Error("expected an identifier for a parameter");
          }
          if (!names.insert(argument->str).second) {
            Error(absl::StrCat("duplicate parameter name: ", argument->str));
          }
        }
        if (argument->type == NodeType::kKeywordArg) {
          saw_keyword = true;
        } else if (saw_keyword) {
          Error(
              parameters
                  ? "non-default argument follows default argument"
                  : "positional arguments must come before keyword arguments");
        } else if (saw_spread) {
          Error("positional arguments must not follow '*' argument unpacking");
        }
      }
      args.push_back(std::move(argument));
      if (Is(TokenType::kComma)) ++current_;
    }
    Expect(TokenType::kCloseParen, "expected ')'");
  }

  NodePtr ParseSubscript() {
    // [x], [a:b], [a:b:c], [:b], ...
    std::vector<NodePtr> slices;
    bool is_slice = false;
    const uint32_t offset = Offset();
    while (!Is(TokenType::kCloseSquareBracket)) {
      if (current_ >= tokens_.size()) Error("expected ']'");
      if (Is(TokenType::kColon)) {
        slices.push_back(nullptr);
        ++current_;
        is_slice = true;
      } else {
        slices.push_back(ParseExpression());
        if (Is(TokenType::kColon)) {
          ++current_;
          is_slice = true;
        }
      }
    }
    if (slices.empty()) Error("expected an index or slice inside '[]'");
    if (is_slice) {
      if (slices.size() > 3) Error("a slice takes at most 3 parts");
      auto n = Make(NodeType::kSlice, offset);
      n->a = std::move(slices[0]);
      if (slices.size() > 1) n->b = std::move(slices[1]);
      if (slices.size() > 2) n->c = std::move(slices[2]);
      return n;
    }
    return std::move(slices[0]);
  }

  NodePtr ParseMember(NodePtr object) {
    ChainDepth chain(*this);
    while (Is(TokenType::kDot) || Is(TokenType::kOpenSquareBracket)) {
      chain.Step();
      const Token& op = Next();
      auto n = Make(NodeType::kMember, op.offset);
      n->flag = op.type == TokenType::kOpenSquareBracket;
      if (n->flag) {
        n->b = ParseSubscript();
        Expect(TokenType::kCloseSquareBracket, "expected ']'");
      } else {
        n->b = ParsePrimary();
        if (n->b->type != NodeType::kIdentifier &&
            n->b->type != NodeType::kInteger) {
          Error("expected an identifier or integer after '.'");
        }
      }
      n->a = std::move(object);
      object = std::move(n);
    }
    return object;
  }

  NodePtr ParsePrimary() {
    DepthGuard guard(*this);
    if (current_ >= tokens_.size()) Error("unexpected end of template");
    const Token& t = tokens_[current_++];
    switch (t.type) {
      case TokenType::kNumericLiteral: {
        const bool is_float = t.value.find('.') != std::string::npos;
        auto n =
            Make(is_float ? NodeType::kFloat : NodeType::kInteger, t.offset);
        n->number = std::strtod(t.value.c_str(), nullptr);
        return n;
      }
      case TokenType::kStringLiteral: {
        auto n = Make(NodeType::kString, t.offset);
        n->str = t.value;
        while (Is(TokenType::kStringLiteral)) n->str += Next().value;
        return n;
      }
      case TokenType::kIdentifier: {
        auto n = Make(NodeType::kIdentifier, t.offset);
        n->str = t.value;
        return n;
      }
      case TokenType::kOpenParen: {
        NodePtr e = ParseExpressionSequence(false);
        Expect(TokenType::kCloseParen, "expected ')'");
        return e;
      }
      case TokenType::kOpenSquareBracket: {
        auto n = Make(NodeType::kArrayLiteral, t.offset);
        while (!Is(TokenType::kCloseSquareBracket)) {
          if (current_ >= tokens_.size()) Error("expected ']'");
          n->args.push_back(ParseExpression());
          if (Is(TokenType::kComma)) ++current_;
        }
        ++current_;
        return n;
      }
      case TokenType::kOpenCurlyBracket: {
        auto n = Make(NodeType::kObjectLiteral, t.offset);
        while (!Is(TokenType::kCloseCurlyBracket)) {
          if (current_ >= tokens_.size()) Error("expected '}'");
          n->args.push_back(ParseExpression());
          Expect(TokenType::kColon, "expected ':' in a dict literal");
          n->args.push_back(ParseExpression());
          if (Is(TokenType::kComma)) ++current_;
        }
        ++current_;
        return n;
      }
      default:
        --current_;
        Error(absl::StrCat("unexpected ", TokenTypeName(t.type), " '", t.value,
                           "'"));
    }
  }

  const std::vector<Token>& tokens_;
  std::string_view source_;
  std::string_view origin_;
  size_t current_ = 0;
  int depth_ = 0;
};

}  // namespace

Program Parse(const std::vector<Token>& tokens, std::string_view source,
              std::string_view origin) {
  return Parser(tokens, source, origin).Run();
}

}  // namespace pdserve::chat_template::internal
