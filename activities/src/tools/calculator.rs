//! The `calculator` tool: evaluates an arithmetic expression with a small recursive-descent
//! parser, and reports syntax and arithmetic errors to the model with their position.

use crate::context::ActivityContext;
use crate::error::Result;
use crate::tool::{Tool, ToolCall, ToolOutput};
use async_trait::async_trait;
use cairn_ledger::{JsonText, ToolSpec};
use serde::Deserialize;

/// The tool's name.
const NAME: &str = "calculator";

/// Parentheses, unary signs and chained powers (`2^2^2`, which is `2^(2^2)`) may nest this
/// deep; deeper input is refused rather than allowed to exhaust the stack.
const MAX_DEPTH: usize = 200;

/// Integral results up to this magnitude print without a fraction; past it f64 skips integers.
const MAX_EXACT_INTEGER: f64 = 9_007_199_254_740_992.0; // 2^53

/// Evaluates arithmetic: `+ - * / %`, `^` (power, right-associative, binding tighter than unary
/// minus, so `-2^2` is `-4`), parentheses, unary minus and plus, decimals and exponents
/// (`1.5e3`).
///
/// Input `{"expression": "..."}`; output JSON `{"expression": "<as given>", "value": <number>}`.
/// Syntax errors, division by zero and non-finite results are `is_error` outputs that name the
/// position (1-based character offset), so the model can correct itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct Calculator;

impl Calculator {
    /// The calculator.
    pub fn new() -> Self {
        Calculator
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CalculatorInput {
    expression: String,
}

#[async_trait]
impl Tool for Calculator {
    fn spec(&self) -> ToolSpec {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "An arithmetic expression, e.g. \"(17 + 25) * 3\" or \"2^10 / 1.5e3\"."
                }
            },
            "required": ["expression"],
            "additionalProperties": false
        });
        ToolSpec {
            name: NAME.to_owned(),
            description: "Evaluates an arithmetic expression exactly as a calculator would: \
                          + - * / % and ^ (power), parentheses, unary minus, decimals and \
                          exponents such as 1.5e3."
                .to_owned(),
            input_schema: JsonText::from_value(&schema),
        }
    }

    async fn call(&self, call: &ToolCall, _context: &ActivityContext) -> Result<ToolOutput> {
        let input: CalculatorInput = call.parse_arguments()?;
        Ok(match evaluate(&input.expression) {
            Ok(value) => {
                let result = serde_json::json!({
                    "expression": input.expression,
                    "value": number_json(value),
                });
                ToolOutput::json(JsonText::from_value(&result))
            }
            Err(e) => ToolOutput::error(format!(
                "cannot evaluate {:?}: {} at position {}",
                input.expression, e.message, e.position
            )),
        })
    }
}

/// A finite number as JSON: integral values within ±2^53 without a fraction.
fn number_json(value: f64) -> serde_json::Value {
    if value.fract() == 0.0 && value.abs() <= MAX_EXACT_INTEGER {
        // Exact: the value is an integer of at most 53 bits.
        serde_json::Value::from(value as i64)
    } else {
        serde_json::Number::from_f64(value).map_or(serde_json::Value::Null, Into::into)
    }
}

/// Why an expression cannot be evaluated, at a 1-based character position.
#[derive(Debug, Clone, PartialEq)]
struct CalcError {
    position: usize,
    message: String,
}

type Calc<T> = std::result::Result<T, CalcError>;

/// Evaluates an expression to a finite number.
fn evaluate(expression: &str) -> Calc<f64> {
    let mut parser = Parser {
        chars: expression.chars().collect(),
        index: 0,
        depth: 0,
    };
    parser.skip_whitespace();
    if parser.peek().is_none() {
        return Err(parser.error_here("the expression is empty"));
    }
    let value = parser.expression()?;
    parser.skip_whitespace();
    match parser.peek() {
        None => Ok(value),
        Some(')') => Err(parser.error_here("unmatched ')'")),
        Some(c) => Err(parser.error_here(format!("expected an operator, found {c:?}"))),
    }
}

/// Recursive descent over the grammar
///
/// ```text
/// expression := term (('+' | '-') term)*
/// term       := unary (('*' | '/' | '%') unary)*
/// unary      := ('-' | '+') unary | power
/// power      := primary ('^' unary)?
/// primary    := number | '(' expression ')'
/// ```
///
/// `power` recursing into `unary` makes `^` right-associative and lets `2^-1` parse.
struct Parser {
    chars: Vec<char>,
    index: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.index).copied()
    }

    fn skip_whitespace(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.index += 1;
        }
    }

    fn error_at(index: usize, message: impl Into<String>) -> CalcError {
        CalcError {
            position: index + 1,
            message: message.into(),
        }
    }

    fn error_here(&self, message: impl Into<String>) -> CalcError {
        Self::error_at(self.index, message)
    }

    fn descend(&mut self) -> Calc<()> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.error_here(format!(
                "the expression nests deeper than {MAX_DEPTH} levels"
            )));
        }
        Ok(())
    }

    fn expression(&mut self) -> Calc<f64> {
        let mut value = self.term()?;
        loop {
            self.skip_whitespace();
            let op_index = self.index;
            let op = match self.peek() {
                Some(op @ ('+' | '-')) => op,
                _ => return Ok(value),
            };
            self.index += 1;
            let rhs = self.term()?;
            value = if op == '+' { value + rhs } else { value - rhs };
            finite(value, op_index, op)?;
        }
    }

    fn term(&mut self) -> Calc<f64> {
        let mut value = self.unary()?;
        loop {
            self.skip_whitespace();
            let op_index = self.index;
            let op = match self.peek() {
                Some(op @ ('*' | '/' | '%')) => op,
                _ => return Ok(value),
            };
            self.index += 1;
            let rhs = self.unary()?;
            value = match op {
                '*' => value * rhs,
                '/' if rhs == 0.0 => return Err(Self::error_at(op_index, "division by zero")),
                '/' => value / rhs,
                _ if rhs == 0.0 => return Err(Self::error_at(op_index, "modulo by zero")),
                _ => value % rhs,
            };
            finite(value, op_index, op)?;
        }
    }

    fn unary(&mut self) -> Calc<f64> {
        self.skip_whitespace();
        match self.peek() {
            Some(sign @ ('-' | '+')) => {
                self.descend()?;
                self.index += 1;
                let value = self.unary()?;
                self.depth -= 1;
                Ok(if sign == '-' { -value } else { value })
            }
            _ => self.power(),
        }
    }

    fn power(&mut self) -> Calc<f64> {
        let base = self.primary()?;
        self.skip_whitespace();
        if self.peek() != Some('^') {
            return Ok(base);
        }
        let op_index = self.index;
        // `^` is right-associative, so a chain of them recurses as deep as it is long.
        self.descend()?;
        self.index += 1;
        let exponent = self.unary()?;
        self.depth -= 1;
        finite(base.powf(exponent), op_index, '^')
    }

    fn primary(&mut self) -> Calc<f64> {
        self.skip_whitespace();
        match self.peek() {
            None => Err(self.error_here("expected a number or '(', but the expression ended")),
            Some('(') => {
                let open_index = self.index;
                self.descend()?;
                self.index += 1;
                let value = self.expression()?;
                self.skip_whitespace();
                match self.peek() {
                    Some(')') => {
                        self.index += 1;
                        self.depth -= 1;
                        Ok(value)
                    }
                    None => Err(Self::error_at(open_index, "unmatched '('")),
                    Some(c) => Err(self.error_here(format!(
                        "expected ')' to close the '(' at position {}, found {c:?}",
                        open_index + 1
                    ))),
                }
            }
            Some(c) if c.is_ascii_digit() || c == '.' => self.number(),
            Some(c) => Err(self.error_here(format!("expected a number or '(', found {c:?}"))),
        }
    }

    /// `digits ['.' digits] [('e' | 'E') ['+' | '-'] digits]`, or `'.' digits ...`.
    fn number(&mut self) -> Calc<f64> {
        let start = self.index;
        let mut mantissa_digits = self.digits();
        if self.peek() == Some('.') {
            self.index += 1;
            mantissa_digits += self.digits();
        }
        if mantissa_digits == 0 {
            return Err(Self::error_at(start, "a number needs at least one digit"));
        }
        if matches!(self.peek(), Some('e' | 'E')) {
            let exponent_index = self.index;
            self.index += 1;
            if matches!(self.peek(), Some('+' | '-')) {
                self.index += 1;
            }
            if self.digits() == 0 {
                return Err(Self::error_at(
                    exponent_index,
                    "an exponent needs digits after 'e'",
                ));
            }
        }
        let text: String = self.chars[start..self.index].iter().collect();
        let value: f64 = text
            .parse()
            .map_err(|_| Self::error_at(start, format!("{text:?} is not a number")))?;
        if !value.is_finite() {
            return Err(Self::error_at(start, format!("{text} is too large")));
        }
        Ok(value)
    }

    fn digits(&mut self) -> usize {
        let start = self.index;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.index += 1;
        }
        self.index - start
    }
}

/// Refuses infinities and NaN, naming the operator that produced them.
fn finite(value: f64, op_index: usize, op: char) -> Calc<f64> {
    if value.is_finite() {
        Ok(value)
    } else {
        Err(Parser::error_at(
            op_index,
            format!("the result of '{op}' is not a finite number"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_ledger::ToolResultContent;

    fn value(expression: &str) -> f64 {
        evaluate(expression).unwrap_or_else(|e| panic!("{expression:?}: {e:?}"))
    }

    fn error(expression: &str) -> CalcError {
        match evaluate(expression) {
            Ok(v) => panic!("{expression:?} evaluated to {v}, expected an error"),
            Err(e) => e,
        }
    }

    #[test]
    fn precedence_and_associativity() {
        assert_eq!(value("(17 + 25) * 3"), 126.0);
        assert_eq!(value("1 + 2 * 3"), 7.0);
        assert_eq!(value("10 - 4 - 3"), 3.0);
        assert_eq!(value("100 / 10 / 5"), 2.0);
        assert_eq!(value("7 % 4 * 2"), 6.0);
        assert_eq!(value("2 ^ 3 ^ 2"), 512.0);
        assert_eq!(value("(2 ^ 3) ^ 2"), 64.0);
        assert_eq!(value("2 * 3 ^ 2"), 18.0);
        assert_eq!(value("2^-1"), 0.5);
    }

    #[test]
    fn unary_signs_decimals_and_exponents() {
        assert_eq!(value("-3 + 5"), 2.0);
        assert_eq!(value("--3"), 3.0);
        assert_eq!(value("-(2 + 3) * +2"), -10.0);
        assert_eq!(value("-2 ^ 2"), -4.0);
        assert_eq!(value("(-2) ^ 2"), 4.0);
        assert_eq!(value("1.5e3"), 1500.0);
        assert_eq!(value("2.5E-1 + .5"), 0.75);
        assert_eq!(value("3 * -2"), -6.0);
        assert_eq!(value(" 4 "), 4.0);
    }

    #[test]
    fn syntax_errors_name_the_position() {
        let cases = [
            ("", 1, "empty"),
            ("   ", 4, "empty"),
            ("2 +", 4, "expression ended"),
            ("2 + * 3", 5, "found '*'"),
            ("(1 + 2", 1, "unmatched '('"),
            ("1 + 2)", 6, "unmatched ')'"),
            ("2 3", 3, "expected an operator, found '3'"),
            ("2 & 3", 3, "expected an operator, found '&'"),
            ("1e", 2, "exponent"),
            ("1 + .", 5, "at least one digit"),
            ("(1 2)", 4, "expected ')' to close the '(' at position 1"),
            ("1e999", 1, "too large"),
        ];
        for (expression, position, message) in cases {
            let e = error(expression);
            assert_eq!(e.position, position, "{expression:?}: {e:?}");
            assert!(e.message.contains(message), "{expression:?}: {e:?}");
        }
    }

    #[test]
    fn arithmetic_errors_name_the_operator() {
        let e = error("1 / (2 - 2)");
        assert_eq!((e.position, e.message.as_str()), (3, "division by zero"));
        let e = error("5 % 0");
        assert_eq!((e.position, e.message.as_str()), (3, "modulo by zero"));
        let e = error("10 ^ 400");
        assert_eq!(e.position, 4);
        assert!(e.message.contains("not a finite number"), "{e:?}");
        let e = error("(-8) ^ 0.5");
        assert_eq!(e.position, 6);
        let e = error("1e308 * 10");
        assert_eq!(e.position, 7);
    }

    #[test]
    fn deep_nesting_is_refused_not_a_stack_overflow() {
        let deep = format!("{}1{}", "(".repeat(10_000), ")".repeat(10_000));
        assert!(error(&deep).message.contains("nests deeper"));
        let signs = format!("{}1", "-".repeat(10_000));
        assert!(error(&signs).message.contains("nests deeper"));
        let powers = format!("{}1", "1^".repeat(100_000));
        assert!(error(&powers).message.contains("nests deeper"));
        let fine = format!("{}1{}", "(".repeat(MAX_DEPTH), ")".repeat(MAX_DEPTH));
        assert_eq!(value(&fine), 1.0);
        assert_eq!(value(&format!("{}1", "1^".repeat(MAX_DEPTH))), 1.0);
    }

    #[test]
    fn numbers_print_as_integers_when_exact() {
        assert_eq!(number_json(126.0).to_string(), "126");
        assert_eq!(number_json(-0.0).to_string(), "0");
        assert_eq!(number_json(0.5).to_string(), "0.5");
        assert_eq!(
            number_json(9_007_199_254_740_992.0).to_string(),
            "9007199254740992"
        );
        assert_eq!(number_json(1e300).to_string(), "1e+300");
    }

    fn call(arguments: &str) -> ToolCall {
        ToolCall {
            tool_use_id: "toolu_1".into(),
            name: NAME.into(),
            arguments: arguments.into(),
            idempotency_key: "k".into(),
        }
    }

    #[tokio::test]
    async fn tool_returns_json_or_an_error_output() {
        let out = Calculator
            .call(
                &call(r#"{"expression": "(17 + 25) * 3"}"#),
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        assert!(!out.is_error);
        assert_eq!(
            out.content,
            ToolResultContent::Json(
                JsonText::parse(r#"{"expression":"(17 + 25) * 3","value":126}"#).unwrap()
            )
        );
        let out = Calculator
            .call(
                &call(r#"{"expression": "1/0"}"#),
                &ActivityContext::detached(),
            )
            .await
            .unwrap();
        assert_eq!(
            out,
            ToolOutput::error(r#"cannot evaluate "1/0": division by zero at position 2"#)
        );
        let err = Calculator
            .call(&call(r#"{"expr": "1"}"#), &ActivityContext::detached())
            .await
            .unwrap_err();
        assert!(
            matches!(&err, crate::Error::InvalidArguments { tool, reason }
                if tool == NAME && reason.contains("unknown field `expr`")),
            "{err:?}"
        );
    }

    #[test]
    fn spec_requires_a_string_expression() {
        let spec = Calculator.spec();
        assert_eq!(spec.name, "calculator");
        let schema = spec.input_schema.to_value().unwrap();
        assert_eq!(schema["type"], "object");
        assert_eq!(schema["properties"]["expression"]["type"], "string");
        assert_eq!(schema["required"], serde_json::json!(["expression"]));
    }
}
