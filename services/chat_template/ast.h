// The syntax tree, one node type for every construct of the reference's
// ast.ts. Nodes are immutable after parsing; a parsed template is shared by
// every render, from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pdserve::chat_template::internal {

enum class NodeType : uint8_t {
  // Statements
  kText,   // Literal template text (`str`).
  kIf,     // a: test, body, alternate.
  kFor,    // a: loop variable (Identifier/Tuple), b: iterable, body, alternate.
  kSet,    // a: assignee, b: value (null for a block set), body.
  kMacro,  // str: name, args: parameters, body.
  kCallBlock,    // a: the call (kCall), args: caller parameters, body.
  kFilterBlock,  // a: filter (Identifier or kCall), body.
  kBreak,
  kContinue,
  kComment,
  // Expressions
  kIdentifier,     // str
  kInteger,        // number
  kFloat,          // number
  kString,         // str
  kArrayLiteral,   // args
  kTupleLiteral,   // args
  kObjectLiteral,  // args: key, value, key, value, ...
  kBinary,         // str: operator, a, b
  kUnary,          // str: operator, a
  kMember,         // a: object, b: property, computed
  kSlice,          // a: start, b: stop, c: step (each may be null)
  kCall,           // a: callee, args
  kKeywordArg,     // str: name, a: value
  kSpread,         // a  (*x)
  kKeywordSpread,  // a  (**x)
  kFilter,         // a: operand, b: filter (Identifier or kCall)
  kTest,           // a: operand, str: test name, negate, args (extension)
  kSelect,         // a: value, b: condition  (`x if c` without else)
  kTernary,        // a: condition, b: if true, c: if false
};

struct Node {
  NodeType type;
  uint32_t offset = 0;  // In the original source, for error positions.
  std::string str;
  double number = 0;
  bool flag = false;  // kMember: computed; kTest: negate; kCallBlock: has
                      // caller parameters.
  std::unique_ptr<Node> a, b, c;
  std::vector<std::unique_ptr<Node>> args;
  std::vector<std::unique_ptr<Node>> body;
  std::vector<std::unique_ptr<Node>> alternate;
  // kMacro / kCallBlock: the body reads `caller`, `kwargs` or `varargs`.
  bool uses_caller = false, uses_kwargs = false, uses_varargs = false;
};

using NodePtr = std::unique_ptr<Node>;

struct Program {
  std::vector<NodePtr> body;
};

}  // namespace pdserve::chat_template::internal
